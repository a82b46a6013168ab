# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Monocular depth metrics: RMSE, absolute relative error and the delta < 1.25 accuracy, over valid pixels only.

A local `evaluate` metric module, shipped inside `veca_hf` so that it loads without the Hub:
`veca_hf.metrics.load_metric("depth")`, or `evaluate.load("<path to this folder>")`. There is no Hub
`evaluate-metric` module for depth; the definitions are those of Eigen et al. (NeurIPS 2014), the ones NYUv2 and
KITTI results report.

NOTE: `evaluate.load` copies this file into its modules cache and imports it from there, so it must import nothing
from `veca_hf` (or any other local file).
"""

import datasets
import evaluate
import numpy as np


_DESCRIPTION = """
Depth errors over the set T of valid pixels of all images together (pooled, not averaged per image):

    rmse    = sqrt(1/|T| sum_{p in T} (pred_p - gt_p)^2)
    abs_rel = 1/|T| sum_{p in T} |pred_p - gt_p| / gt_p
    delta1  = 1/|T| |{p in T : max(pred_p / gt_p, gt_p / pred_p) < 1.25}|

This is the usual NYUv2 convention (Eigen et al. 2014 define T as the pixels of the whole evaluation set). Toolkits
that average per image first (e.g. Monodepth2, BTS) give slightly different numbers when images have different
numbers of valid pixels.

A pixel is valid when its reference is finite and positive: a reference of 0 or NaN marks a pixel without ground
truth (the Kinect's and the LiDAR's holes), and it is ignored whatever the prediction there. A prediction must be
finite wherever its reference is valid. A prediction <= 0 at a valid pixel counts in rmse and abs_rel as it is and
as a miss in delta1 (its ratio is taken as infinite). `rmse` is in the unit of the inputs (metres, usually);
`abs_rel` and `delta1` have none.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of float arrays, or one float array):
        Predicted depth maps. With `.compute`, a list of `(height, width)` maps (sizes may differ between images);
        `veca_hf.metrics.compute_metric("depth", ...)` also takes arrays of any shape, e.g. `(N, H, W)`.
    references (same structure as `predictions`):
        Ground-truth depth maps, each the shape of its prediction; 0 or NaN = no ground truth.

Returns:
    rmse (`float`): root mean squared error over the valid pixels.
    abs_rel (`float`): mean absolute relative error over the valid pixels.
    delta1 (`float`): fraction of valid pixels with max(pred / gt, gt / pred) < 1.25, in [0, 1].

Raises:
    `ValueError`: if a prediction and its reference differ in shape, a reference is negative, a prediction is not
    finite where its reference is valid, or no pixel at all is valid.

Examples:

    >>> depth = evaluate.load("path/to/veca_hf/metrics/depth")
    >>> predictions = [np.array([[1.0, 2.0], [4.0, 7.0]])]
    >>> references = [np.array([[1.0, 2.5], [0.0, np.nan]])]  # the last two pixels have no ground truth
    >>> depth.compute(predictions=predictions, references=references)  # 2.5 / 2.0 = 1.25 is not < 1.25
    {'rmse': 0.3535533905932738, 'abs_rel': 0.1, 'delta1': 0.5}
"""

_CITATION = """
@inproceedings{eigen2014depth,
  title={Depth Map Prediction from a Single Image using a Multi-Scale Deep Network},
  author={Eigen, David and Puhrsch, Christian and Fergus, Rob},
  booktitle={Advances in Neural Information Processing Systems},
  year={2014}
}
"""

DELTA_THRESHOLD = 1.25


def _pairs(predictions, references) -> list[tuple[np.ndarray, np.ndarray]]:
    """`(prediction, reference)` float64 arrays of one shape each: per image for lists, one pair for arrays."""
    if isinstance(predictions, np.ndarray) or isinstance(references, np.ndarray):
        pairs = [(predictions, references)]
    else:
        predictions, references = list(predictions), list(references)
        if len(predictions) != len(references):
            raise ValueError(f"Got {len(predictions)} predictions for {len(references)} references.")
        pairs = list(zip(predictions, references, strict=True))
    arrays = []
    for index, (prediction, reference) in enumerate(pairs):
        prediction, reference = np.asarray(prediction, np.float64), np.asarray(reference, np.float64)
        if prediction.shape != reference.shape:
            where = "" if len(pairs) == 1 else f" (image {index})"
            raise ValueError(
                f"A prediction of shape {prediction.shape} was given for a reference of shape {reference.shape}"
                f"{where}: depth maps are compared pixel by pixel, so resize the prediction to the reference first."
            )
        arrays.append((prediction, reference))
    return arrays


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Depth(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        depth_map = datasets.List(datasets.List(datasets.Value("float32")))
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": depth_map, "references": depth_map}),
            reference_urls=["https://arxiv.org/abs/1406.2283"],
        )

    def _compute(self, predictions, references) -> dict:
        squared_error = relative_error = hits = 0.0
        count = 0
        for index, (prediction, reference) in enumerate(_pairs(predictions, references)):
            if np.any(reference < 0):  # NaN compares False: only real negative values
                raise ValueError(
                    f"References hold negative depths (image {index}, minimum {np.nanmin(reference)}): depth is a "
                    "distance, >= 0, with 0 (or NaN) marking pixels without ground truth."
                )
            valid = np.isfinite(reference) & (reference > 0)
            prediction, reference = prediction[valid], reference[valid]  # (P,) each
            if not np.all(np.isfinite(prediction)):
                raise ValueError(
                    f"Predictions hold {int((~np.isfinite(prediction)).sum())} non-finite values (NaN or inf) at "
                    f"pixels with ground truth (image {index}): a depth model must predict a number there."
                )
            squared_error += float(np.square(prediction - reference).sum())
            relative_error += float((np.abs(prediction - reference) / reference).sum())
            with np.errstate(divide="ignore"):  # prediction 0 -> ratio inf -> a miss
                ratio = np.where(prediction > 0, np.maximum(prediction / reference, reference / prediction), np.inf)
            hits += float((ratio < DELTA_THRESHOLD).sum())
            count += int(valid.sum())
        if count == 0:
            raise ValueError(
                "No valid pixel: every reference is 0 or NaN (no ground truth), so there is nothing to score. Check "
                "the depth maps and their scale."
            )
        return {
            "rmse": float(np.sqrt(squared_error / count)),
            "abs_rel": relative_error / count,
            "delta1": hits / count,
        }
