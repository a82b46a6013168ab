"""Behaviour of VecaModel: shapes, errors, locality, attention equivalences, training properties."""

import copy

import pytest
import torch
from conftest import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from veca_hf import VECA_PRESETS, VecaConfig, VecaModel
from veca_hf.model.modeling_veca import farthest_point_core_coordinates


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
    assert outputs.core_positions.shape == (batch_size, num_cores, 2)
    assert len(outputs.hidden_states) == model.config.num_hidden_layers + 1
    assert all(h.shape == (batch_size, num_tokens, 64) for h in outputs.hidden_states)
    assert len(outputs.attentions) == model.config.num_hidden_layers
    assert all(a.shape == (batch_size, 2, num_tokens, num_tokens) for a in outputs.attentions)
    assert torch.equal(outputs.pooler_output, outputs.last_hidden_state[:, 0])
    assert outputs.core_positions.abs().max() < 1


def test_outputs_are_recorded_as_transformers_records_them(pixel_values):
    """Hidden states and maps come from transformers' output capture: the config's flags ask for them as the
    arguments do, indices select hidden states, and every head returns its trunk's."""
    import veca_hf

    model = make_model(num_hidden_layers=3)
    with torch.no_grad():
        full = model(pixel_values, num_core_tokens=8, output_hidden_states=True, output_attentions=True)
        model.set_attn_implementation("eager")  # transformers allows `config.output_attentions` with eager only
        model.config.output_hidden_states = model.config.output_attentions = True
        from_config = model(pixel_values, num_core_tokens=8)
        model.config.output_hidden_states = model.config.output_attentions = False
        model.set_attn_implementation("sdpa")
        selected = model(pixel_values, num_core_tokens=8, output_hidden_states=[0, -1])
        hidden_states = model(pixel_values, num_core_tokens=8, output_hidden_states=True).hidden_states
        plain = model(pixel_values, num_core_tokens=8)
    assert plain.hidden_states is None and plain.attentions is None
    assert len(from_config.hidden_states) == 4 and len(from_config.attentions) == 3
    for recorded, expected in zip(
        from_config.hidden_states + from_config.attentions, full.hidden_states + full.attentions, strict=True
    ):
        torch.testing.assert_close(recorded, expected, rtol=0, atol=0)
    assert [h is None for h in selected.hidden_states] == [False, True, True, False]
    torch.testing.assert_close(selected.hidden_states[-1], hidden_states[-1], rtol=0, atol=0)
    torch.testing.assert_close(full.hidden_states[0][:, 8:], model.embeddings.patch_embeddings(pixel_values))
    for head_class in ("VecaForImageClassification", "VecaBackbone", "VecaForSemanticSegmentation"):
        head = getattr(veca_hf, head_class)(model.config)
        head.veca.load_state_dict(model.state_dict())
        with torch.no_grad():
            outputs = head.eval()(pixel_values, num_core_tokens=8, output_hidden_states=True, output_attentions=True)
        for recorded, expected in zip(
            outputs.hidden_states + outputs.attentions, full.hidden_states + full.attentions, strict=True
        ):
            torch.testing.assert_close(recorded, expected, rtol=0, atol=0)


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
        ({"core_bank_size": 20}, "multiple of core_chunk_size"),
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


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _plain_rope(x, cos, sin):
    """RoPE as autograd sees the textbook formula, cos/sin segments broadcast and concatenated first."""

    def concatenated(segments):
        if torch.is_tensor(segments):
            return segments
        leading = torch.broadcast_shapes(*(segment.shape[:-2] for segment in segments))
        return torch.cat([segment.expand(*leading, *segment.shape[-2:]) for segment in segments], dim=-2)

    cos, sin = concatenated(cos).to(x.dtype), concatenated(sin).to(x.dtype)
    return x * cos + _rotate_half(x) * sin


@pytest.mark.parametrize("per_image_patches", [False, True])
def test_rope_gradient_is_the_formula_gradient(per_image_patches):
    from veca_hf.model.positions_veca import apply_rotary_pos_emb

    torch.manual_seed(0)
    f64 = torch.float64
    x = torch.randn(2, 3, 4, 4 + 5, 8, dtype=f64, requires_grad=True)  # (q/k, B, H, C + N, Hd)
    core_cos, core_sin = (torch.randn(3, 1, 4, 8, dtype=f64, requires_grad=True) for _ in range(2))
    patch_rows = 3 if per_image_patches else 1
    patch_cos, patch_sin = (torch.randn(patch_rows, 1, 5, 8, dtype=f64, requires_grad=True) for _ in range(2))
    inputs = (x, core_cos, core_sin, patch_cos, patch_sin)

    def segmented(x, core_cos, core_sin, patch_cos, patch_sin):
        return apply_rotary_pos_emb(x, (core_cos, patch_cos), (core_sin, patch_sin))

    assert torch.autograd.gradcheck(segmented, inputs)
    grad = torch.randn(x.shape, dtype=f64)
    ours = torch.autograd.grad(segmented(*inputs), inputs, grad)
    plain = torch.autograd.grad(_plain_rope(x, (core_cos, patch_cos), (core_sin, patch_sin)), inputs, grad)
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    # patches that need no gradient (the grid) get none, and the cores' gradient is unchanged
    ours_fixed = torch.autograd.grad(
        segmented(x, core_cos, core_sin, patch_cos.detach(), patch_sin.detach()), (x, core_cos, core_sin), grad
    )
    for a, b in zip(ours_fixed, ours[:3], strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_rope_rejects_unmatched_segments():
    from veca_hf.model.positions_veca import apply_rotary_pos_emb

    x, cos = torch.randn(1, 1, 6, 8), torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="same segments, got 2 and 1"):
        apply_rotary_pos_emb(x, (cos, torch.randn(1, 2, 8)), (cos,))


@pytest.mark.parametrize("autocast", [False, True])
def test_model_gradients_are_those_of_the_textbook_rope(monkeypatch, autocast, pixel_values):
    """The hand-written RoPE gradient against autograd through the textbook formula in fp32, every parameter (the
    cores' coordinate heads get theirs through the rotation only)."""
    from veca_hf.model import modeling_veca

    model = make_model().train()
    textbook = copy.deepcopy(model)
    grads = []
    for m, rope, bf16 in ((model, modeling_veca.apply_rotary_pos_emb, autocast), (textbook, _plain_rope, False)):
        monkeypatch.setattr(modeling_veca, "apply_rotary_pos_emb", rope)
        torch.manual_seed(1)  # same coordinate-augmentation draw
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = m(pixel_values, num_core_tokens=16).last_hidden_state.float().pow(2).mean()
        loss.backward()
        grads.append({name: p.grad for name, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, reference in grads[1].items():
        if autocast:  # bf16 rounding; autograd through the formula under autocast is 1-2% off, a wrong gradient O(1)
            assert grads[0][name].dtype == torch.float32
            assert (grads[0][name] - reference).norm() <= 0.1 * reference.norm(), name
        else:
            torch.testing.assert_close(grads[0][name], reference, atol=1e-6, rtol=1e-5, msg=name)


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
    for (name, p), (_, q) in zip(model.named_parameters(), checkpointed.named_parameters(), strict=True):
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
        coordinates = model(pixel_values, num_core_tokens=8).core_positions
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
        model,
        (pixel_values,),
        kwargs={"num_core_tokens": 8, "return_dict": False},
        dynamic_shapes={"pixel_values": {0: batch}, "num_core_tokens": None, "kwargs": {"return_dict": None}},
    )
    bigger = torch.randn(4, 3, 64, 48)
    torch.testing.assert_close(
        exported.module()(bigger, num_core_tokens=8, return_dict=False)[0],
        model(bigger, num_core_tokens=8).last_hidden_state,
        atol=1e-5,
        rtol=1e-5,
    )


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
    model = VecaModel(tiny_config(core_bank_size=32)).eval()
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
    """`VecaPatchEmbeddings` runs its `Conv2d` as one GEMM over flattened patches: same values and gradients."""
    model = make_model()
    pixel_values = torch.randn(2, 3, 48, 80, requires_grad=True)
    conv = model.embeddings.patch_embeddings
    assert isinstance(conv, torch.nn.Conv2d)
    expected = torch.nn.functional.conv2d(pixel_values, conv.weight, conv.bias, stride=16)
    expected = expected.flatten(2).transpose(1, 2)  # (B, N, D), row-major patches
    patches = conv(pixel_values)
    torch.testing.assert_close(patches, expected, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(expected)
    grads = torch.autograd.grad((patches * weights).sum(), (pixel_values, conv.weight, conv.bias))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (pixel_values, conv.weight, conv.bias))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-4)


def test_state_dict_keys_are_the_checkpoint_layout():
    keys = set(make_model().state_dict())
    assert {"embeddings.patch_embeddings.weight", "embeddings.patch_embeddings.bias"} <= keys
    assert {"embeddings.core_tokens.0", "embeddings.core_tokens.1", "embeddings.core_coordinates.1"} <= keys


def test_accelerate_cpu_offload_gives_the_same_output(pixel_values):
    """Offload hooks fire on every weight the model reads (patch GEMM, core bank): nothing is read on `meta`."""
    from accelerate import cpu_offload

    model = make_model()
    with torch.no_grad():
        expected = model(pixel_values, num_core_tokens=8).last_hidden_state
        offloaded = cpu_offload(copy.deepcopy(model), execution_device=torch.device("cpu"))
        assert any(p.device.type == "meta" for p in offloaded.parameters())
        actual = offloaded(pixel_values, num_core_tokens=8).last_hidden_state
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_from_pretrained_with_a_device_map_that_offloads_to_cpu_and_disk(tmp_path, pixel_values):
    """`device_map` with offloading: the embeddings (patch GEMM, core bank) and a block on "disk", the rest on the CPU,
    give the same output as the plain model (Accelerate's hooks fire on every weight the model reads)."""
    model = make_model()
    model.save_pretrained(tmp_path / "veca")
    layers = [f"encoder.layer.{index}" for index in range(model.config.num_hidden_layers)]
    device_map = {
        "embeddings": "disk",
        "rope_embeddings": "cpu",
        "encoder.core_coordinate_heads": "cpu",
        "norm": "cpu",
        layers[0]: "disk",
        **{name: "cpu" for name in layers[1:]},
    }
    offloaded = VecaModel.from_pretrained(
        tmp_path / "veca", device_map=device_map, offload_folder=str(tmp_path / "offload"), offload_state_dict=True
    ).eval()
    assert offloaded.embeddings.patch_embeddings.weight.device.type == "meta"  # offloaded to disk
    with torch.no_grad():
        expected = model(pixel_values, num_core_tokens=8).last_hidden_state
        actual = offloaded(pixel_values, num_core_tokens=8).last_hidden_state
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# --- the public surface ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", ["VecaModel", "VecaForImageClassification", "VecaBackbone"])
def test_unknown_keyword_arguments_raise(model_class, pixel_values):
    import veca_hf

    model = getattr(veca_hf, model_class)(tiny_config(num_labels=3)).eval()
    with pytest.raises(TypeError, match="num_cores"):
        model(pixel_values, num_cores=8)


def padded_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """A 64 x 48 image and a 32 x 48 one zero-padded below it, and their `(2, 64, 48)` pixel mask."""
    pixel_values = torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(1))
    pixel_mask = torch.ones(2, 64, 48, dtype=torch.long)
    pixel_values[1, :, 32:], pixel_mask[1, 32:] = 0, 0
    return pixel_values, pixel_mask


def test_a_registered_attention_kernel_runs_both_calls_of_every_block(pixel_values, monkeypatch):
    """A kernel registered with `AttentionInterface.register` is what VECA calls: for the cores over all tokens
    (with the padding mask) and for the patches over the cores; wrapping sdpa, it gives sdpa's outputs."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def recording_sdpa(module, query, key, value, attention_mask, **kwargs):
        calls.append((query.shape[2], key.shape[2], None if attention_mask is None else attention_mask.shape))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    # registered for this test only: the registry is process-wide
    monkeypatch.setitem(AttentionInterface._global_mapping, "recording_sdpa", recording_sdpa)
    sdpa = make_model()
    recording = copy.deepcopy(sdpa)
    recording.set_attn_implementation("recording_sdpa")
    padded, pixel_mask = padded_pair()
    with torch.no_grad():
        for inputs in ({"pixel_values": pixel_values}, {"pixel_values": padded, "pixel_mask": pixel_mask}):
            calls.clear()
            actual = recording(**inputs, num_core_tokens=8).last_hidden_state
            torch.testing.assert_close(actual, sdpa(**inputs, num_core_tokens=8).last_hidden_state, atol=0, rtol=0)
            mask = None if "pixel_mask" not in inputs else (2, 1, 8, 8 + 12)
            assert calls == [(8, 8 + 12, mask), (12, 8, None)] * sdpa.config.num_hidden_layers, calls


@pytest.mark.processes  # torch compiles flex attention's kernels with the system's C++ compiler
def test_flex_attention_equals_sdpa(pixel_values):
    """`attn_implementation="flex_attention"` (compiled by torch, on CPU too) gives sdpa's outputs."""
    sdpa = make_model()
    flex = copy.deepcopy(sdpa)
    flex.set_attn_implementation("flex_attention")
    with torch.no_grad():
        for budget in (8, 16):
            expected = sdpa(pixel_values, num_core_tokens=budget).last_hidden_state
            torch.testing.assert_close(flex(pixel_values, num_core_tokens=budget).last_hidden_state, expected,
                                       atol=1e-5, rtol=1e-5)  # fmt: skip


def test_attention_kernels_that_cannot_run_say_why():
    """A kernel that is not installed is transformers' ImportError; a name nobody registered, its ValueError; a
    padded batch on flash or flex (no additive mask; on CPU torch's flex kernel aborts with one), VECA's ValueError
    naming the kernels that take one."""
    from transformers import AttentionInterface

    with pytest.raises(ImportError, match="FlashAttention"):
        make_model().set_attn_implementation("flash_attention_2")
    with pytest.raises(ValueError, match="no_such_kernel"):
        make_model().set_attn_implementation("no_such_kernel")
    padded, pixel_mask = padded_pair()
    for kernel in ("flash_attention_2", "flex_attention"):
        model = make_model()
        model.config._attn_implementation = kernel  # as if installed: the check comes before any kernel runs
        with pytest.raises(ValueError, match=f"needs an attention kernel that takes a mask, not '{kernel}'"):
            model(padded, pixel_mask=pixel_mask)
    assert "flash_attention_2" in AttentionInterface._global_mapping  # nothing was unregistered on the way


@pytest.mark.parametrize("num_hidden_layers", [1, 3])
def test_all_core_positions_are_the_positions_each_block_used(num_hidden_layers, pixel_values):
    model = make_model(num_hidden_layers=num_hidden_layers)
    with torch.no_grad():
        for head in model.encoder.core_coordinate_heads:
            head.step.fill_(0.5)  # make the cores move
        outputs = model(pixel_values, num_core_tokens=8, output_core_positions=True)
        plain = model(pixel_values, num_core_tokens=8)
    assert plain.all_core_positions is None
    per_block = outputs.all_core_positions
    assert len(per_block) == num_hidden_layers
    assert all(c.shape == (2, 8, 2) and c.abs().max() < 1 for c in per_block)
    bank = torch.cat(list(model.embeddings.core_coordinates))[:8].tanh()
    torch.testing.assert_close(per_block[0], bank.expand(2, -1, -1), rtol=0, atol=0)
    torch.testing.assert_close(per_block[-1], outputs.core_positions, rtol=0, atol=0)
    if num_hidden_layers > 1:
        assert not torch.allclose(per_block[1], per_block[0])
    # they are what RoPE rotated by: recompute block 2's input positions by hand
    raw = torch.cat(list(model.embeddings.core_coordinates))[:8].unsqueeze(0)
    with torch.no_grad():
        hidden = model(pixel_values, num_core_tokens=8, output_hidden_states=True).hidden_states
        for layer in range(1, num_hidden_layers):
            raw = model.encoder.core_coordinate_heads[layer - 1](hidden[layer][:, :8], raw)
            torch.testing.assert_close(per_block[layer], raw.tanh(), rtol=0, atol=0)


def test_inactive_chunks_get_no_gradient_under_compile(pixel_values):
    """Compiled training keeps the chunked bank's meaning: chunks past the budget get `grad = None`."""
    torch._dynamo.reset()
    model = make_model()
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend="aot_eager")
    for budget in (8, 16):
        model.zero_grad(set_to_none=True)
        compiled(pixel_values, num_core_tokens=budget).last_hidden_state.pow(2).mean().backward()
        active = [p.grad is not None for p in model.embeddings.core_tokens]
        assert active == [True, budget == 16]


# --- opt-in CPU inference buffers (veca_hf.cpu.buffers) -------------------------------------------------------------


@pytest.mark.parametrize("hidden_act", ["silu", "gelu"])
def test_cpu_inference_buffers_change_no_value(monkeypatch, hidden_act, pixel_values):
    from veca_hf.cpu import buffers

    model = make_model(num_hidden_layers=3, hidden_act=hidden_act)
    with torch.no_grad():
        expected = model(pixel_values, num_core_tokens=16, output_hidden_states=True)
    monkeypatch.setattr(buffers, "FRESH_MMAP_BYTES", 0)  # the tiny model's outputs are all small
    with torch.no_grad(), buffers.cpu_inference_buffers(model):
        actual = model(pixel_values, num_core_tokens=16, output_hidden_states=True)
    for got, want in zip(actual.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # with autograd the patched modules run as usual, and leaving the context restores the class forwards
    with buffers.cpu_inference_buffers(model):
        grad_output = model(pixel_values, num_core_tokens=16).last_hidden_state
    assert grad_output.requires_grad
    assert all("forward" not in vars(m) for m in model.modules())


def test_cpu_inference_buffers_are_shared_across_blocks(monkeypatch):
    from veca_hf.cpu import buffers

    model = make_model(num_hidden_layers=3)
    monkeypatch.setattr(buffers, "FRESH_MMAP_BYTES", 0)
    outputs = {}
    with torch.no_grad(), buffers.cpu_inference_buffers(model):
        hidden_states = torch.randn(2, 20, 64)
        for layer in model.encoder.layer:
            qkv = layer.attention.qkv_proj(hidden_states)
            projection = layer.attention.qkv_proj
            expected = torch.nn.functional.linear(hidden_states, projection.weight, projection.bias)
            torch.testing.assert_close(qkv, expected)
            outputs.setdefault("qkv", set()).add(qkv.data_ptr())
            outputs.setdefault("gate_up", set()).add(layer.mlp.gate_up_proj(hidden_states).data_ptr())
        hooked = model.encoder.layer[0].attention.qkv_proj
        handle = hooked.register_forward_hook(lambda module, args, output: None)
        assert hooked(hidden_states).data_ptr() not in outputs["qkv"]  # a hook may keep the output: no sharing
        handle.remove()
    assert {name: len(p) for name, p in outputs.items()} == {"qkv": 1, "gate_up": 1}
