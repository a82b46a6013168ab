"""VECA as the backbone of transformers' dense heads: Depth Anything, DPT (depth) and UperNet, built from configs.

The ViT necks (Depth Anything, DPT) read token sequences with one prefix token (`reshape_hidden_states=False`); UperNet
reads `(B, D, H/p, W/p)` maps (the default). Heads cannot pass `num_core_tokens`, so the budget is
`default_num_core_tokens`. Tiny configs, nothing touches the network (see conftest)."""

import pytest
import torch
from conftest import tiny_config
from transformers import (
    AutoModelForDepthEstimation,
    DepthAnythingConfig,
    DepthAnythingForDepthEstimation,
    DPTConfig,
    DPTForDepthEstimation,
    UperNetConfig,
    UperNetForSemanticSegmentation,
)

from veca_hf import VecaBackbone, VecaConfig, VecaModel


BUDGET = 8  # of a bank of 16: the heads must run at the config's default budget, not the whole bank


def backbone_config(**overrides) -> VecaConfig:
    """Four blocks, their four outputs as features (the four maps the ViT necks fuse), at budget 8."""
    values = dict(num_hidden_layers=4, out_indices=[1, 2, 3, 4], default_num_core_tokens=BUDGET)
    return tiny_config(**{**values, **overrides})


def depth_anything_config(**overrides) -> DepthAnythingConfig:
    # NOTE: Depth Anything reads the patch size and the backbone width from its own config, not the backbone's.
    values = dict(
        backbone_config=backbone_config(reshape_hidden_states=False),
        patch_size=16,
        reassemble_hidden_size=64,
        neck_hidden_sizes=[8, 16, 32, 64],
        fusion_hidden_size=16,
        head_hidden_size=8,
    )
    return DepthAnythingConfig(**{**values, **overrides})


def images(height: int, width: int, batch_size: int = 2) -> torch.Tensor:
    return torch.randn(batch_size, 3, height, width, generator=torch.Generator().manual_seed(0))


def test_token_sequences_put_the_global_core_first():
    """`reshape_hidden_states=False`: `(B, 1 + N, D)`, the normed core 1 then the patches (the maps' patches)."""
    flat = VecaBackbone(backbone_config(reshape_hidden_states=False)).eval()
    maps = VecaBackbone(backbone_config()).eval()
    maps.load_state_dict(flat.state_dict())
    pixel_values = images(64, 48)
    with torch.no_grad():
        sequences = flat(pixel_values).feature_maps
        grids = maps(pixel_values).feature_maps
        reference = flat.veca(pixel_values, num_core_tokens=BUDGET, output_hidden_states=True)

    assert [tuple(s.shape) for s in sequences] == [(2, 1 + 4 * 3, 64)] * 4
    for stage, (sequence, grid) in enumerate(zip(sequences, grids, strict=True), start=1):
        tokens = reference.last_hidden_state if stage == 4 else flat.veca.norm(reference.hidden_states[stage])
        torch.testing.assert_close(sequence[:, 0], tokens[:, 0], rtol=0, atol=0)
        torch.testing.assert_close(sequence[:, 1:], tokens[:, BUDGET:], rtol=0, atol=0)
        assert torch.equal(grid, sequence[:, 1:].reshape(2, 4, 3, 64).permute(0, 3, 1, 2))
    assert torch.equal(sequences[-1][:, 0], reference.pooler_output)


@pytest.mark.parametrize("height, width", [(64, 48), (48, 80)])
def test_depth_anything_forward(height, width):
    model = DepthAnythingForDepthEstimation(depth_anything_config()).eval()
    assert isinstance(model.backbone, VecaBackbone)
    pixel_values = images(height, width)
    with torch.no_grad():
        depth = model(pixel_values).predicted_depth
        at_default = model.backbone(pixel_values).feature_maps
        at_budget = model.backbone(pixel_values, num_core_tokens=BUDGET).feature_maps
        at_bank = model.backbone(pixel_values, num_core_tokens=16).feature_maps
    assert depth.shape == (2, height, width) and torch.isfinite(depth).all()
    assert all(
        torch.equal(a, b) for a, b in zip(at_default, at_budget, strict=True)
    )  # the head runs at default_num_core_tokens
    assert not torch.equal(at_default[-1], at_bank[-1])


@pytest.mark.parametrize("readout_type", ["project", "add", "ignore"])
def test_dpt_depth_forward(readout_type):
    """DPT takes any backbone through `backbone_config` (not hybrid); it reads the patch size and width from it."""
    config = DPTConfig(
        backbone_config=backbone_config(reshape_hidden_states=False),
        readout_type=readout_type,
        neck_hidden_sizes=[8, 16, 32, 64],
        fusion_hidden_size=16,
    )
    model = DPTForDepthEstimation(config).eval()
    assert isinstance(model.backbone, VecaBackbone)
    # NOTE: DPT's fusion doubles the size at each step, so with a 0.5 reassemble factor (the default four-level neck)
    # its output has the input size only on an even patch grid (here 4 x 6); Depth Anything resizes explicitly.
    with torch.no_grad():
        depth = model(images(64, 96)).predicted_depth
    assert depth.shape == (2, 64, 96) and torch.isfinite(depth).all()


def test_upernet_forward_and_gradients_reach_the_active_cores():
    config = UperNetConfig(
        backbone_config=backbone_config(),
        hidden_size=16,
        auxiliary_channels=8,
        num_labels=3,
    )
    model = UperNetForSemanticSegmentation(config).train()
    assert isinstance(model.backbone, VecaBackbone)
    pixel_values = images(64, 48)
    labels = torch.randint(0, 3, (2, 64, 48), generator=torch.Generator().manual_seed(1))
    outputs = model(pixel_values, labels=labels)
    assert outputs.logits.shape == (2, 3, 64, 48)
    outputs.loss.backward()

    without_grad = {name for name, p in model.backbone.named_parameters() if p.grad is None}
    # the second chunk of cores is outside the budget of 8: it gets no gradient (see `VecaCoreBank`)
    assert without_grad == {"veca.embeddings.core_tokens.1", "veca.embeddings.core_coordinates.1"}
    for name, parameter in model.backbone.named_parameters():
        if parameter.grad is not None:
            assert torch.isfinite(parameter.grad).all(), name
    assert model.backbone.veca.embeddings.core_tokens[0].grad.abs().sum() > 0


def test_depth_anything_save_load_round_trip(tmp_path):
    """After `import veca_hf`, `backbone_config` deserialises to a `VecaConfig` and the weights load exactly."""
    model = DepthAnythingForDepthEstimation(depth_anything_config()).eval()
    model.save_pretrained(tmp_path)

    for loader in (DepthAnythingForDepthEstimation, AutoModelForDepthEstimation):
        loaded, info = loader.from_pretrained(tmp_path, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        backbone = loaded.config.backbone_config
        assert isinstance(backbone, VecaConfig)
        assert backbone.default_num_core_tokens == BUDGET and backbone.reshape_hidden_states is False
        assert backbone.out_features == ["stage1", "stage2", "stage3", "stage4"]
        pixel_values = images(64, 48)
        with torch.no_grad():
            assert torch.equal(loaded.eval()(pixel_values).predicted_depth, model(pixel_values).predicted_depth)


def test_pretrained_veca_weights_into_a_head(tmp_path):
    """The recipe in docs/usage.md: a head built from the folder's config, its backbone loaded from the folder."""
    veca = VecaModel(tiny_config(num_hidden_layers=4)).eval()
    veca.save_pretrained(tmp_path)

    config = depth_anything_config(
        backbone_config=VecaConfig.from_pretrained(
            tmp_path, out_indices=[1, 2, 3, 4], reshape_hidden_states=False, default_num_core_tokens=BUDGET
        )
    )
    model = DepthAnythingForDepthEstimation(config).eval()
    model.backbone.load_state_dict(VecaBackbone.from_pretrained(tmp_path).state_dict())  # strict: every key

    pixel_values = images(64, 48)
    with torch.no_grad():
        last = model.backbone(pixel_values).feature_maps[-1]
        tokens = veca(pixel_values, num_core_tokens=BUDGET).last_hidden_state
    assert torch.equal(last[:, 0], tokens[:, 0]) and torch.equal(last[:, 1:], tokens[:, BUDGET:])
