# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Model cards for the folders veca_hf writes, and pushing a folder to the Hugging Face Hub.

`write_model_card(folder, ...)` writes `README.md` with `huggingface_hub.ModelCard`: Hub metadata (license,
`library_name`, `pipeline_tag`, tags, the teacher as `base_model`, datasets), then the model's size, its training
data, a per-budget table (quality where measured, FLOPs from `veca_hf.flops`, latency measured on the current
device), how to load it and how to pick a budget. The converter (`veca_hf.hub.convert_veca_original`),
`examples/distill.py` and the fine-tuning scripts (`examples/finetune_*.py`, through `write_finetuned_model_card`)
call it on the folders they save. Besides VECA's own models it takes transformers' dense heads with a VECA backbone
(UperNet, DPT, Depth Anything).

`push_to_hub(folder, repo_id)` uploads such a folder (model, image processor and card) in one commit.
"""

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import AutoConfig, PreTrainedModel
from transformers.utils import logging

from ..arguments import redact_urls
from ..flops import veca_model_flops
from ..latency import time_budgets_at_resolutions
from ..model.configuration_veca import VECA_PRESET_TEACHERS, VECA_PRESETS, VecaConfig
from ..model.modeling_veca import VecaForImageClassification, VecaModel
from ..model.modeling_veca_dense import VecaForDepthEstimation, VecaForSemanticSegmentation


if TYPE_CHECKING:  # NOTE: only for the annotation: the converter writes cards without loading Trainer
    from transformers import Trainer

logger = logging.get_logger(__name__)

__all__ = [
    "base_model_license",
    "budget_metrics_from_results",
    "create_hub_repo",
    "is_hub_id",
    "load_saved_model",
    "preset_teacher",
    "public_name",
    "push_to_hub",
    "resolve_hub_model_id",
    "write_finetuned_model_card",
    "write_model_card",
]

PAPER_URL = "https://arxiv.org/abs/2605.12491"
DINOV3_LICENSE = {
    "license": "other",
    "license_name": "dinov3-license",
    "license_link": "https://ai.meta.com/resources/models-and-libraries/dinov3-license/",
}
DINOV2_LICENSE = {"license": "apache-2.0"}
# What a card says instead of a local path (`public_name`).
LOCAL_FOLDER, LOCAL_FILES = "a local folder", "local files"
# Run artefacts that never belong in a Hub repository (resumable checkpoints, logs).
HUB_IGNORE_PATTERNS = ["checkpoints/*", "checkpoint-*", "sample_sources/*", "runs/*", "_*", "*.tmp"]
# Trainer bookkeeping that `evaluate_budgets` also reports per budget: not a quality measure.
_NOT_QUALITY = {"runtime", "samples_per_second", "steps_per_second", "epoch"}
_VECA_CLASSES = {
    cls.__name__: cls
    for cls in (VecaModel, VecaForImageClassification, VecaForSemanticSegmentation, VecaForDepthEstimation)
}
# By saved class: the pipeline tag, the Auto class that loads it and what its head is. The last three are
# transformers' own heads with a VECA backbone (`backbone_config`).
_CARD_CLASSES = {
    "VecaModel": ("image-feature-extraction", "AutoModel", "no head (features)"),
    "VecaForImageClassification": (
        "image-classification", "AutoModelForImageClassification", "a linear classifier on the first core"
    ),
    "VecaForSemanticSegmentation": (
        "image-segmentation", "AutoModelForSemanticSegmentation",
        "a linear layer on every patch token and the first core, upsampled to the input size",
    ),
    "VecaForDepthEstimation": (
        "depth-estimation", "AutoModelForDepthEstimation",
        "a linear layer (one output, the depth) on every patch token and the first core, upsampled to the input size",
    ),
    "UperNetForSemanticSegmentation": (
        "image-segmentation", "AutoModelForSemanticSegmentation", "transformers' UperNet on VECA feature maps"
    ),
    "DPTForDepthEstimation": ("depth-estimation", "AutoModelForDepthEstimation", "transformers' DPT on VECA tokens"),
    "DepthAnythingForDepthEstimation": (
        "depth-estimation", "AutoModelForDepthEstimation", "transformers' Depth Anything head on VECA tokens"
    ),
}  # fmt: skip


def _saved_class(config) -> tuple[str, VecaConfig]:
    """The saved class's name and the VECA config inside (the config itself, or its `backbone_config`)."""
    name = (config.architectures or ["VecaModel"])[0]
    if isinstance(config, VecaConfig) and name not in _CARD_CLASSES:  # e.g. a VecaBackbone: described as VecaModel
        name = "VecaModel"
    veca = config if isinstance(config, VecaConfig) else getattr(config, "backbone_config", None)
    if name not in _CARD_CLASSES or not isinstance(veca, VecaConfig):
        raise ValueError(
            f"The folder holds a {name} ({config.model_type}): model cards are written for VECA models and for "
            f"transformers' heads with a VECA backbone ({', '.join(_CARD_CLASSES)})."
        )
    return name, veca


def _model_class(name: str) -> type[PreTrainedModel]:
    return _VECA_CLASSES.get(name) or getattr(transformers, name)


def load_saved_model(model_dir: str | Path) -> PreTrainedModel:
    """Loads a saved folder as the class it was saved from (`config.architectures`), in eval mode: a VECA model, or
    one of transformers' dense heads with a VECA backbone."""
    name, _ = _saved_class(AutoConfig.from_pretrained(model_dir))
    return _model_class(name).from_pretrained(model_dir).eval()


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


def is_hub_id(name: str) -> bool:
    """Whether `name` is a Hub repository id (`"name"` or `"org/name"`, as the Hub spells them) that is not a path
    that exists here: only those go into a card's metadata."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not Path(name).expanduser().exists()


def base_model_license(base_model: str | None) -> dict[str, str] | None:
    """
    The card license of a model that derives from `base_model` (its teacher, or the model it was fine-tuned from):
    the DINOv3 License (`license: other`, `license_name: dinov3-license`, `license_link`) for a `facebook/dinov3*`
    Hub id, `apache-2.0` for `facebook/dinov2*`; `None` where it is not known (any other Hub id, a local folder, no
    base model).
    """
    if not base_model or not is_hub_id(base_model):
        return None
    name = base_model.lower()
    if name.startswith("facebook/dinov3"):
        return dict(DINOV3_LICENSE)
    if name.startswith("facebook/dinov2"):
        return dict(DINOV2_LICENSE)
    return None


def _license_section(license: str | None, base_model: str | None, inherited: dict[str, str] | None) -> str:
    """The card's license paragraph: the license given, the one inherited from the base model, or how to set it."""
    if license:
        return f"`{license}`."
    if inherited is not None and inherited.get("license_name") == DINOV3_LICENSE["license_name"]:
        return (
            f"The [DINOv3 License]({DINOV3_LICENSE['license_link']}): the weights derive from `{base_model}`, "
            "which ships under it. Read its terms before you use or share this model."
        )
    if inherited is not None:
        return f"`{inherited['license']}`, the license of `{base_model}`, which the weights derive from."
    source = (
        f"{_in_text(base_model)}, which the weights derive from" if base_model else "the weights it was trained from"
    )
    return (
        f"Not set: `license: other` stands until you set the license of {source}. Edit the `license` field of this "
        "card's metadata, or write the card again with `write_model_card(..., license=...)` (the converter: "
        "`--license`)."
    )


def public_name(name: str) -> str:
    """
    How a public model card names a model or a data source: a Hub id as it is, a URL without its credentials (user
    info, query string and fragment: `redact_urls(..., placeholder="")`), and "a local folder" or "local files" for a
    path on this machine (home folders, caches and user names stay off the Hub). A comma-separated list is named item
    by item (a comma inside a brace range such as `shard-{0,1}.tar` belongs to its item).
    """
    names = []
    for item in re.split(r",(?![^{}]*\})", str(name)):
        if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", item):
            names.append(redact_urls(item, placeholder=""))
        elif is_hub_id(item):
            names.append(item)
        else:
            names.append(LOCAL_FOLDER if Path(item).expanduser().is_dir() else LOCAL_FILES)
    return ",".join(dict.fromkeys(names))


def _in_text(name: str) -> str:
    """A name in the card's Markdown: Hub ids and URLs as code, the words for local data as words."""
    shown = public_name(name)
    return shown if shown in (LOCAL_FOLDER, LOCAL_FILES) else f"`{shown}`"


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
    license: str | None = None,
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
            A folder with a saved VECA model (`VecaModel`, `VecaForImageClassification`,
            `VecaForSemanticSegmentation`, `VecaForDepthEstimation`) or a transformers head with a VECA backbone
            (`UperNetForSemanticSegmentation`, `DPTForDepthEstimation`, `DepthAnythingForDepthEstimation`).
        model (`PreTrainedModel`, *optional*):
            The model in memory, to time it where it is (e.g. on the training GPU); otherwise it is loaded from
            `model_dir` onto the CPU when latency is measured.
        model_id (`str`, *optional*):
            The Hub id used in the card's title and loading snippets; defaults to the folder's name.
        base_model (`str`, *optional*):
            The teacher the model was distilled from, or the model it was fine-tuned from. A Hub id goes into the
            metadata and is linked; a local path is called "a local folder" (`public_name`).
        datasets (`str` or `Sequence[str]`, *optional*):
            The training data: Hub dataset ids (also put in the metadata), URLs (shown without their user info,
            query string and fragment) or local paths (shown as "a local folder" or "local files"); the card says
            "not recorded" without them.
        budget_metrics (`Mapping[int, Mapping[str, float]]`, *optional*):
            Measured quality per budget, e.g. `{8: {"accuracy": 0.71}, 64: {"accuracy": 0.80}}`; one column per
            metric name, "–" where a budget was not measured.
        metrics_description (`str`, *optional*):
            What the metrics are and on which data (shown under the table).
        description (`str`, *optional*):
            How this folder was made (converted, distilled, fine-tuned), shown under the title.
        training_details (`Mapping[str, Any]`, *optional*):
            Hyperparameters and other facts of the run, shown as a two-column table.
        license (`str`, *optional*):
            The license identifier for the Hub metadata; it always wins. By default the license follows
            `base_model` (`base_model_license`): the DINOv3 License for a `facebook/dinov3*` teacher, `apache-2.0`
            for `facebook/dinov2*`; for any other or a local base model, `other`, and the card (and a warning) says
            to set it.
        pipeline_tag (`str`, *optional*):
            Defaults to `"image-classification"` for a classifier, `"image-segmentation"` and `"depth-estimation"`
            for the dense heads, else `"image-feature-extraction"`.
        tags (`Sequence[str]`, *optional*):
            Extra Hub tags.
        resolutions (`Sequence[int]`, *optional*):
            Square input sides (multiples of the patch size) for the FLOPs and latency columns. Defaults to 16 and
            32 patches per side: 256 and 512 px at patch 16, 224 and 448 px at patch 14.
        measure_latency (`bool`, *optional*, defaults to `True`):
            Time every budget at each resolution (batch 1, median of `latency_repeats` passes after one warm-up,
            with `veca_hf.latency.pick_budget`). `False` leaves the columns out and says so in the card.
        latency_repeats (`int`, *optional*, defaults to 3):
            Timed passes per budget and resolution.

    Returns:
        `huggingface_hub.ModelCard`: the card written to `model_dir/README.md`.
    """
    model_dir = Path(model_dir)
    saved_config = AutoConfig.from_pretrained(model_dir)
    class_name, config = _saved_class(saved_config)
    default_tag, auto_class, head = _CARD_CLASSES[class_name]
    is_classifier = class_name == "VecaForImageClassification"
    has_veca_code = class_name in _VECA_CLASSES  # transformers' heads: the code is transformers', VECA is registered
    resolutions = tuple(resolutions) if resolutions else (16 * config.patch_size, 32 * config.patch_size)
    for resolution in resolutions:
        if resolution % config.patch_size:
            raise ValueError(
                f"Resolution {resolution} is not a multiple of patch_size={config.patch_size}: pass `resolutions` "
                f"that are (e.g. {16 * config.patch_size} and {32 * config.patch_size})."
            )
    datasets = [str(name) for name in ([datasets] if isinstance(datasets, str) else datasets or [])]
    budget_metrics = {int(budget): dict(values) for budget, values in (budget_metrics or {}).items()}
    for budget in budget_metrics:
        config.check_budget(budget, name="budget_metrics key")
    model_id = model_id or model_dir.absolute().name
    pipeline_tag = pipeline_tag or default_tag

    latencies, latency_device = None, None
    if measure_latency:
        latencies, latency_device = time_budgets_at_resolutions(
            model if model is not None else load_saved_model(model_dir), resolutions, latency_repeats
        )
    with torch.device("meta"):  # shapes only: counts parameters without memory or initialisation
        num_parameters = sum(p.numel() for p in _model_class(class_name)(saved_config).parameters())

    inherited = None if license else base_model_license(base_model)
    license_metadata = {"license": license} if license else inherited or {"license": "other"}
    if not license and inherited is None:
        base = "no base model given"
        if base_model:
            base = f"base model {redact_urls(base_model)}, not a facebook/dinov2 or facebook/dinov3 Hub id"
        logger.warning(
            f"{model_dir / 'README.md'}: the license is not set ({base}), "
            "so the card says `license: other`. Set it to the license of the weights the "
            "model derives from: write_model_card(..., license=...), or the converter's --license."
        )
    card_data = ModelCardData(
        **license_metadata,
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=list(dict.fromkeys(["veca", "vision", pipeline_tag, *(["custom_code"] if has_veca_code else []), *tags])),
        # NOTE: the Hub checks that these name repositories: Hub ids only.
        base_model=base_model if base_model and is_hub_id(base_model) else None,
        datasets=[name for name in datasets if is_hub_id(name)] or None,
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

    details = [
        "| | |",
        "|---|---|",
        f"| class | `{class_name}`, {head} |",
        f"| parameters | {num_parameters / 1e6:.2f}M |",
        f"| layers / width / heads / MLP | {config.num_hidden_layers} / {config.hidden_size} / "
        f"{config.num_attention_heads} / {config.intermediate_size} (SwiGLU) |",
        f"| patch size | {config.patch_size} |",
        f"| core bank | {config.core_bank_size} cores in chunks of {config.core_chunk_size} |",
        f"| default budget | {config.default_num_core_tokens or config.core_bank_size} "
        f"(`config.{'' if has_veca_code else 'backbone_config.'}default_num_core_tokens`) |",
    ]
    if base_model:
        link = (
            f"[`{base_model}`](https://huggingface.co/{base_model})" if is_hub_id(base_model) else _in_text(base_model)
        )
        details.append(f"| base model | {link} |")
    if is_classifier or pipeline_tag == "image-segmentation":
        details.append(f"| labels | {saved_config.num_labels} |")
    sections.append("## Model details\n\n" + "\n".join(details))

    data = "\n".join(f"- {_in_text(name)}" for name in datasets) if datasets else "Not recorded for this folder."
    if base_model:
        data += (
            f"\n\nThe weights derive from {_in_text(base_model)}: check its license for terms that apply to models "
            "trained from it."
        )
    sections.append("## Training data\n\n" + data)
    if training_details:
        rows = "\n".join(f"| {key} | {value} |" for key, value in training_details.items())
        sections.append("## Training details\n\n| | |\n|---|---|\n" + rows)

    notes = [
        "FLOPs: one forward pass of one square image, counted by `veca_hf.flops.veca_model_flops` (one multiply-add = "
        "2 FLOPs; matmuls, linears and convolutions, as `torch.utils.flop_counter` counts them)"
        + (
            "."
            if class_name in ("VecaModel", "VecaForImageClassification")
            else "; the VECA backbone only, not the head."
        )
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

    budget = config.budgets[len(config.budgets) // 2 - 1] if len(config.budgets) > 1 else config.budgets[0]
    call = f"model(**inputs, num_core_tokens={budget})"
    if not has_veca_code:  # transformers' head: it takes neither a budget nor a pixel_mask; its VECA gets them
        call = 'model(inputs["pixel_values"])'
    if is_classifier:
        run = f"    logits = {call}.logits\nprint(model.config.id2label[logits.argmax(-1).item()])"
    elif pipeline_tag == "image-segmentation":
        run = f"    logits = {call}.logits  # (1, num_labels, H, W)\nsegmentation = logits.argmax(1)[0]  # (H, W)"
    elif pipeline_tag == "depth-estimation":
        run = f"    depth = {call}.predicted_depth[0]  # (H, W)"
    else:
        run = (
            f"    outputs = {call}\n"
            "cores_and_patches = outputs.last_hidden_state  # (1, C + N, D): the C cores first, then the patches\n"
            "global_feature = outputs.pooler_output  # (1, D): the first core"
        )
    context = "with torch.no_grad():"
    imports = ""
    if not has_veca_code:
        context = f"with torch.no_grad(), default_budget(model, {budget}):"
        imports = "from veca_hf.routing import default_budget\n"
    if has_veca_code:
        loading = (
            "Without `veca_hf` installed, pass `trust_remote_code=True` to `from_pretrained`: the folder carries its "
            "modeling code."
        )
    else:
        loading = (
            f"`{class_name}` is transformers' own class; loading its VECA backbone needs `import veca_hf` (which "
            "registers `VecaConfig`)."
        )
    loading += f" Any height and width that are multiples of {config.patch_size} work."
    if pipeline_tag in ("image-classification", "image-feature-extraction"):
        loading += f' Pipelines (`pipeline("{pipeline_tag}", model=...)`) run at `config.default_num_core_tokens`.'
    sections.append(
        "## How to use\n\n"
        "```python\nimport torch\nfrom PIL import Image\nimport veca_hf  # registers VECA with the Auto classes\n"
        f"from transformers import AutoImageProcessor, {auto_class}\n{imports}\n"
        f'model = {auto_class}.from_pretrained("{model_id}").eval()\n'
        f'processor = AutoImageProcessor.from_pretrained("{model_id}")\n'
        'inputs = processor(images=Image.open("photo.jpg"), return_tensors="pt")\n'
        f"{context}\n{run}\n```\n\n" + loading
    )
    budget_setting = (
        "model.config.default_num_core_tokens = choice.num_core_tokens  # the budget pipelines and Trainer use"
    )
    picking_imports = ""
    if not has_veca_code:
        budget_setting = "veca_config(model).default_num_core_tokens = choice.num_core_tokens  # the head's budget"
        picking_imports = "from veca_hf.routing import veca_config\n"
    sections.append(
        "## Picking a budget\n\n"
        "Smaller budgets are cheaper and a little less accurate. `pick_budget` times every budget on the current "
        "device and returns the largest one that meets a latency target:\n\n"
        f"```python\nfrom veca_hf.latency import pick_budget\n{picking_imports}\n"
        "choice = pick_budget(model, 512, latency_target_ms=50)  # image side (or (height, width)), target per batch\n"
        "print(choice.table())\n"
        f"{budget_setting}\n```"
    )
    sections.append("## License\n\n" + _license_section(license, base_model, inherited))
    sections.append(f"## Citation\n\nVECA: [arXiv 2605.12491]({PAPER_URL}).")

    card = ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")
    card.save(model_dir / "README.md")
    return card


def write_finetuned_model_card(
    trainer: "Trainer",
    *,
    base_model: str,
    datasets: str | Sequence[str] | None,
    training_budget: int | str,
    eval_metrics: Mapping[str, float] | None,
    metrics_description: str,
    description: str,
) -> ModelCard | None:
    """
    The model card of a fine-tuning script's output folder (`trainer.args.output_dir`), written on the main process
    once the model is saved there, and pushed to `trainer.hub_model_id` with `--push_to_hub` (replacing `Trainer`'s
    card). Returns `None` where nothing was written (another process, or no saved model).

    Args:
        trainer (`Trainer`): the trainer that saved the model (its arguments, step count and Hub settings are used).
        base_model (`str`): the folder or Hub id that was fine-tuned.
        datasets (`str` or `Sequence[str]`, *optional*): the training data (URLs without their credentials).
        training_budget (`int` or `str`): the budget trained at (`training_budget_description`).
        eval_metrics (`Mapping[str, float]`, *optional*): `eval_C{C}_<metric>` results of `evaluate_and_save_budgets`.
        metrics_description (`str`): what the metrics are, on which data.
        description (`str`): how the folder was made.
    """
    args = trainer.args
    if not trainer.is_world_process_zero() or not (Path(args.output_dir) / "config.json").is_file():
        return None
    details = {
        "learning rate": args.learning_rate,
        "weight decay": args.weight_decay,
        "batch size (all devices)": args.per_device_train_batch_size
        * args.world_size
        * args.gradient_accumulation_steps,
        "optimiser steps": trainer.state.global_step,
        "training budget": training_budget,
        "seed": args.seed,
    }
    card = write_model_card(
        args.output_dir,
        # ZeRO-3 partitions the weights in memory: time the saved model instead (on the CPU).
        model=None if trainer.is_deepspeed_enabled else trainer.model,
        model_id=trainer.hub_model_id if args.push_to_hub else None,
        base_model=base_model,
        datasets=datasets,
        budget_metrics=budget_metrics_from_results(eval_metrics) if eval_metrics else None,
        metrics_description=metrics_description,
        description=description,
        training_details=details,
    )
    if args.push_to_hub:
        card.push_to_hub(trainer.hub_model_id, token=args.hub_token)
    return card
