# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Export a VECA folder to ONNX at one budget, with a dynamic batch size, height and width.

    python -m veca_hf.export_onnx --model_name_or_path veca-b16 --num_core_tokens 16 --output veca-b16-C16.onnx

The budget `C` is baked into the graph (the active cores are a slice of the bank), so each file serves one budget:
export one file per budget you serve. Height and width stay dynamic as multiples of the patch size (a grid side of
at least 2 patches). A `VecaModel` folder gives the outputs `last_hidden_state` `(B, C + N, D)` and `pooler_output`
`(B, D)`; a `VecaForImageClassification` folder gives `logits` `(B, num_labels)`. The input is `pixel_values`
`(B, 3, H, W)`, preprocessed as by the folder's image processor.

Needs the `onnx` extra (`pip install "veca_hf[onnx]"`: onnx, onnxscript, and onnxruntime for `--verify`).
"""

import argparse
from pathlib import Path

import torch
from torch import nn
from transformers.utils import logging

from .model.modeling_veca import VecaForImageClassification, VecaModel
from .model_card import load_saved_model


logger = logging.get_logger(__name__)

__all__ = ["VecaOnnxWrapper", "export_onnx", "verify_onnx"]


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
    worst = 0.0
    for batch_size, height, width in sizes:
        pixel_values = torch.randn(batch_size, model.config.num_channels, height, width)
        with torch.no_grad():
            expected = wrapper(pixel_values.to(next(model.parameters()).dtype))
        actual = session.run(None, {"pixel_values": pixel_values.numpy()})
        for name, reference, result in zip(wrapper.output_names, expected, actual, strict=False):
            if tuple(result.shape) != tuple(reference.shape):
                raise ValueError(f"ONNX output {name!r} has shape {result.shape}, PyTorch {tuple(reference.shape)}.")
            worst = max(worst, (torch.from_numpy(result) - reference.float()).abs().max().item())
    if worst > atol:
        raise ValueError(f"onnxruntime differs from PyTorch by {worst:.3g} (> atol={atol:g}) for {onnx_path}.")
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="a VECA folder (VecaModel or a classifier)")
    parser.add_argument("--num_core_tokens", type=int, required=True, help="the budget C baked into the file")
    parser.add_argument("--output", required=True, help="the .onnx file to write")
    parser.add_argument("--max_side", type=int, default=4096, help="largest height or width accepted, in pixels")
    parser.add_argument("--verify", action="store_true", help="compare onnxruntime with PyTorch at two sizes")
    args = parser.parse_args(argv)
    try:
        model = load_saved_model(args.model_name_or_path)
        model.config.check_budget(args.num_core_tokens, name="--num_core_tokens")
        output = export_onnx(model, args.num_core_tokens, args.output, max_side=args.max_side)
        message = f"Exported {args.model_name_or_path} at budget {args.num_core_tokens} -> {output}"
        if args.verify:
            message += f"; onnxruntime matches PyTorch to {verify_onnx(model, output, args.num_core_tokens):.2g}"
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    print(message + ".")


if __name__ == "__main__":
    main()
