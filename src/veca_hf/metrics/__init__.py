# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""The `evaluate` metric modules that veca_hf uses, shipped inside the package so they load offline.

`evaluate.load("accuracy")` downloads the metric's script from the Hub (and fails offline); `load_metric("accuracy")`
loads the copy in this folder with `evaluate.load(<local folder>)`, which never touches the network, so the same code
runs offline and online.

```python
from veca_hf.metrics import load_metric

accuracy = load_metric("accuracy")
print(accuracy.compute(predictions=[0, 1, 2], references=[0, 1, 1]))  # {'accuracy': 0.666...}
```

Each metric is a folder `<name>/<name>.py` holding one `evaluate.Metric` (the layout `evaluate.load` expects of a
local folder). `evaluate` copies the script into its modules cache (`$HF_MODULES_CACHE/evaluate_modules/metrics/
<name>/<hash of the code>/`, `~/.cache/huggingface/modules` by default) and imports it from there, creating the
cache on first use; the hash keeps an edited script from reusing a stale copy.

These modules are the only definitions of accuracy, mIoU and the depth errors (RMSE, AbsRel, delta1) in veca_hf:
`Trainer` fine-tuning calls `.compute` on them, and the linear probes (`veca_hf.evaluation`) call `compute_metric`,
which runs the same code on arrays already in memory.
"""

import functools
from pathlib import Path
from typing import Any

import evaluate


METRICS_DIR = Path(__file__).resolve().parent


def available_metrics() -> list[str]:
    """Names of the metric modules shipped with veca_hf (`["accuracy", "depth", "mean_iou"]`)."""
    return sorted(path.parent.name for path in METRICS_DIR.glob("*/*.py") if path.stem == path.parent.name)


def load_metric(name: str, **kwargs) -> evaluate.EvaluationModule:
    """
    Load one of the metrics shipped with veca_hf, offline or online.

    Args:
        name (`str`):
            `"accuracy"`, `"mean_iou"` or `"depth"` (see `available_metrics()`).
        kwargs:
            Passed to `evaluate.load` (`config_name="multilabel"` for accuracy, `keep_in_memory`, `experiment_id`,
            `cache_dir`, ...).

    Returns:
        `evaluate.EvaluationModule`: the metric; call `.compute(predictions=..., references=...)` on it.

    Raises:
        `ValueError`: if `name` is not a shipped metric; the message lists the ones that are.
    """
    folder = METRICS_DIR / name
    if not (folder / f"{name}.py").is_file():
        raise ValueError(
            f"veca_hf ships no metric named {name!r}; available: {available_metrics()}. For other metrics use "
            f"`evaluate.load({name!r})` (which needs the Hub) or a local metric folder."
        )
    return evaluate.load(str(folder), **kwargs)


@functools.cache
def _cached_metric(name: str) -> evaluate.EvaluationModule:
    return load_metric(name)


def compute_metric(name: str, predictions: Any, references: Any, **kwargs) -> dict[str, Any]:
    r"""
    A shipped metric of arrays already in memory: the numbers `load_metric(name).compute(...)` gives, without the
    round trip through `evaluate`'s Arrow table.

    NOTE: `EvaluationModule.compute` first writes every input to an Arrow table and reads it back as Python lists;
    for segmentation masks (PASCAL Context's validation set holds ~1.3G pixels at 512 px) that costs minutes and
    gigabytes. This calls the module's `_compute`, the method an `evaluate.Metric` implements (the definition
    itself), on the arrays directly.

    Args:
        name (`str`):
            `"accuracy"`, `"mean_iou"` or `"depth"` (see `available_metrics()`).
        predictions / references (array-likes):
            As the metric takes them: `(N,)` class indices for accuracy; `N` label maps (a list of `(H, W)` arrays
            or one `(N, H, W)` array) for mean_iou; depth maps of any shape (float, 0 or NaN = no ground truth)
            for depth.
        kwargs:
            The metric's arguments (`num_labels` and `ignore_index` for mean_iou, ...).

    Returns:
        `dict`: what `.compute` returns.
    """
    return _cached_metric(name)._compute(predictions=predictions, references=references, **kwargs)


__all__ = ["METRICS_DIR", "available_metrics", "compute_metric", "load_metric"]
