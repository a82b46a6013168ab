# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Uncertainty of probe scores: a Wilson interval for one accuracy, a paired bootstrap for comparisons.

`run_linear_probes` attaches `wilson_interval` to every classification result, with the per-image predictions, so
that models probed on the same test images can be compared with `paired_bootstrap_interval` (differences and ratios
of accuracies get the narrower interval their pairing allows). See docs/evaluation.md.

Shape legend: N test images, R bootstrap resamples.
"""

import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Any

import numpy as np


__all__ = ["paired_bootstrap_interval", "wilson_interval"]


def wilson_interval(successes: int, total: int, confidence: float = 0.95) -> tuple[float, float]:
    r"""
    Wilson score interval of a proportion (e.g. an accuracy: correct predictions out of `total` test images).

    Args:
        successes (`int`): e.g. correctly classified images.
        total (`int`): the number of trials (> 0).
        confidence (`float`, *optional*, defaults to 0.95): the interval's coverage.

    Returns:
        `(low, high)` as fractions.
    """
    if total <= 0 or not 0 <= successes <= total:
        raise ValueError(f"Need 0 <= successes <= total and total > 0, got {successes} of {total}.")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / total
    centre = (p + z * z / (2 * total)) / (1 + z * z / total)
    half = z / (1 + z * z / total) * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact ends: no rounding residue at 0 or 1
    high = 1.0 if successes == total else min(1.0, centre + half)
    return low, high


def paired_bootstrap_interval(
    statistic: Callable[..., Any], *correct: Any, num_resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    r"""
    Percentile bootstrap interval of a statistic of several accuracies measured on the same test images.

    The test images are resampled with replacement, the same resample for every model (paired), so differences and
    ratios of accuracies get the narrower interval they deserve.

    Args:
        statistic (`Callable`): maps one accuracy array per model, each `(R,)`, to the statistic's `(R,)` values
            (vectorised), e.g. `lambda a, b: a - b`.
        *correct (`(N,)` bools or 0/1 arrays): per test image, whether each model got it right (same images, same
            order).
        num_resamples (`int`, *optional*, defaults to 2000): bootstrap resamples `R`.
        confidence (`float`, *optional*, defaults to 0.95): the interval's coverage.
        seed (`int`, *optional*, defaults to 0): seeds the resampling.

    Returns:
        `(low, high)`; resamples where the statistic is not finite (e.g. a ratio over zero) are dropped, and both are
        NaN when none is left.
    """
    arrays = [np.asarray(c, dtype=np.float64) for c in correct]
    if not arrays or len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1 or arrays[0].size == 0:
        raise ValueError("Give one non-empty (N,) correctness array per model, all of the same length.")
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, arrays[0].size, size=(num_resamples, arrays[0].size))  # (R, N)
    with np.errstate(divide="ignore", invalid="ignore"):
        values = np.asarray(statistic(*(a[indices].mean(axis=1) for a in arrays)), dtype=np.float64)  # (R,)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return float("nan"), float("nan")
    tail = 100 * (1 - confidence) / 2
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))
