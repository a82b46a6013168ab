"""FLOP counts: the analytic formulas in `veca_hf.flops` against `torch.utils.flop_counter` and the paper's table.

Attention blocks and the VECA-B whole model are counted on the meta device (shapes only, no compute, no memory);
whole-model counts on tiny real models run on CPU. Everything is counted inside `sdpa_kernel(SDPBackend.MATH)`:
the counter does not see the CPU flash kernel.
"""

import pytest
import torch
from conftest import tiny_config, tiny_dinov3_config
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from veca_hf import VecaConfig, VecaModel
from veca_hf.flops import (
    attention_block_flops,
    count_flops,
    dinov3_model_flops,
    num_patches_for,
    veca_model_flops,
)
from veca_hf.model.modeling_veca import VecaCorePeripheryAttention


RESOLUTIONS = (256, 384, 512, 768, 1024)
SIZES = {"S": (384, 6), "B": (768, 12), "L": (1024, 16)}  # hidden size, heads

# The paper's attention-block FLOP table (arXiv 2605.12491): batch 1, C = 64, torch.utils.flop_counter GFLOPs.
PAPER_BLOCK_GFLOPS = {
    ("S", "VECA"): (0.434, 0.875, 1.491, 3.253, 5.719),
    ("S", "DINOv3"): (0.413, 1.204, 2.840, 10.913, 30.670),
    ("B", "VECA"): (1.623, 3.259, 5.549, 12.092, 21.253),
    ("B", "DINOv3"): (1.441, 3.778, 8.108, 27.274, 71.016),
    ("L", "VECA"): (2.835, 5.687, 9.680, 21.089, 37.061),
    ("L", "DINOv3"): (2.468, 6.256, 12.969, 41.207, 103.289),
}
DINOV3_PREFIX_TOKENS = 5  # 1 CLS + 4 registers
NUM_CORES = 64


def _count(fn) -> int:
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        fn()
    return int(counter.get_total_flops())


def count_veca_block(size: str, resolution: int, num_cores: int = NUM_CORES, device: str = "meta") -> int:
    """Counts one `VecaCorePeripheryAttention` forward on `(1, C + N, D)` hidden states."""
    hidden_size, num_heads = SIZES[size]
    config = VecaConfig(hidden_size=hidden_size, num_attention_heads=num_heads)
    config._attn_implementation = "sdpa"
    head_dim = hidden_size // num_heads
    num_patches = (resolution // 16) ** 2
    with torch.device(device):
        attention = VecaCorePeripheryAttention(config).eval()
        hidden_states = torch.randn(1, num_cores + num_patches, hidden_size)
        core_rope = (torch.randn(1, num_cores, head_dim), torch.randn(1, num_cores, head_dim))
        patch_rope = (torch.randn(num_patches, head_dim), torch.randn(num_patches, head_dim))
    return _count(lambda: attention(hidden_states, core_rope, patch_rope))


def count_dinov3_block(size: str, resolution: int) -> int:
    """Counts one transformers `DINOv3ViTAttention` forward on `(1, 5 + N, D)` hidden states, on meta."""
    from transformers import DINOv3ViTConfig
    from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTAttention

    hidden_size, num_heads = SIZES[size]
    config = DINOv3ViTConfig(hidden_size=hidden_size, num_attention_heads=num_heads, num_register_tokens=4)
    config._attn_implementation = "sdpa"
    head_dim = hidden_size // num_heads
    num_patches = (resolution // 16) ** 2
    with torch.device("meta"):
        attention = DINOv3ViTAttention(config).eval()
        hidden_states = torch.randn(1, DINOV3_PREFIX_TOKENS + num_patches, hidden_size)
        rope = (torch.randn(num_patches, head_dim), torch.randn(num_patches, head_dim))
    return _count(lambda: attention(hidden_states, position_embeddings=rope))


# --- one attention block -------------------------------------------------------------------------------------------


def test_veca_b_block_1024_matches_spec_and_formula():
    counted = count_veca_block("B", 1024)
    analytic = attention_block_flops(768, 64 * 64, num_core_tokens=64)
    assert counted == analytic
    assert counted / 1e9 == pytest.approx(21.253, rel=1e-3)
    assert counted == 8 * 4160 * 768**2 + 4 * (64 * 4160 + 4096 * 64) * 768


def test_veca_b_block_1024_counted_on_real_tensors():
    """The meta-device count is what real CPU tensors give (the block is small enough: ~13 MB of activations)."""
    assert count_veca_block("B", 1024, device="cpu") == count_veca_block("B", 1024) == 21_252_538_368


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("model", ["VECA", "DINOv3"])
def test_block_table_analytic(size, model):
    hidden_size, _ = SIZES[size]
    for resolution, expected in zip(RESOLUTIONS, PAPER_BLOCK_GFLOPS[(size, model)], strict=True):
        num_patches = (resolution // 16) ** 2
        if model == "VECA":
            flops = attention_block_flops(hidden_size, num_patches, num_core_tokens=NUM_CORES)
        else:
            flops = attention_block_flops(hidden_size, num_patches, num_prefix_tokens=DINOV3_PREFIX_TOKENS)
        # the paper rounds to 3 decimals; the formulas reproduce every entry to that rounding
        assert flops / 1e9 == pytest.approx(expected, rel=1e-2)
        assert abs(flops / 1e9 - expected) <= 5e-4 + 1e-9, (size, model, resolution, flops / 1e9, expected)


@pytest.mark.parametrize("size", sorted(SIZES))
def test_block_table_counted(size):
    hidden_size, _ = SIZES[size]
    for resolution, veca, dense in zip(
        RESOLUTIONS, PAPER_BLOCK_GFLOPS[(size, "VECA")], PAPER_BLOCK_GFLOPS[(size, "DINOv3")], strict=True
    ):
        num_patches = (resolution // 16) ** 2
        counted = count_veca_block(size, resolution)
        assert counted == attention_block_flops(hidden_size, num_patches, num_core_tokens=NUM_CORES)
        assert counted / 1e9 == pytest.approx(veca, rel=1e-2)
        counted = count_dinov3_block(size, resolution)
        assert counted == attention_block_flops(hidden_size, num_patches, num_prefix_tokens=DINOV3_PREFIX_TOKENS)
        assert counted / 1e9 == pytest.approx(dense, rel=1e-2)


def test_block_veca_cheaper_than_dense_at_high_resolution_only():
    """The paper: at 256 px with C = 64 VECA's attention block costs slightly more than dense; from 384 px on, less."""
    for size in SIZES:
        veca, dense = PAPER_BLOCK_GFLOPS[(size, "VECA")], PAPER_BLOCK_GFLOPS[(size, "DINOv3")]
        assert veca[0] > dense[0]
        assert all(v < d for v, d in zip(veca[1:], dense[1:], strict=False))


def test_block_flops_arguments():
    assert attention_block_flops(64, 12, num_core_tokens=8, batch_size=3) == 3 * attention_block_flops(
        64, 12, num_core_tokens=8
    )
    assert attention_block_flops(64, 12) == 8 * 12 * 64**2 + 4 * 12**2 * 64
    with pytest.raises(ValueError):
        attention_block_flops(64, 12, num_core_tokens=8, num_prefix_tokens=5)
    assert num_patches_for(64, 48, 16) == 12
    with pytest.raises(ValueError):
        num_patches_for(64, 40, 16)


# --- whole model ---------------------------------------------------------------------------------------------------

BIGGER = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, intermediate_size=341, core_bank_size=32)


@pytest.mark.parametrize("overrides", [{}, BIGGER], ids=["tiny", "bigger"])
def test_whole_model_counted_equals_analytic(overrides):
    config = tiny_config(**overrides)
    model = VecaModel(config).eval()
    budgets = (config.budgets[0], config.budgets[-1])
    for height, width in [(64, 48), (32, 96), (80, 80)]:
        pixel_values = torch.randn(2, 3, height, width)
        for num_core_tokens in budgets:
            counted = count_flops(model, pixel_values, num_core_tokens=num_core_tokens)
            assert counted == veca_model_flops(config, height, width, num_core_tokens, batch_size=2)


def test_whole_model_counted_equals_analytic_train_mode_and_default_budget():
    config = tiny_config(default_num_core_tokens=8)
    model = VecaModel(config).train()  # coordinate augmentation is elementwise: no FLOPs
    assert count_flops(model, torch.randn(1, 3, 64, 48)) == veca_model_flops(config, 64, 48)
    assert veca_model_flops(config, 64, 48) == veca_model_flops(config, 64, 48, 8)
    with pytest.raises(ValueError):
        veca_model_flops(config, 64, 48, 12)  # not a budget


def test_whole_model_veca_b_1024_on_meta():
    config = VecaConfig.from_preset("veca-b16")
    with torch.device("meta"):
        model = VecaModel(config).eval()
        pixel_values = torch.empty(1, 3, 1024, 1024)
    analytic = veca_model_flops(config, 1024, 1024, 64)
    assert count_flops(model, pixel_values, num_core_tokens=64) == analytic
    # patch conv + 12 blocks (attention block as in the paper's table + SwiGLU) + 11 coordinate heads
    expected = 2 * 4096 * 768 * 768 + 12 * (21_252_538_368 + 6 * 4160 * 768 * 2048) + 11 * 4 * 64 * 768
    assert analytic == expected


def test_dense_dinov3_counted_equals_analytic():
    from transformers import DINOv3ViTModel

    config = tiny_dinov3_config()
    model = DINOv3ViTModel(config).eval()
    for height, width in [(64, 64), (64, 128), (48, 80)]:
        assert count_flops(model, torch.randn(1, 3, height, width)) == dinov3_model_flops(config, height, width)


def _second_differences(values):
    return [values[i + 1] - 2 * values[i] + values[i - 1] for i in range(1, len(values) - 1)]


def test_veca_linear_in_patches_dense_quadratic():
    """Fixed C: VECA's counted FLOPs are affine in N; a dense DINOv3 of the same width and depth is quadratic."""
    from transformers import DINOv3ViTModel

    veca_config = tiny_config()
    dense_config = tiny_dinov3_config()
    assert (veca_config.hidden_size, veca_config.num_hidden_layers) == (
        dense_config.hidden_size,
        dense_config.num_hidden_layers,
    )
    veca = VecaModel(veca_config).eval()
    dense = DINOv3ViTModel(dense_config).eval()
    widths = (64, 128, 192, 256)  # height 64: N = 16, 32, 48, 64, equally spaced
    veca_flops = [count_flops(veca, torch.randn(1, 3, 64, w), num_core_tokens=16) for w in widths]
    dense_flops = [count_flops(dense, torch.randn(1, 3, 64, w)) for w in widths]

    for second in _second_differences(veca_flops):
        assert abs(second) <= 1e-9 * veca_flops[-1]
    # dense: 4 T^2 D per layer, so the second difference is exactly 2 * 4 * D * L * dN^2
    expected = 2 * 4 * dense_config.hidden_size * dense_config.num_hidden_layers * 16**2
    assert _second_differences(dense_flops) == [expected, expected]
    assert expected > 0

    # the same at the released size, analytically: linear for VECA-B, quadratic for the DINOv3-B block
    config = VecaConfig.from_preset("veca-b16")
    sides = (512, 768, 1024, 1280)  # height 512: N = 32 * 32, 32 * 48, ... equally spaced
    big = [veca_model_flops(config, 512, w, 64) for w in sides]
    assert all(abs(s) <= 1e-12 * big[-1] for s in _second_differences(big))
    dense_blocks = [attention_block_flops(768, num_patches_for(512, w, 16), num_prefix_tokens=5) for w in sides]
    assert all(s > 0 for s in _second_differences(dense_blocks))


def test_flops_grow_with_budget():
    config = tiny_config(**BIGGER)
    model = VecaModel(config).eval()
    pixel_values = torch.randn(1, 3, 64, 48)
    counted = [count_flops(model, pixel_values, num_core_tokens=c) for c in config.budgets]
    assert counted == [veca_model_flops(config, 64, 48, c) for c in config.budgets]
    assert all(a < b for a, b in zip(counted, counted[1:], strict=False))

    config = VecaConfig.from_preset("veca-b16")
    analytic = [veca_model_flops(config, 1024, 1024, c) for c in config.budgets]
    assert all(a < b for a, b in zip(analytic, analytic[1:], strict=False))
    blocks = [attention_block_flops(768, 4096, num_core_tokens=c) for c in config.budgets]
    assert all(a < b for a, b in zip(blocks, blocks[1:], strict=False))


def test_the_docs_crossover_table_is_what_the_counts_say():
    """docs/budget_picker.md's table of VECA-B/16 over DINOv3-B/16 FLOPs per image side and budget is computed here:
    a change to the model or the counts that moves the crossover fails until the page says it."""
    import re
    from pathlib import Path

    from transformers import DINOv3ViTConfig

    from veca_hf.flops import dinov3_model_flops

    page = (Path(__file__).parents[1] / "docs" / "budget_picker.md").read_text()
    table = page.split("<!-- flop-table: veca-b16 vs dinov3-b16 -->", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if re.match(r"\| \d", line)]
    assert len(rows) >= 8
    veca = VecaConfig.from_preset("veca-b16")
    dinov3 = DINOv3ViTConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                             patch_size=16, num_register_tokens=4)  # fmt: skip
    for row in rows:
        side, num_patches, *ratios = [cell.strip() for cell in row.strip("|").split("|")]
        side = int(side)
        assert int(num_patches) == (side // 16) ** 2
        for budget, written in zip((8, 16, 32, 64), ratios, strict=True):
            ratio = veca_model_flops(veca, side, side, num_core_tokens=budget) / dinov3_model_flops(dinov3, side, side)
            assert f"{ratio:.3f}" == written, (side, budget)
