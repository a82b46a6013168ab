"""Tests for core tracing (`veca_hf.evaluation.core_tracing`) and `examples/visualize_cores.py`: positions and
attention maps come from the model's own outputs (`output_core_positions`, `output_attentions`)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config, tiny_dinov3_config
from PIL import Image
from transformers import DINOv3ViTModel

from veca_hf import VecaForImageClassification, VecaModel, evaluation


EXAMPLES = Path(__file__).parents[1] / "examples"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def moving_veca() -> VecaModel:
    """Three blocks and a large coordinate step, so that cores visibly move between blocks."""
    torch.manual_seed(0)
    return VecaModel(tiny_config(num_hidden_layers=3, core_coordinate_step_init=0.5)).eval()


def test_core_attention_maps_are_the_model_attentions_and_sum_to_one(moving_veca, pixel_values):
    image = pixel_values[:1]  # (1, 3, 64, 48): 4 x 3 patches
    maps = evaluation.core_attention_maps(moving_veca, image, num_core_tokens=16, cores=range(3))
    assert maps.patch_maps.shape == (3, 3, 4, 3) and maps.core_weights.shape == (3, 3, 16)
    with torch.no_grad():
        attentions = moving_veca(image, num_core_tokens=16, output_attentions=True).attentions
    for layer, attention in enumerate(attentions):  # (1, H, T, T)
        rows = attention[0, :, :3].mean(0)  # cores 1..3 over all 16 + 12 tokens, averaged over heads
        torch.testing.assert_close(maps.patch_maps[layer], rows[:, 16:].reshape(3, 4, 3), rtol=0, atol=0)
        torch.testing.assert_close(maps.core_weights[layer], rows[:, :16], rtol=0, atol=0)
    patch_part, core_part = maps.patch_maps.sum((-2, -1)), maps.core_weights.sum(-1)  # (L, k) each
    torch.testing.assert_close(patch_part + core_part, torch.ones_like(patch_part))
    torch.testing.assert_close(patch_part, 1 - core_part)
    assert bool((patch_part <= 1 + 1e-6).all()) and bool((maps.patch_maps >= 0).all())


def test_core_positions_per_layer(moving_veca, pixel_values):
    image = pixel_values[1:]
    positions = evaluation.core_positions_per_layer(moving_veca, image, num_core_tokens=16)
    assert positions.shape == (3, 16, 2)
    with torch.no_grad():
        outputs = moving_veca(image, num_core_tokens=16, output_hidden_states=True)
    torch.testing.assert_close(positions[-1], outputs.core_positions[0], rtol=0, atol=0)
    # independent recomputation: block 1 uses the bank, block l + 1 moves by the head applied to block l's cores
    embeddings, encoder = moving_veca.embeddings, moving_veca.encoder
    raw = torch.cat(list(embeddings.core_coordinates[:2]))[None]  # (1, 16, 2)
    torch.testing.assert_close(positions[0], torch.tanh(raw[0]))
    with torch.no_grad():
        for layer in (1, 2):
            raw = encoder.core_coordinate_heads[layer - 1](outputs.hidden_states[layer][:, :16], raw)
            torch.testing.assert_close(positions[layer], torch.tanh(raw[0]))
    assert not torch.allclose(positions[0], positions[1])  # the cores moved


def test_trace_cores_reads_the_model_outputs_of_head_models_and_refuses_others(moving_veca, pixel_values):
    head_model = VecaForImageClassification(moving_veca.config).eval()
    head_model.veca.load_state_dict(moving_veca.state_dict())
    with torch.no_grad():
        trace = evaluation.trace_cores(head_model, pixel_values, num_core_tokens=8, output_attentions=False)
        outputs = moving_veca(pixel_values, num_core_tokens=8, output_core_positions=True)
    assert trace.core_positions.shape == (2, 3, 8, 2) and trace.attentions is None and trace.grid == (4, 3)
    torch.testing.assert_close(trace.core_positions, torch.stack(outputs.all_core_positions, 1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs a VECA model"):
        evaluation.trace_cores(DINOv3ViTModel(tiny_dinov3_config()).eval(), pixel_values)


def test_visualize_cores_script_writes_png(veca_dir, tmp_path):
    image_path, output = tmp_path / "image.png", tmp_path / "cores.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (80, 96, 3), dtype=np.uint8)).save(image_path)
    maps = load_script("visualize_cores").main([
        "--model_name_or_path", str(veca_dir), "--image", str(image_path), "--num_core_tokens", "16",
        "--num_cores_shown", "3", "--resolution", "64", "--output", str(output),
    ])  # fmt: skip
    with Image.open(output) as drawn:
        assert drawn.format == "PNG" and drawn.width > 400 and drawn.height > 300
    assert maps.patch_maps.shape == (2, 3, 4, 4) and maps.core_positions.shape == (2, 16, 2)
    torch.testing.assert_close(maps.patch_maps.sum((-2, -1)) + maps.core_weights.sum(-1), torch.ones(2, 3))
