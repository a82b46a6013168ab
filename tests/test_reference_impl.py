"""Tests of the independent reference implementation (tests/reference_veca.py),
so that it can be trusted as ground truth for the rest of the suite."""

import os
import sys

import pytest
import torch


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reference_veca import (  # noqa: E402
    ReferenceVeca,
    rope_periods,
    rope_rotate_interleaved,
    strip_reference_prefixes,
)


FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
CKPT = os.path.join(FIXTURES, "tiny_reference.pth")
VECTORS = os.path.join(FIXTURES, "tiny_vectors.safetensors")

RESEARCH_CODE_ROPE_EXAMPLE = [  # head size 32, coordinate (0.25, -0.5), computed with the paper's research code
    -1,
    0,
    -1.0494,
    3.4495,
    1.1338,
    6.3019,
    3.8374,
    8.383,
    6.4936,
    10.1407,
    8.9906,
    11.8393,
    11.3397,
    13.5798,
    14,
    15,
    -16,
    -17,
    15.1339,
    -21.3533,
    28.5122,
    -5.2967,
    30.8464,
    7.842,
    30.5508,
    16.36,
    30.3405,
    22.0103,
    30.7382,
    26.0799,
    30,
    31,
]


def test_rope_periods_example():
    p = rope_periods(32)
    expected = [1, 1.7783, 3.1623, 5.6234, 10, 17.7828, 31.6228]
    assert torch.allclose(p[:7], torch.tensor(expected, dtype=p.dtype), atol=1e-4)
    assert torch.isinf(p[7])


def test_rope_worked_example():
    x = torch.arange(32, dtype=torch.float32)[None]  # (T=1, Hd=32)
    coords = torch.tensor([[0.25, -0.5]])
    out = rope_rotate_interleaved(x, coords, head_dim=32, base=100, p_zero=0.125)
    assert out.shape == (1, 32)
    torch.testing.assert_close(out[0], torch.tensor(RESEARCH_CODE_ROPE_EXAMPLE), atol=1e-3, rtol=0)


def test_rope_preserves_norm_and_identity_at_origin():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 64, generator=g)
    coords = torch.rand(2, 1, 5, 2, generator=g) * 2 - 1
    out = rope_rotate_interleaved(x, coords, head_dim=64)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    zero = rope_rotate_interleaved(x, torch.zeros_like(coords), head_dim=64)
    torch.testing.assert_close(zero, x)


def _load_reference():
    ckpt = torch.load(CKPT, map_location="cpu", weights_only=True)
    sd = ckpt["student"] if "student" in ckpt else ckpt
    sd = strip_reference_prefixes(sd)
    model = ReferenceVeca.from_checkpoint_config(ckpt["config"])
    model.load_state_dict(sd, strict=True)
    return model.eval(), sd


def test_state_dict_keys_match_checkpoint():
    model, sd = _load_reference()
    msd = model.state_dict()
    assert set(msd) == set(sd)
    for k, v in sd.items():
        assert msd[k].shape == v.shape, k


@pytest.mark.parametrize("budget", [8, 16])
def test_matches_reference_vectors(budget):
    from safetensors.torch import load_file

    vec = load_file(VECTORS)
    model, _ = _load_reference()
    pv = vec["pixel_values"]
    with torch.no_grad():
        glob, patches, tokens = model(pv, num_cores=budget)
    assert glob.shape == (2, 64)
    assert patches.shape == (2, 12, 64)
    assert tokens.shape == (2, budget + 12, 64)
    torch.testing.assert_close(glob, vec[f"global_C{budget}"], atol=1e-5, rtol=0)
    torch.testing.assert_close(patches, vec[f"patches_C{budget}"], atol=1e-5, rtol=0)
    torch.testing.assert_close(tokens[:, 0], glob)
    torch.testing.assert_close(tokens[:, budget:], patches)


def test_one_block_patch_locality():
    """With one block a patch's output does not depend on other patches' pixels."""
    torch.manual_seed(0)
    model = ReferenceVeca(hidden_dim=64, num_heads=2, num_layers=1, mlp_hidden=96, num_query_tokens=16).eval()
    pv = torch.randn(1, 3, 32, 32)
    pv2 = pv.clone()
    pv2[:, :, :16, 16:] += 1.0  # change patch (0, 1) only
    with torch.no_grad():
        _, p1, _ = model(pv, 8)
        _, p2, _ = model(pv2, 8)
    diff = (p1 - p2).abs().amax(-1)[0]
    assert diff[1] > 1e-3
    assert torch.all(diff[[0, 2, 3]] < 1e-6)
