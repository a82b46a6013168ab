# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Export a VECA folder to ONNX at one budget, with a dynamic batch size, height and width.

    python -m veca_hf.hub.export_onnx --model_name_or_path veca-b16 --num_core_tokens 16 --output veca-b16-C16.onnx

The budget `C` is baked into the graph (the active cores are a slice of the bank), so each file serves one budget:
export one file per budget you serve. Height and width stay dynamic as multiples of the patch size (a grid side of
at least 2 patches). A `VecaModel` folder gives the outputs `last_hidden_state` `(B, C + N, D)` and `pooler_output`
`(B, D)`; a `VecaForImageClassification` folder gives `logits` `(B, num_labels)`. The input is `pixel_values`
`(B, 3, H, W)`, preprocessed as by the folder's image processor.

`--int8` writes int8 weights instead (ONNX Runtime's dynamic quantization; run the file with ONNX Runtime), for CPUs
without fast bf16; docs/performance.md says what it costs in features and gains in speed.

Needs the `onnx` extra (`pip install "veca_hf[onnx]"`: onnx, onnxscript, and onnxruntime for `--int8` and
`--verify`).
"""

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn
from transformers.utils import logging

from ..model.modeling_veca import VecaForImageClassification, VecaModel
from .cards import load_saved_model


logger = logging.get_logger(__name__)

__all__ = ["VecaOnnxWrapper", "export_onnx", "quantize_onnx_int8", "verify_onnx", "verify_onnx_int8"]


class VecaOnnxWrapper(nn.Module):
    """`pixel_values -> tensors` at a fixed budget, without the Python-only arguments an exporter cannot take.

    Args:
        model (`VecaModel` or `VecaForImageClassification`): the model, in eval mode.
        num_core_tokens (`int`): the budget baked into the exported graph.
    """

    def __init__(self, model: VecaModel | VecaForImageClassification, num_core_tokens: int):
        super().__init__()
        self.model = model
        self.num_core_tokens = model.config.check_budget(num_core_tokens)

    @property
    def output_names(self) -> list[str]:
        if isinstance(self.model, VecaForImageClassification):
            return ["logits"]
        return ["last_hidden_state", "pooler_output"]

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self.model(pixel_values, num_core_tokens=self.num_core_tokens, return_dict=True)
        return tuple(outputs[name] for name in self.output_names)


def export_onnx(
    model: VecaModel | VecaForImageClassification,
    num_core_tokens: int,
    output: str | Path,
    example_size: tuple[int, int] | None = None,
    max_side: int = 4096,
) -> Path:
    """
    Exports `model` at budget `num_core_tokens` to an ONNX file with `torch.onnx.export(..., dynamo=True)`.

    The batch size is dynamic, and height and width are dynamic multiples of `config.patch_size` between 2 patches
    and `max_side` pixels. The file's metadata records the budget (`num_core_tokens`), the patch size and the output
    names.

    Args:
        model (`VecaModel` or `VecaForImageClassification`):
            The model to export; it is put in eval mode (train mode augments coordinates at random).
        num_core_tokens (`int`):
            The budget baked into the graph; one of `model.config.budgets`.
        output (`str` or `Path`):
            The `.onnx` file to write (its folder is created).
        example_size (`tuple[int, int]`, *optional*):
            `(height, width)` of the example input traced; defaults to 3 x 2 patches. Any valid size gives the same
            graph; a non-square one keeps height and width separate symbols.
        max_side (`int`, *optional*, defaults to 4096):
            The largest height or width the graph accepts, in pixels.

    Returns:
        `Path`: the written file.
    """
    from torch.export import Dim

    config = model.config
    patch_size = config.patch_size
    if max_side < 2 * patch_size:
        raise ValueError(f"max_side={max_side} is below two patches ({2 * patch_size} px); raise it.")
    height, width = example_size or (3 * patch_size, 2 * patch_size)
    if height % patch_size or width % patch_size or min(height, width) < 2 * patch_size:
        raise ValueError(
            f"example_size={height}x{width} must be multiples of patch_size={patch_size} of at least two patches, "
            f"e.g. {3 * patch_size}x{2 * patch_size}."
        )
    wrapper = VecaOnnxWrapper(model.eval(), num_core_tokens).eval()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)

    # NOTE: a grid side of one patch is specialised by the tracer (as with torch.export), hence min=2.
    max_patches = max_side // patch_size
    rows, cols = Dim("rows", min=2, max=max_patches), Dim("cols", min=2, max=max_patches)
    dynamic_shapes = {"pixel_values": {0: Dim("batch", min=1, max=1024), 2: patch_size * rows, 3: patch_size * cols}}
    example = torch.randn(2, config.num_channels, height, width, dtype=next(model.parameters()).dtype)
    with torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            (example,),
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=["pixel_values"],
            output_names=wrapper.output_names,
            verbose=False,
        )
    program.model.metadata_props.update(
        {
            "model_type": config.model_type,
            "num_core_tokens": str(wrapper.num_core_tokens),
            "patch_size": str(patch_size),
            "outputs": ",".join(wrapper.output_names),
        }
    )
    program.save(str(output))
    logger.info(f"Exported budget {wrapper.num_core_tokens} to {output}.")
    return output


def _compare_with_pytorch(model, onnx_path, num_core_tokens: int, sizes):
    """Per size and output: `(name, PyTorch's output, onnxruntime's output)`, both fp32 tensors, on random inputs."""
    import onnxruntime

    patch_size = model.config.patch_size
    sizes = sizes or [(2, 4 * patch_size, 6 * patch_size), (1, 8 * patch_size, 4 * patch_size)]
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    exported_budget = session.get_modelmeta().custom_metadata_map.get("num_core_tokens")
    if exported_budget is not None and int(exported_budget) != num_core_tokens:
        raise ValueError(
            f"{str(onnx_path)!r} was exported at budget {exported_budget}, not num_core_tokens={num_core_tokens}: "
            "compare it at that budget, or export the budget you want."
        )
    wrapper = VecaOnnxWrapper(model.eval(), num_core_tokens)
    for batch_size, height, width in sizes:
        pixel_values = torch.randn(batch_size, model.config.num_channels, height, width)
        with torch.no_grad():
            expected = wrapper(pixel_values.to(next(model.parameters()).dtype))
        actual = session.run(None, {"pixel_values": pixel_values.numpy()})
        for name, reference, result in zip(wrapper.output_names, expected, actual, strict=False):
            if tuple(result.shape) != tuple(reference.shape):
                raise ValueError(f"ONNX output {name!r} has shape {result.shape}, PyTorch {tuple(reference.shape)}.")
            yield name, reference.float(), torch.from_numpy(result)


def verify_onnx(
    model: VecaModel | VecaForImageClassification,
    onnx_path: str | Path,
    num_core_tokens: int,
    sizes: list[tuple[int, int, int]] | None = None,
    atol: float = 1e-4,
) -> float:
    """
    Runs the ONNX file in onnxruntime (CPU) and compares it with PyTorch on random inputs.

    Args:
        model (`VecaModel` or `VecaForImageClassification`): the exported model.
        onnx_path (`str` or `Path`): the exported file.
        num_core_tokens (`int`): the budget it was exported at.
        sizes (`list[tuple[int, int, int]]`, *optional*): `(batch, height, width)` inputs to compare; defaults to
            two batches at two non-square sizes.
        atol (`float`, *optional*, defaults to 1e-4): the largest accepted absolute difference.

    Returns:
        `float`: the largest absolute difference over all outputs and sizes.

    Raises:
        `ValueError`: if the file was exported at another budget, or a difference exceeds `atol`.
    """
    worst = 0.0
    for _, reference, result in _compare_with_pytorch(model, onnx_path, num_core_tokens, sizes):
        worst = max(worst, (result - reference).abs().max().item())
    if worst > atol:
        raise ValueError(f"onnxruntime differs from PyTorch by {worst:.3g} (> atol={atol:g}) for {onnx_path}.")
    return worst


def quantize_onnx_int8(onnx_path: str | Path, output: str | Path) -> Path:
    """
    Writes an int8 copy of an exported file: ONNX Runtime's dynamic quantization (`quantize_dynamic`: int8 weights
    of every MatMul, activations quantized per call), which runs on ONNX Runtime's CPU provider. The metadata
    (budget, patch size, outputs) is kept and gains `weights: int8`.

    Speed and what int8 does to the features are measured in docs/performance.md ("int8").

    Args:
        onnx_path (`str` or `Path`): an fp32 file written by [`export_onnx`].
        output (`str` or `Path`): the int8 file to write.

    Returns:
        `Path`: the written file.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    quantize_dynamic(str(onnx_path), str(output), weight_type=QuantType.QInt8)
    metadata = {entry.key: entry.value for entry in onnx.load(str(onnx_path), load_external_data=False).metadata_props}
    quantized = onnx.load(str(output))
    del quantized.metadata_props[:]
    for key, value in {**metadata, "weights": "int8"}.items():
        quantized.metadata_props.add(key=key, value=value)
    onnx.save(quantized, str(output))
    return output


def verify_onnx_int8(
    model: VecaModel | VecaForImageClassification,
    onnx_path: str | Path,
    num_core_tokens: int,
    sizes: list[tuple[int, int, int]] | None = None,
    min_cosine: float = 0.99,
) -> float:
    """
    Like [`verify_onnx`] for an int8 file, whose outputs differ from fp32 by rounding: the cosine similarity of every
    token (and pooled or logit vector) to PyTorch's must be at least `min_cosine`.

    Returns:
        `float`: the smallest cosine over all outputs and sizes.

    Raises:
        `ValueError`: if the file was exported at another budget, or a cosine is below `min_cosine`.
    """
    worst = 1.0
    for _, reference, result in _compare_with_pytorch(model, onnx_path, num_core_tokens, sizes):
        worst = min(worst, torch.nn.functional.cosine_similarity(result, reference, dim=-1).min().item())
    if worst < min_cosine:
        raise ValueError(
            f"The int8 file {onnx_path} reaches cosine {worst:.4f} to PyTorch (< min_cosine={min_cosine:g}): int8 "
            "rounding moves this model's features too far; serve it in fp32 or bf16."
        )
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="a VECA folder (VecaModel or a classifier)")
    parser.add_argument("--num_core_tokens", type=int, required=True, help="the budget C baked into the file")
    parser.add_argument("--output", required=True, help="the .onnx file to write")
    parser.add_argument("--max_side", type=int, default=4096, help="largest height or width accepted, in pixels")
    parser.add_argument("--int8", action="store_true", help="write int8 weights (ONNX Runtime dynamic quantization)")
    parser.add_argument("--verify", action="store_true", help="compare onnxruntime with PyTorch at two sizes")
    args = parser.parse_args(argv)
    try:
        model = load_saved_model(args.model_name_or_path)
        model.config.check_budget(args.num_core_tokens, name="--num_core_tokens")
        if args.int8:
            with tempfile.TemporaryDirectory(dir=Path(args.output).resolve().parent) as tmp:
                fp32 = export_onnx(model, args.num_core_tokens, Path(tmp) / "fp32.onnx", max_side=args.max_side)
                output = quantize_onnx_int8(fp32, args.output)
        else:
            output = export_onnx(model, args.num_core_tokens, args.output, max_side=args.max_side)
        weights = "int8 " if args.int8 else ""
        message = f"Exported {args.model_name_or_path} at budget {args.num_core_tokens} -> {weights}{output}"
        if args.verify and args.int8:
            cosine = verify_onnx_int8(model, output, args.num_core_tokens)
            message += f"; every output within cosine {cosine:.4f} of PyTorch's fp32"
        elif args.verify:
            message += f"; onnxruntime matches PyTorch to {verify_onnx(model, output, args.num_core_tokens):.2g}"
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    print(message + ".")


if __name__ == "__main__":
    main()
