# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Model cards for the folders veca_hf writes, and pushing a folder to the Hugging Face Hub.

`write_model_card(folder, ...)` writes `README.md` with `huggingface_hub.ModelCard`: Hub metadata (license,
`library_name`, `pipeline_tag`, tags, the teacher as `base_model`, datasets), then the model's size, its training
data, a per-budget table (quality where measured, FLOPs from `veca_hf.flops`, latency measured on the current
device), how to load it and how to pick a budget. The converter (`veca_hf.convert_veca_original`),
`examples/distill.py` and `examples/finetune_classification.py` call it on the folders they save.

`push_to_hub(folder, repo_id)` uploads such a folder (model, image processor and card) in one commit.
"""

import platform
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData
from transformers.utils import logging

from .configuration_veca import VECA_PRESET_TEACHERS, VECA_PRESETS, VecaConfig
from .flops import veca_model_flops
from .modeling_veca import VecaForImageClassification, VecaModel
from .training import pick_budget


logger = logging.get_logger(__name__)

__all__ = [
    "budget_metrics_from_results",
    "create_hub_repo",
    "load_saved_model",
    "preset_teacher",
    "push_to_hub",
    "resolve_hub_model_id",
    "write_model_card",
]

PAPER_URL = "https://arxiv.org/abs/2605.12491"
# Run artefacts that never belong in a Hub repository (resumable checkpoints, logs).
HUB_IGNORE_PATTERNS = ["checkpoints/*", "checkpoint-*", "sample_sources/*", "runs/*", "_*", "*.tmp"]
# Trainer bookkeeping that `evaluate_budgets` also reports per budget: not a quality measure.
_NOT_QUALITY = {"runtime", "samples_per_second", "steps_per_second", "epoch"}


def load_saved_model(model_dir: str | Path) -> VecaModel | VecaForImageClassification:
    """Loads a saved folder as the class it was saved from (`config.architectures`), in eval mode."""
    config = VecaConfig.from_pretrained(model_dir)
    if "VecaForImageClassification" in (config.architectures or []):
        return VecaForImageClassification.from_pretrained(model_dir).eval()
    return VecaModel.from_pretrained(model_dir).eval()


def preset_teacher(config: VecaConfig) -> str | None:
    """The DINOv3 teacher of the released size that `config` has, or `None` if it matches no preset."""
    for name, sizes in VECA_PRESETS.items():
        if all(getattr(config, key) == value for key, value in sizes.items()) and config.patch_size == 16:
            return VECA_PRESET_TEACHERS[name]
    return None


def budget_metrics_from_results(results: Mapping[str, float], prefix: str = "eval") -> dict[int, dict[str, float]]:
    """`{"eval_C8_accuracy": 0.9, "eval_C8_runtime": 1.2, ...}` (from `evaluate_budgets`) -> `{8: {"accuracy": 0.9}}`.

    Timing and bookkeeping entries (`runtime`, `samples_per_second`, `steps_per_second`, `epoch`) are left out.
    """
    pattern = re.compile(rf"{re.escape(prefix)}_C(\d+)_(.+)")
    metrics: dict[int, dict[str, float]] = {}
    for key, value in results.items():
        match = pattern.fullmatch(key)
        if match and match.group(2) not in _NOT_QUALITY:
            metrics.setdefault(int(match.group(1)), {})[match.group(2)] = float(value)
    return dict(sorted(metrics.items()))


def resolve_hub_model_id(
    output_dir: str | Path, push_to_hub: bool, hub_model_id: str | None = None, hub_token: str | None = None
) -> str | None:
    """The repository to push to: `hub_model_id`, else the output folder's name (as `Trainer` does); `None` if not
    pushing.

    Raises `ValueError` for `hub_model_id` or `hub_token` without `push_to_hub` (transformers ignores them silently,
    which hides a forgotten flag).
    """
    if not push_to_hub:
        given = [name for name, value in (("--hub_model_id", hub_model_id), ("--hub_token", hub_token)) if value]
        if given:
            raise ValueError(
                f"{' and '.join(given)} given without --push_to_hub: add --push_to_hub to upload the "
                f"folder, or drop {' and '.join(given)}."
            )
        return None
    return hub_model_id or Path(output_dir).absolute().name


def create_hub_repo(repo_id: str, *, token: str | None = None, private: bool | None = None) -> str:
    """Creates the Hub repository if needed (as `Trainer` does before training) and returns its full id, `"user/name"`.

    Call it before long work: a missing login or a taken name then fails at once, and the card can name the full id.
    """
    return HfApi(token=token).create_repo(repo_id, private=private, exist_ok=True).repo_id


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload VECA model",
    ignore_patterns: Iterable[str] = (),
) -> str:
    """
    Uploads a saved folder (model, image processor, model card) to the Hub in one commit.

    The repository is created if needed. Resumable checkpoints, logs and temporary files are not uploaded
    (`HUB_IGNORE_PATTERNS`).

    Args:
        folder (`str` or `Path`): The folder to upload.
        repo_id (`str`): `"user/name"`, or `"name"` for the token's own namespace.
        token (`str`, *optional*): A write token; defaults to the cached login or `HF_TOKEN`.
        private (`bool`, *optional*): Make a newly created repository private.
        commit_message (`str`, *optional*): The commit message.
        ignore_patterns (`Iterable[str]`, *optional*): More glob patterns to leave out.

    Returns:
        `str`: the full repository id (`"user/name"`).
    """
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(folder)!r} holds no config.json: save the model there before pushing it.")
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        commit_message=commit_message,
        ignore_patterns=[*HUB_IGNORE_PATTERNS, *ignore_patterns],
    )
    logger.info(f"Pushed {folder} to https://huggingface.co/{repo_id}")
    return repo_id


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return f"CPU ({platform.machine()}, {threads} thread{'s' if threads != 1 else ''}), torch {torch.__version__}"
    return f"{device.type}, torch {torch.__version__}"


def _measure_latencies(model, resolutions: Sequence[int], repeats: int) -> tuple[dict[int, dict[int, float]], str]:
    """`{resolution: {budget: median ms}}` at batch 1 via `pick_budget`, and how and where it was measured."""
    latencies = {}
    for resolution in resolutions:
        choice = pick_budget(model, resolution, latency_target_ms=float("inf"), warmup=1, repeats=repeats)
        latencies[resolution] = choice.latencies_ms
    parameter = next(model.parameters())
    return latencies, f"{str(parameter.dtype).removeprefix('torch.')} on {_device_description(parameter.device)}"


def _is_hub_id(name: str) -> bool:
    """`"user/name"` (or `"name"`) that is not a local path: only those may go into the card's metadata."""
    return bool(re.fullmatch(r"([\w.-]+/)?[\w.-]+", name)) and not Path(name).exists()


def _format_metric(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"


def _budget_table(
    config: VecaConfig,
    resolutions: Sequence[int],
    budget_metrics: Mapping[int, Mapping[str, float]],
    latencies: Mapping[int, Mapping[int, float]] | None,
) -> str:
    metric_names = list(dict.fromkeys(name for values in budget_metrics.values() for name in values))
    header = ["budget C", *metric_names, *(f"GFLOPs @ {r} px" for r in resolutions)]
    if latencies:
        header += [f"latency (ms) @ {r} px" for r in resolutions]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for budget in config.budgets:
        measured = budget_metrics.get(budget, {})
        row = [str(budget)]
        row += [_format_metric(measured[name]) if name in measured else "–" for name in metric_names]
        row += [f"{veca_model_flops(config, r, r, budget) / 1e9:.2f}" for r in resolutions]
        if latencies:
            row += [f"{latencies[r][budget]:.1f}" for r in resolutions]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_model_card(
    model_dir: str | Path,
    *,
    model: VecaModel | VecaForImageClassification | None = None,
    model_id: str | None = None,
    base_model: str | None = None,
    datasets: str | Sequence[str] | None = None,
    budget_metrics: Mapping[int, Mapping[str, float]] | None = None,
    metrics_description: str | None = None,
    description: str | None = None,
    training_details: Mapping[str, Any] | None = None,
    license: str = "apache-2.0",
    pipeline_tag: str | None = None,
    tags: Sequence[str] = (),
    resolutions: Sequence[int] | None = None,
    measure_latency: bool = True,
    latency_repeats: int = 3,
) -> ModelCard:
    """
    Writes `model_dir/README.md`, a Hub model card for a saved VECA folder, and returns it.

    Args:
        model_dir (`str` or `Path`):
            A folder with a saved `VecaModel` or `VecaForImageClassification` (`config.json`).
        model (`VecaModel` or `VecaForImageClassification`, *optional*):
            The model in memory, to time it where it is (e.g. on the training GPU); otherwise it is loaded from
            `model_dir` onto the CPU when latency is measured.
        model_id (`str`, *optional*):
            The Hub id used in the card's title and loading snippets; defaults to the folder's name.
        base_model (`str`, *optional*):
            The teacher the model was distilled from, or the model it was fine-tuned from. A Hub id goes into the
            metadata; a local path is only named in the text (the Hub rejects ids that are not repositories).
        datasets (`str` or `Sequence[str]`, *optional*):
            The training data: Hub dataset ids (also put in the metadata) or local paths and short descriptions;
            the card says "not recorded" without them.
        budget_metrics (`Mapping[int, Mapping[str, float]]`, *optional*):
            Measured quality per budget, e.g. `{8: {"accuracy": 0.71}, 64: {"accuracy": 0.80}}`; one column per
            metric name, "–" where a budget was not measured.
        metrics_description (`str`, *optional*):
            What the metrics are and on which data (shown under the table).
        description (`str`, *optional*):
            How this folder was made (converted, distilled, fine-tuned), shown under the title.
        training_details (`Mapping[str, Any]`, *optional*):
            Hyperparameters and other facts of the run, shown as a two-column table.
        license (`str`, *optional*, defaults to `"apache-2.0"`):
            The license identifier for the Hub metadata.
        pipeline_tag (`str`, *optional*):
            Defaults to `"image-classification"` for a classifier, else `"image-feature-extraction"`.
        tags (`Sequence[str]`, *optional*):
            Extra Hub tags.
        resolutions (`Sequence[int]`, *optional*):
            Square input sides (multiples of the patch size) for the FLOPs and latency columns. Defaults to 16 and
            32 patches per side: 256 and 512 px at patch 16, 224 and 448 px at patch 14.
        measure_latency (`bool`, *optional*, defaults to `True`):
            Time every budget at each resolution (batch 1, median of `latency_repeats` passes after one warm-up,
            with `veca_hf.training.pick_budget`). `False` leaves the columns out and says so in the card.
        latency_repeats (`int`, *optional*, defaults to 3):
            Timed passes per budget and resolution.

    Returns:
        `huggingface_hub.ModelCard`: the card written to `model_dir/README.md`.
    """
    model_dir = Path(model_dir)
    config = VecaConfig.from_pretrained(model_dir)
    is_classifier = "VecaForImageClassification" in (config.architectures or [])
    resolutions = tuple(resolutions) if resolutions else (16 * config.patch_size, 32 * config.patch_size)
    for resolution in resolutions:
        if resolution % config.patch_size:
            raise ValueError(
                f"Resolution {resolution} is not a multiple of patch_size={config.patch_size}: pass `resolutions` "
                f"that are (e.g. {16 * config.patch_size} and {32 * config.patch_size})."
            )
    datasets = [datasets] if isinstance(datasets, str) else list(datasets or [])
    budget_metrics = {int(budget): dict(values) for budget, values in (budget_metrics or {}).items()}
    for budget in budget_metrics:
        config.check_budget(budget, name="budget_metrics key")
    model_id = model_id or model_dir.absolute().name
    pipeline_tag = pipeline_tag or ("image-classification" if is_classifier else "image-feature-extraction")

    latencies, latency_device = None, None
    if measure_latency:
        latencies, latency_device = _measure_latencies(
            model if model is not None else load_saved_model(model_dir), resolutions, latency_repeats
        )
    with torch.device("meta"):  # shapes only: counts parameters without memory or initialisation
        num_parameters = sum(
            p.numel() for p in (VecaForImageClassification if is_classifier else VecaModel)(config).parameters()
        )

    card_data = ModelCardData(
        license=license,
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=list(dict.fromkeys(["veca", "vision", pipeline_tag, "custom_code", *tags])),
        # NOTE: the Hub checks that these name repositories; local paths are only mentioned in the text.
        base_model=base_model if base_model and _is_hub_id(base_model) else None,
        datasets=[name for name in datasets if _is_hub_id(name)] or None,
    )

    sections = [f"# {model_id.split('/')[-1]}"]
    sections.append(
        f"A VECA (Visual Elastic Core Attention, [arXiv 2605.12491]({PAPER_URL})) vision transformer: its patches "
        "never attend to each other, they exchange information only through a bank of learned *core* tokens. A "
        "prefix of "
        f"`C` cores is active, chosen per call: the budget `C` (any of {config.budgets}) trades quality for compute "
        "with the same weights, and attention cost grows linearly with the number of patches."
        + (f"\n\n{description}" if description else "")
    )

    head = "a linear classifier on the first core" if is_classifier else "no head (features)"
    details = [
        "| | |",
        "|---|---|",
        f"| class | `{'VecaForImageClassification' if is_classifier else 'VecaModel'}`, {head} |",
        f"| parameters | {num_parameters / 1e6:.2f}M |",
        f"| layers / width / heads / MLP | {config.num_hidden_layers} / {config.hidden_size} / "
        f"{config.num_attention_heads} / {config.intermediate_size} (SwiGLU) |",
        f"| patch size | {config.patch_size} |",
        f"| core bank | {config.num_core_tokens} cores in chunks of {config.core_chunk_size} |",
        f"| default budget | {config.default_num_core_tokens or config.num_core_tokens} "
        "(`config.default_num_core_tokens`) |",
    ]
    if base_model:
        link = (
            f"[`{base_model}`](https://huggingface.co/{base_model})" if _is_hub_id(base_model) else f"`{base_model}`"
        )
        details.append(f"| base model | {link} |")
    if is_classifier:
        details.append(f"| labels | {config.num_labels} |")
    sections.append("## Model details\n\n" + "\n".join(details))

    data = "\n".join(f"- `{name}`" for name in datasets) if datasets else "Not recorded for this folder."
    if base_model:
        data += (
            f"\n\nThe weights derive from `{base_model}`: check its license for terms that apply to models "
            "trained from it."
        )
    sections.append("## Training data\n\n" + data)
    if training_details:
        rows = "\n".join(f"| {key} | {value} |" for key, value in training_details.items())
        sections.append("## Training details\n\n| | |\n|---|---|\n" + rows)

    notes = [
        "FLOPs: one forward pass of one square image, counted by `veca_hf.flops.veca_model_flops` (one multiply-add = "
        "2 FLOPs; matmuls, linears and convolutions, as `torch.utils.flop_counter` counts them)."
    ]
    if budget_metrics:
        notes.append(f"Quality: {metrics_description or 'as measured when the folder was written'}.")
    if latencies:
        notes.append(
            f"Latency: median of {latency_repeats} forward passes (batch 1, after one warm-up) in {latency_device}, "
            "measured when this card was written. Measure on your own hardware with "
            "`pick_budget` (below)."
        )
    else:
        notes.append("Latency: not measured for this card (turned off when it was written); use `pick_budget` below.")
    sections.append(
        "## Budgets: quality and cost\n\n"
        + _budget_table(config, resolutions, budget_metrics, latencies)
        + "\n\n"
        + "\n".join(f"- {note}" for note in notes)
    )

    auto_class = "AutoModelForImageClassification" if is_classifier else "AutoModel"
    budget = config.budgets[len(config.budgets) // 2 - 1] if len(config.budgets) > 1 else config.budgets[0]
    if is_classifier:
        run = (
            f"    logits = model(**inputs, num_core_tokens={budget}).logits\n"
            "print(model.config.id2label[logits.argmax(-1).item()])"
        )
    else:
        run = (
            f"    outputs = model(**inputs, num_core_tokens={budget})\n"
            "cores_and_patches = outputs.last_hidden_state  # (1, C + N, D): the C cores first, then the patches\n"
            "global_feature = outputs.pooler_output  # (1, D): the first core"
        )
    sections.append(
        "## How to use\n\n"
        "```python\nimport torch\nfrom PIL import Image\nimport veca_hf  # registers VECA with the Auto classes\n"
        f"from transformers import AutoImageProcessor, {auto_class}\n\n"
        f'model = {auto_class}.from_pretrained("{model_id}").eval()\n'
        f'processor = AutoImageProcessor.from_pretrained("{model_id}")\n'
        'inputs = processor(images=Image.open("photo.jpg"), return_tensors="pt")\n'
        f"with torch.no_grad():\n{run}\n```\n\n"
        "Without `veca_hf` installed, pass `trust_remote_code=True` to `from_pretrained`: the folder carries its "
        "modeling code. Any height and width that are multiples of "
        f'{config.patch_size} work. Pipelines (`pipeline("{pipeline_tag}", model=...)`) run at '
        "`config.default_num_core_tokens`."
    )
    sections.append(
        "## Picking a budget\n\n"
        "Smaller budgets are cheaper and a little less accurate. `pick_budget` times every budget on the current "
        "device and returns the largest one that meets a latency target:\n\n"
        "```python\nfrom veca_hf.training import pick_budget\n\n"
        "choice = pick_budget(model, 512, latency_target_ms=50)  # image side (or (height, width)), target per batch\n"
        "print(choice.table())\n"
        "model.config.default_num_core_tokens = choice.num_core_tokens  # the budget pipelines and Trainer use\n```"
    )
    sections.append(f"## Citation\n\nVECA: [arXiv 2605.12491]({PAPER_URL}).")

    card = ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")
    card.save(model_dir / "README.md")
    return card
