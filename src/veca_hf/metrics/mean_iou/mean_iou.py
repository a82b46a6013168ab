# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Mean intersection over union (mIoU) for semantic segmentation, with per-class IoU and accuracy.

A local `evaluate` metric module, shipped inside `veca_hf` so that it loads without the Hub:
`veca_hf.metrics.load_metric("mean_iou")`, or `evaluate.load("<path to this folder>")`. Inputs, arguments and
returned keys follow the Hub's `evaluate-metric/mean_iou` (itself following MMSegmentation), computed with numpy.

NOTE: `evaluate.load` copies this file into its modules cache and imports it from there, so it must import nothing
from `veca_hf` (or any other local file).
"""

import datasets
import evaluate
import numpy as np


_DESCRIPTION = """
Intersection over union per class c, with pixels counted over the whole evaluation set (not averaged per image):

    IoU_c = |pred == c and label == c| / |pred == c or label == c|
    accuracy_c = |pred == c and label == c| / |label == c|

Pixels whose label equals `ignore_index` are dropped first. A class absent from both predictions and labels has IoU
NaN, and a class absent from the labels has accuracy NaN; NaNs are left out of `mean_iou` and `mean_accuracy`.
Labels (and predictions) outside `[0, num_labels)` count in no class; such a prediction still counts against the
label it missed. `overall_accuracy` is the fraction of kept pixels predicted correctly.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of 2D integer arrays `(height, width)`):
        Predicted segmentation maps, one per image (sizes may differ between images).
    references (`list` of 2D integer arrays `(height, width)`):
        Ground-truth segmentation maps, each the size of its prediction.
    num_labels (`int`):
        Number of classes (after `reduce_labels`).
    ignore_index (`int`):
        Label value that marks pixels to leave out (255 in ADE20K and PASCAL VOC).
    nan_to_num (`float`, *optional*):
        Replace NaN in the returned values (per-class and means) by this number.
    label_map (`dict[int, int]`, *optional*):
        Old label id -> new label id, applied to the references (all at once) before anything else.
    reduce_labels (`bool`, *optional*, defaults to `False`):
        Treat label 0 as background to ignore: 0 becomes `255` and every other label is decreased by one (ADE20K's
        convention); use `ignore_index=255` with it.

Returns:
    mean_iou (`float`): mean of the per-class IoUs, NaN classes left out.
    mean_accuracy (`float`): mean of the per-class accuracies, NaN classes left out.
    overall_accuracy (`float`): correctly predicted pixels / kept pixels.
    per_category_iou (`np.ndarray` of shape `(num_labels,)`): IoU of each class.
    per_category_accuracy (`np.ndarray` of shape `(num_labels,)`): accuracy of each class.

Examples:

    >>> mean_iou = evaluate.load("path/to/veca_hf/metrics/mean_iou")
    >>> predictions = [np.array([[0, 1], [1, 1]])]
    >>> references = [np.array([[0, 1], [0, 255]])]
    >>> results = mean_iou.compute(predictions=predictions, references=references, num_labels=3, ignore_index=255)
    >>> results["per_category_iou"]  # class 2 is absent everywhere
    array([0.5, 0.5, nan])
    >>> results["mean_iou"]
    0.5
"""

_CITATION = """
@software{MMSegmentation_Contributors_OpenMMLab_Semantic_Segmentation_2020,
  author = {{MMSegmentation Contributors}},
  license = {Apache-2.0},
  month = {7},
  title = {{OpenMMLab Semantic Segmentation Toolbox and Benchmark}},
  url = {https://github.com/open-mmlab/mmsegmentation},
  year = {2020}
}
"""


def intersect_and_union(
    prediction: np.ndarray,
    reference: np.ndarray,
    num_labels: int,
    ignore_index: int,
    label_map: dict[int, int] | None = None,
    reduce_labels: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pixel counts of one image, each of shape `(num_labels,)`: intersection, union, predicted, labelled."""
    prediction, reference = np.asarray(prediction), np.array(reference)  # a copy: the label edits stay local
    if prediction.shape != reference.shape:
        raise ValueError(
            f"A prediction of shape {prediction.shape} was given for a reference of shape {reference.shape}."
        )
    if label_map:
        original = reference.copy()
        for old_id, new_id in label_map.items():
            reference[original == old_id] = new_id
    if reduce_labels:
        reference = reference.astype(np.int64)
        background = reference == 0
        reference = reference - 1
        reference[background] = 255
        reference[reference == 254] = 255
    keep = reference != ignore_index
    prediction, reference = prediction[keep].astype(np.int64), reference[keep].astype(np.int64)  # (P,)

    def count(values: np.ndarray) -> np.ndarray:
        values = values[(values >= 0) & (values < num_labels)]
        return np.bincount(values, minlength=num_labels).astype(np.float64)

    area_intersect = count(prediction[prediction == reference])
    area_prediction, area_reference = count(prediction), count(reference)
    area_union = area_prediction + area_reference - area_intersect
    return area_intersect, area_union, area_prediction, area_reference


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MeanIoU(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        segmentation_map = datasets.List(datasets.List(datasets.Value("int64")))
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": segmentation_map, "references": segmentation_map}),
            reference_urls=[
                "https://github.com/open-mmlab/mmsegmentation/blob/main/mmseg/evaluation/metrics/iou_metric.py"
            ],
        )

    def _compute(
        self,
        predictions,
        references,
        num_labels: int,
        ignore_index: int,
        nan_to_num: float | None = None,
        label_map: dict[int, int] | None = None,
        reduce_labels: bool = False,
    ) -> dict:
        if len(predictions) != len(references):
            raise ValueError(f"Got {len(predictions)} predictions for {len(references)} references.")
        total_intersect = np.zeros(num_labels, dtype=np.float64)
        total_union, total_prediction, total_reference = (np.zeros_like(total_intersect) for _ in range(3))
        for prediction, reference in zip(predictions, references, strict=False):
            intersect, union, area_prediction, area_reference = intersect_and_union(
                prediction, reference, num_labels, ignore_index, label_map, reduce_labels
            )
            total_intersect += intersect
            total_union += union
            total_prediction += area_prediction
            total_reference += area_reference

        with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0 -> NaN marks an absent class
            per_category_iou = total_intersect / total_union
            per_category_accuracy = total_intersect / total_reference
            overall_accuracy = total_intersect.sum() / total_reference.sum()

        def nan_mean(values: np.ndarray) -> float:
            values = values[~np.isnan(values)]
            return float(values.mean()) if values.size else float("nan")

        results = {
            "mean_iou": nan_mean(per_category_iou),
            "mean_accuracy": nan_mean(per_category_accuracy),
            "overall_accuracy": float(overall_accuracy),
            "per_category_iou": per_category_iou,
            "per_category_accuracy": per_category_accuracy,
        }
        if nan_to_num is not None:
            results = {key: np.nan_to_num(value, nan=nan_to_num) for key, value in results.items()}
            results.update({key: float(results[key]) for key in ("mean_iou", "mean_accuracy", "overall_accuracy")})
        return results
