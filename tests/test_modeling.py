"""Behaviour of VecaModel: shapes, errors, locality, attention equivalences, training properties."""

import copy

import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from veca_hf import VECA_PRESETS, VecaConfig, VecaModel, modeling_veca
from veca_hf.modeling_veca import farthest_point_core_coordinates, linear_into_workspace


def make_model(**overrides) -> VecaModel:
    return VecaModel(tiny_config(**overrides)).eval()


# --- shapes ----------------------------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 5),
    budget_chunks=st.integers(1, 2),
    batch_size=st.integers(1, 2),
)
def test_output_shapes_for_every_budget_and_size(rows, cols, budget_chunks, batch_size):
    model = make_model()
    num_cores = 8 * budget_chunks
    pixel_values = torch.randn(batch_size, 3, 16 * rows, 16 * cols)
    with torch.no_grad():
        outputs = model(pixel_values, num_core_tokens=num_cores, output_hidden_states=True, output_attentions=True)
    num_tokens = num_cores + rows * cols
    assert outputs.last_hidden_state.shape == (batch_size, num_tokens, 64)
    assert outputs.pooler_output.shape == (batch_size, 64)
    assert outputs.core_coordinates.shape == (batch_size, num_cores, 2)
    assert len(outputs.hidden_states) == model.config.num_hidden_layers + 1
    assert all(h.shape == (batch_size, num_tokens, 64) for h in outputs.hidden_states)
    assert len(outputs.attentions) == model.config.num_hidden_layers
    assert all(a.shape == (batch_size, 2, num_tokens, num_tokens) for a in outputs.attentions)
    assert torch.equal(outputs.pooler_output, outputs.last_hidden_state[:, 0])
    assert outputs.core_coordinates.abs().max() < 1


def test_default_budget_is_the_bank_or_the_config_default(pixel_values):
    assert make_model()(pixel_values).last_hidden_state.shape[1] == 16 + 12
    assert make_model(default_num_core_tokens=8)(pixel_values).last_hidden_state.shape[1] == 8 + 12


def test_tuple_output(pixel_values):
    model = make_model()
    outputs = model(pixel_values, return_dict=False)
    assert isinstance(outputs, tuple)
    assert torch.equal(outputs[0], model(pixel_values).last_hidden_state)


@pytest.mark.parametrize("name", sorted(VECA_PRESETS))
def test_preset_parameter_counts(name):
    expected = {"veca-s16": 21.63, "veca-splus16": 28.72, "veca-b16": 85.73, "veca-l16": 303.20}[name]
    with torch.device("meta"):
        model = VecaModel(VecaConfig.from_preset(name))
    assert abs(sum(p.numel() for p in model.parameters()) / 1e6 - expected) < 0.01


# --- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, 4, 12, 24, 64, -8, 8.0, "8", True])
def test_bad_budget_raises_value_error(budget, pixel_values):
    with pytest.raises(ValueError, match="num_core_tokens"):
        make_model()(pixel_values, num_core_tokens=budget)


@pytest.mark.parametrize("shape", [(1, 3, 60, 64), (1, 3, 64, 50), (1, 3, 0, 16)])
def test_bad_image_size_raises_value_error(shape):
    with pytest.raises(ValueError, match="patch_size=16"):
        make_model()(torch.randn(shape))


def test_bad_channels_and_rank_raise_value_error():
    model = make_model()
    with pytest.raises(ValueError, match="channels"):
        model(torch.randn(1, 1, 32, 32))
    with pytest.raises(ValueError, match="shape"):
        model(torch.randn(3, 32, 32))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_size": 60, "num_attention_heads": 4}, "multiple of 4"),
        ({"hidden_size": 64, "num_attention_heads": 3}, "divisible"),
        ({"num_core_tokens": 20}, "multiple of core_chunk_size"),
        ({"default_num_core_tokens": 12}, "default_num_core_tokens"),
    ],
)
def test_bad_config_raises_value_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_unknown_preset_raises_value_error():
    with pytest.raises(ValueError, match="veca-b16"):
        VecaConfig.from_preset("veca-h16")


# --- locality: patches talk only through cores -----------------------------------------------------------------


def _perturb_one_patch(pixel_values: torch.Tensor) -> torch.Tensor:
    perturbed = pixel_values.clone()
    perturbed[:, :, :16, :16] += torch.randn_like(perturbed[:, :, :16, :16])  # patch (0, 0)
    return perturbed


def test_one_block_patch_output_ignores_other_patches(pixel_values):
    model = make_model(num_hidden_layers=1)
    with torch.no_grad():
        before = model(pixel_values, num_core_tokens=8).last_hidden_state
        after = model(_perturb_one_patch(pixel_values), num_core_tokens=8).last_hidden_state
    changed = (before - after).abs().amax(dim=(0, 2))  # (T,)
    assert changed[8] > 1e-3  # patch (0, 0) itself
    assert torch.all(changed[9:] == 0)  # every other patch: bit-identical
    assert torch.all(changed[:8] > 0)  # the cores saw it


def test_two_blocks_patch_output_depends_on_other_patches(pixel_values):
    model = make_model(num_hidden_layers=2)
    with torch.no_grad():
        before = model(pixel_values, num_core_tokens=8).last_hidden_state
        after = model(_perturb_one_patch(pixel_values), num_core_tokens=8).last_hidden_state
    assert (before - after)[:, 9:].abs().amax() > 1e-4


# --- attention equivalences --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [8, 16])
def test_eager_equals_sdpa(budget, pixel_values):
    eager = make_model()
    eager.config._attn_implementation = "eager"
    sdpa = copy.deepcopy(eager)
    sdpa.config._attn_implementation = "sdpa"
    with torch.no_grad():
        expected = eager(pixel_values, num_core_tokens=budget).last_hidden_state
        actual = sdpa(pixel_values, num_core_tokens=budget).last_hidden_state
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_attention_map_is_block_sparse_and_is_what_the_output_used(pixel_values):
    model = make_model()
    with torch.no_grad():
        plain = model(pixel_values, num_core_tokens=8)
        mapped = model(pixel_values, num_core_tokens=8, output_attentions=True)
    torch.testing.assert_close(mapped.last_hidden_state, plain.last_hidden_state, atol=1e-5, rtol=1e-5)
    for attention in mapped.attentions:  # (B, H, T, T)
        assert torch.all(attention[:, :, 8:, 8:] == 0)  # no patch-to-patch attention at all
        assert torch.all(attention[:, :, :, :8].sum(-1)[:, :, 8:] > 0.999)  # patches spread over cores only
        torch.testing.assert_close(attention.sum(-1), torch.ones(attention.shape[:-1]))
        assert torch.all(attention[:, :, :8] > 0)  # cores see every token


def test_attention_map_carries_gradients_to_the_output(pixel_values):
    model = make_model()
    outputs = model(pixel_values, num_core_tokens=8, output_attentions=True)
    attention = outputs.attentions[-1]
    attention.retain_grad()
    # NOTE: not `.sum()`: a LayerNorm output (unit weight, zero bias) always sums to zero.
    (outputs.pooler_output * torch.randn_like(outputs.pooler_output)).sum().backward()
    assert attention.grad is not None and attention.grad.abs().sum() > 0


# --- training properties -----------------------------------------------------------------------------------------


def test_train_mode_augments_patch_coordinates_only(pixel_values):
    model = make_model(num_hidden_layers=1)
    with torch.no_grad():
        evaluated = model(pixel_values, num_core_tokens=8).last_hidden_state
        model.train()
        first = model(pixel_values, num_core_tokens=8).last_hidden_state
        second = model(pixel_values, num_core_tokens=8).last_hidden_state
    assert not torch.allclose(first, second)  # a new draw per forward
    assert not torch.allclose(first, evaluated)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(pixel_values, num_core_tokens=8).last_hidden_state, evaluated)


def test_inactive_cores_untouched_by_an_optimizer_step(pixel_values):
    model = make_model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for budget in (16, 8):  # the 16-step gives the second chunk AdamW state; the 8-step must still skip it
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer.zero_grad(set_to_none=True)
        model(pixel_values, num_core_tokens=budget).last_hidden_state.pow(2).mean().backward()
        optimizer.step()
    after = dict(model.named_parameters())
    for name in ("embeddings.core_tokens.1", "embeddings.core_coordinates.1"):
        assert torch.equal(after[name], before[name]), name
    for name in ("embeddings.core_tokens.0", "embeddings.core_coordinates.0", "encoder.core_coordinate_heads.0.step"):
        assert not torch.equal(after[name], before[name]), name


def test_every_parameter_gets_a_gradient_at_full_budget(pixel_values):
    model = make_model()
    model(pixel_values, num_core_tokens=16).last_hidden_state.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant, pixel_values):
    model = make_model()
    model.train()
    checkpointed = copy.deepcopy(model)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert all(layer.gradient_checkpointing for layer in checkpointed.encoder.layer)
    for m in (model, checkpointed):
        torch.manual_seed(1)  # same coordinate-augmentation draw
        pixels = pixel_values.clone().requires_grad_(use_reentrant)
        m(pixels, num_core_tokens=16).last_hidden_state.pow(2).mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_initialisation_touches_every_parameter_and_buffer():
    model = VecaModel(tiny_config())
    for tensor in list(model.parameters()) + list(model.buffers()):
        with torch.no_grad():
            tensor.fill_(float("nan"))
    for module in model.modules():  # forget that init already ran, as a fresh meta-device load would
        module._is_hf_initialized = False
    for tensor in list(model.parameters()) + list(model.buffers()):
        tensor._is_hf_initialized = False
    model.initialize_weights()
    nan = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if torch.isnan(t).any()]
    assert nan == []


def test_missing_core_weights_are_initialised_on_load(tmp_path, pixel_values):
    from safetensors.torch import load_file, save_file

    model = make_model()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights = {k: v for k, v in weights.items() if "core_" not in k}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded = VecaModel.from_pretrained(tmp_path)
    for name, p in reloaded.named_parameters():
        assert torch.isfinite(p).all(), name
    coordinates = torch.cat(list(reloaded.embeddings.core_coordinates)).tanh()
    assert coordinates.abs().max() < 0.96 and coordinates.abs().max() > 0.5  # farthest-point init, not garbage
    assert torch.isfinite(reloaded(pixel_values).last_hidden_state).all()


def test_initial_core_coordinates_cover_the_image_evenly():
    rho = farthest_point_core_coordinates(64, 1000, 0.95, generator=torch.Generator().manual_seed(0))
    points = rho.tanh()
    assert points[0].norm() < 0.1  # core 1 starts near the centre
    assert points.abs().max() <= 0.95 + 1e-6
    for prefix in (8, 16, 64):  # every budget spreads over all four quadrants
        quadrants = {(bool(x > 0), bool(y > 0)) for x, y in points[1:prefix].tolist()}
        assert len(quadrants) == 4


def test_cores_move_with_the_image(pixel_values):
    model = make_model(num_hidden_layers=3)
    with torch.no_grad():
        for head in model.encoder.core_coordinate_heads:
            head.step.fill_(0.5)
        coordinates = model(pixel_values, num_core_tokens=8).core_coordinates
        start = torch.cat(list(model.embeddings.core_coordinates))[:8].tanh()
    assert not torch.allclose(coordinates[0], coordinates[1])  # image-dependent
    assert not torch.allclose(coordinates[0], start)


# --- dtypes and compilation ---------------------------------------------------------------------------------------


def test_bfloat16_forward(pixel_values):
    model = make_model()
    with torch.no_grad():
        reference = model(pixel_values, num_core_tokens=8).last_hidden_state
        outputs = copy.deepcopy(model).to(torch.bfloat16)(pixel_values, num_core_tokens=8)
    assert outputs.last_hidden_state.dtype == torch.bfloat16
    assert (outputs.last_hidden_state.float() - reference).abs().mean() < 0.05


def test_autocast_bfloat16_forward(pixel_values):
    model = make_model()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model(pixel_values, num_core_tokens=8)
    assert torch.isfinite(outputs.last_hidden_state.float()).all()


def test_torch_export_with_dynamic_batch(pixel_values):
    model = make_model()
    batch = torch.export.Dim("batch", min=1, max=8)
    exported = torch.export.export(
        model, (pixel_values,), kwargs={"num_core_tokens": 8, "return_dict": False}, dynamic_shapes=({0: batch}, None, None)
    )
    bigger = torch.randn(4, 3, 64, 48)
    torch.testing.assert_close(exported.module()(bigger, num_core_tokens=8, return_dict=False)[0],
                               model(bigger, num_core_tokens=8).last_hidden_state, atol=1e-5, rtol=1e-5)


def test_torch_compile_fullgraph(pixel_values):
    model = make_model()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for budget in (8, 16):
            torch.testing.assert_close(
                compiled(pixel_values, num_core_tokens=budget).last_hidden_state,
                model(pixel_values, num_core_tokens=budget).last_hidden_state,
                atol=1e-5,
                rtol=1e-5,
            )


def test_torch_compile_dynamic_builds_one_graph_for_every_budget_and_size():
    """Inference: `torch.compile(model, dynamic=True)` traces once; new budgets and resolutions reuse the graph.

    (A first call with a square image would tie height to width: duck sizing; a later non-square one recompiles once.)
    """
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = VecaModel(tiny_config(num_core_tokens=32)).eval()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for budget, (height, width) in [(8, (32, 48)), (16, (32, 48)), (24, (64, 64)), (32, (48, 32)), (8, (32, 32))]:
            pixel_values = torch.randn(2, 3, height, width)
            torch.testing.assert_close(
                compiled(pixel_values, num_core_tokens=budget).last_hidden_state,
                model(pixel_values, num_core_tokens=budget).last_hidden_state,
                atol=1e-5,
                rtol=1e-5,
            )
    assert counter.frame_count == 1


def test_patch_embedding_gemm_equals_the_convolution():
    """`embed_patches` runs the `Conv2d` as one GEMM over flattened patches: same values and gradients."""
    model = make_model()
    pixel_values = torch.randn(2, 3, 48, 80, requires_grad=True)
    conv = model.embeddings.patch_embeddings
    expected = conv(pixel_values).flatten(2).transpose(1, 2)  # (B, N, D), row-major patches
    patches = model.embeddings.embed_patches(pixel_values)
    torch.testing.assert_close(patches, expected, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(expected)
    grads = torch.autograd.grad((patches * weights).sum(), (pixel_values, conv.weight, conv.bias))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (pixel_values, conv.weight, conv.bias))
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hidden_act", ["silu", "gelu"])
def test_inference_mlp_equals_the_autograd_mlp(hidden_act):
    """Without autograd the SwiGLU activates and gates in place: same values as the autograd path."""
    model = make_model(hidden_act=hidden_act)
    mlp = model.encoder.layer[0].mlp
    hidden_states = torch.randn(2, 20, model.config.hidden_size)
    expected = mlp(hidden_states)
    assert expected.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(mlp(hidden_states), expected.detach(), rtol=1e-5, atol=1e-6)


def test_linear_into_workspace_reuses_one_buffer_and_equals_the_linear(monkeypatch):
    linear = torch.nn.Linear(8, 12)
    first, second = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    workspace = {}
    with torch.no_grad():
        # outputs glibc would not map fresh keep the plain call
        linear_into_workspace(linear, first, workspace, "proj")
        assert workspace == {}
        monkeypatch.setattr(modeling_veca, "FRESH_MMAP_BYTES", 0)
        out_first = linear_into_workspace(linear, first, workspace, "proj")
        torch.testing.assert_close(out_first, linear(first), rtol=0, atol=0)
        out_second = linear_into_workspace(linear, second, workspace, "proj")
        assert out_second.data_ptr() == out_first.data_ptr() and workspace["proj"] is out_second
        torch.testing.assert_close(out_second, linear(second), rtol=0, atol=0)
        # another shape gets a new buffer
        other = linear_into_workspace(linear, torch.randn(3, 8), workspace, "proj")
        assert other.shape == (3, 12) and workspace["proj"] is other
    # with autograd the module runs as usual: a fresh output that carries gradients
    out = linear_into_workspace(linear, first, workspace, "proj")
    assert out.requires_grad and out.data_ptr() != other.data_ptr()


def test_linear_into_workspace_keeps_hooks_and_subclasses(monkeypatch):
    monkeypatch.setattr(modeling_veca, "FRESH_MMAP_BYTES", 0)
    calls = []
    hooked = torch.nn.Linear(8, 12)
    hooked.register_forward_hook(lambda module, args, output: calls.append(output.shape))

    class ScaledLinear(torch.nn.Linear):  # stands in for an adapter or a quantised layer
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = ScaledLinear(8, 12)
    inputs = torch.randn(4, 8)
    with torch.no_grad():
        workspace = {}
        linear_into_workspace(hooked, inputs, workspace, "a")
        assert calls == [(4, 12)] and "a" not in workspace
        out = linear_into_workspace(scaled, inputs, workspace, "b")
        torch.testing.assert_close(out, 2 * torch.nn.functional.linear(inputs, scaled.weight, scaled.bias))
        assert "b" not in workspace


def test_inference_forward_shares_projection_buffers_across_blocks(monkeypatch, pixel_values):
    """Without autograd on CPU every block writes its qkv and SwiGLU input projections into the same two buffers,
    and the output equals the autograd forward's."""
    model = make_model(num_hidden_layers=3).eval()
    expected = model(pixel_values, num_core_tokens=16).last_hidden_state
    buffers = {}

    def spy(linear, hidden_states, workspace, name):
        output = linear_into_workspace(linear, hidden_states, workspace, name)
        buffers.setdefault(name, set()).add(output.data_ptr())
        return output

    monkeypatch.setattr(modeling_veca, "linear_into_workspace", spy)
    monkeypatch.setattr(modeling_veca, "FRESH_MMAP_BYTES", 0)  # the tiny model's outputs are all small
    with torch.no_grad():
        output = model(pixel_values, num_core_tokens=16).last_hidden_state
    assert {name: len(pointers) for name, pointers in buffers.items()} == {"qkv": 1, "gate_up": 1}
    torch.testing.assert_close(output, expected.detach(), rtol=1e-5, atol=1e-6)
