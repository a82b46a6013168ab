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
"""

from pathlib import Path

import evaluate


METRICS_DIR = Path(__file__).resolve().parent


def available_metrics() -> list[str]:
    """Names of the metric modules shipped with veca_hf (`["accuracy", "mean_iou"]`)."""
    return sorted(path.parent.name for path in METRICS_DIR.glob("*/*.py") if path.stem == path.parent.name)


def load_metric(name: str, **kwargs) -> evaluate.EvaluationModule:
    """
    Load one of the metrics shipped with veca_hf, offline or online.

    Args:
        name (`str`):
            `"accuracy"` or `"mean_iou"` (see `available_metrics()`).
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


__all__ = ["METRICS_DIR", "available_metrics", "load_metric"]
