# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Accuracy: the (optionally weighted) fraction of predictions equal to their reference.

A local `evaluate` metric module, shipped inside `veca_hf` so that it loads without the Hub:
`veca_hf.metrics.load_metric("accuracy")`, or `evaluate.load("<path to this folder>")`. It takes the same inputs and
returns the same key as the Hub's `evaluate-metric/accuracy`, computed with numpy instead of scikit-learn.

NOTE: `evaluate.load` copies this file into its modules cache and imports it from there, so it must import nothing
from `veca_hf` (or any other local file).
"""

import datasets
import evaluate
import numpy as np


_DESCRIPTION = """
Accuracy is the proportion of correct predictions among all predictions:

    accuracy = (TP + TN) / (TP + TN + FP + FN) = sum_i w_i [prediction_i == reference_i] / sum_i w_i

with weights `w_i = 1` unless `sample_weight` is given. With the `"multilabel"` configuration, a prediction counts as
correct only if its whole label vector equals the reference (subset accuracy).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`, or of `list` of `int` for `"multilabel"`):
        Predicted labels.
    references (`list` of `int`, or of `list` of `int` for `"multilabel"`):
        Ground-truth labels, one per prediction.
    normalize (`bool`, *optional*, defaults to `True`):
        If `False`, return the (weighted) number of correct predictions instead of the fraction.
    sample_weight (`list` of `float`, *optional*):
        One non-negative weight per prediction.

Returns:
    accuracy (`float` or `int`): in `[0, 1]` when `normalize=True`; the (weighted) count of correct predictions
    otherwise (an `int` without weights).

Examples:

    >>> accuracy = evaluate.load("path/to/veca_hf/metrics/accuracy")
    >>> accuracy.compute(predictions=[0, 1, 2, 1], references=[0, 1, 1, 1])
    {'accuracy': 0.75}
    >>> accuracy.compute(predictions=[0, 1, 2, 1], references=[0, 1, 1, 1], normalize=False)
    {'accuracy': 3}
    >>> accuracy.compute(predictions=[0, 1, 2, 1], references=[0, 1, 1, 1], sample_weight=[1, 1, 2, 0])
    {'accuracy': 0.5}
"""

_CITATION = """
@article{scikit-learn,
  title={Scikit-learn: Machine Learning in {P}ython},
  author={Pedregosa, F. and Varoquaux, G. and Gramfort, A. and Michel, V. and Thirion, B. and Grisel, O. and
          Blondel, M. and Prettenhofer, P. and Weiss, R. and Dubourg, V. and Vanderplas, J. and Passos, A. and
          Cournapeau, D. and Brucher, M. and Perrot, M. and Duchesnay, E.},
  journal={Journal of Machine Learning Research},
  volume={12},
  pages={2825--2830},
  year={2011}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        if self.config_name == "multilabel":
            label = datasets.List(datasets.Value("int64"))
        else:
            label = datasets.Value("int64")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": label, "references": label}),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references, normalize: bool = True, sample_weight=None) -> dict:
        predictions, references = np.asarray(predictions), np.asarray(references)
        if predictions.shape != references.shape:
            raise ValueError(
                f"predictions {predictions.shape} and references {references.shape} must have the same shape."
            )
        correct = predictions == references  # (n,) or (n, labels)
        if correct.ndim > 1:  # multilabel: all labels of a sample must match
            correct = correct.reshape(len(correct), -1).all(axis=1)
        if sample_weight is None:
            if not normalize:
                return {"accuracy": int(correct.sum())}
            return {"accuracy": float(correct.mean()) if len(correct) else float("nan")}
        weights = np.asarray(sample_weight, dtype=np.float64)
        if weights.shape != correct.shape:
            raise ValueError(
                f"sample_weight has shape {weights.shape}, expected one weight per prediction {correct.shape}."
            )
        if np.any(weights < 0):
            raise ValueError("sample_weight must be non-negative.")
        total = float((weights * correct).sum())
        if not normalize:
            return {"accuracy": total}
        return {"accuracy": total / float(weights.sum()) if weights.sum() > 0 else float("nan")}
