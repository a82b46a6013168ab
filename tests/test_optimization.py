"""The paper's recipe pieces: the NorMuon / AdamW split, warm-up from the minimum learning rate, and the teacher's
patch embedding copied into the student."""

import logging

import pytest
import torch
from conftest import tiny_config, tiny_dinov3_config
from transformers import Dinov2Config, Dinov2Model, DINOv3ViTModel

from veca_hf import VecaModel
from veca_hf.training.distillation import (
    DistillationLoss,
    StudentWithLoss,
    full_attention_student_config,
    init_patch_embeddings_from_teacher,
    patch_embedding_conv,
)
from veca_hf.training.optimization import (
    build_optimizer,
    check_optimizer_backend,
    cosine_schedule_with_warmup,
    newton_schulz_dtype,
    normuon_parameter_names,
    optimizer_group_names,
)


pytest.importorskip("pytorch_optimizer")


def veca_student(teacher_width: int = 96) -> StudentWithLoss:
    """Two blocks of width 64 and a projection to a wider teacher."""
    return StudentWithLoss(VecaModel(tiny_config()), DistillationLoss(64, teacher_width))


def test_normuon_takes_the_blocks_hidden_matrices_but_the_last_mlp_output():
    model = veca_student()
    optimizer = build_optimizer(model, "normuon", learning_rate=1e-3, weight_decay=0.05)
    hidden, decayed, not_decayed = optimizer_group_names(model, optimizer)
    assert [group["use_muon"] for group in optimizer.param_groups] == [True, False, False]
    block = "student.encoder.layer.{}.{}.weight"
    assert hidden == [block.format(i, name) for i in (0, 1)
                      for name in ("attention.qkv_proj", "attention.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
                      if (i, name) != (1, "mlp.down_proj")]  # fmt: skip
    # AdamW, decayed: the patch embedding, the last MLP output, the coordinate head, the loss's projection
    assert decayed == [
        "student.embeddings.patch_embeddings.weight",
        "student.encoder.layer.1.mlp.down_proj.weight",
        "student.encoder.core_coordinate_heads.0.proj.weight",
        "criterion.projection.weight",
    ]
    # AdamW, not decayed: cores, coordinates, step scales, norms and biases
    assert {
        "student.embeddings.core_tokens.0",
        "student.embeddings.core_coordinates.1",
        "student.encoder.core_coordinate_heads.0.step",
        "student.norm.weight",
        "student.encoder.layer.0.attention.qkv_proj.bias",
        "criterion.projection.bias",
    } <= set(not_decayed)
    assert not any(name.endswith("weight") and "norm" not in name for name in not_decayed)
    assert sorted(hidden + decayed + not_decayed) == sorted(name for name, _ in model.named_parameters())
    groups = optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.05, 0.05, 0.0] and {g["lr"] for g in groups} == {1e-3}
    assert groups[0]["use_adjusted_lr"] and groups[0]["ns_coeffs"] != groups[0].get(
        "original"
    )  # Moonlight, Polar Express


def test_the_dense_control_gets_the_same_split():
    model = StudentWithLoss(DINOv3ViTModel(full_attention_student_config(tiny_config())), DistillationLoss(64, 64))
    hidden = normuon_parameter_names(model)
    assert len(hidden) == 2 * 7 - 1  # q, k, v, o, gate, up, down per block, less the last down
    assert "student.model.layer.1.mlp.down_proj.weight" not in hidden
    assert "student.model.layer.0.mlp.down_proj.weight" in hidden
    optimizer = build_optimizer(model, "normuon", 1e-3)
    adamw = {name for names in optimizer_group_names(model, optimizer)[1:] for name in names}
    assert {"student.embeddings.cls_token", "student.model.layer.0.layer_scale1.lambda1",
            "student.embeddings.patch_embeddings.weight"} <= adamw  # fmt: skip


def test_normuon_and_adamw_train_differently_and_stay_finite():
    torch.manual_seed(0)
    weights = {}
    for name in ("adamw", "normuon"):
        torch.manual_seed(0)
        model = VecaModel(tiny_config())
        optimizer = build_optimizer(model, name, 1e-2)
        for _ in range(3):
            loss = (
                model(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)))
                .last_hidden_state.pow(2)
                .mean()
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        weights[name] = model.encoder.layer[0].attention.qkv_proj.weight.detach().clone()
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.allclose(weights["adamw"], weights["normuon"])


def test_newton_schulz_runs_in_fp32_on_a_cpu_without_bf16_instructions(monkeypatch):
    from veca_hf.cpu import hardware

    for fast, expected in ((False, torch.float32), (True, torch.bfloat16), (None, torch.bfloat16)):
        monkeypatch.setattr(hardware, "cpu_bf16_support", lambda measure_size=None, fast=fast: {"fast_bf16": fast})
        assert newton_schulz_dtype("cpu") == expected
        assert build_optimizer(VecaModel(tiny_config()), "normuon", 1e-2).newton_schulz_dtype == expected
    assert newton_schulz_dtype("cuda") == torch.bfloat16
    for asked, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):  # an explicit choice is kept
        assert build_optimizer(VecaModel(tiny_config()), "normuon", newton_schulz=asked).newton_schulz_dtype == dtype
    with pytest.raises(ValueError, match="'float16' is not one of auto, bfloat16, float32"):
        build_optimizer(VecaModel(tiny_config()), "normuon", newton_schulz="float16")


def test_the_newton_schulz_dtype_reaches_the_iteration():
    """One NorMuon step on the same weight and gradient with the iteration in fp64, fp32 and bf16: the fp32 step is
    the fp64 one to float precision, the bf16 step (pytorch-optimizer's own) is not."""
    from veca_hf.training.optimization import _normuon_class

    steps = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        linear = torch.nn.Linear(96, 160, bias=False)
        optimizer = _normuon_class()([{"params": [linear.weight], "use_muon": True}], newton_schulz_dtype=dtype)
        linear.weight.grad = torch.randn_like(linear.weight)
        optimizer.step()
        steps[dtype] = linear.weight.detach().clone()
    fp32_error = (steps[torch.float32] - steps[torch.float64]).abs().max()
    bf16_error = (steps[torch.bfloat16] - steps[torch.float64]).abs().max()
    assert fp32_error < 1e-6 < bf16_error, (fp32_error, bf16_error)


def test_unknown_optimizer_and_normuon_under_deepspeed_are_clear_errors():
    with pytest.raises(ValueError, match="'sgd' is not one of adamw, normuon"):
        build_optimizer(veca_student(), "sgd")
    with pytest.raises(ValueError, match="NorMuon orthogonalises each hidden weight matrix whole.*--optimizer adamw"):
        check_optimizer_backend("normuon", uses_deepspeed=True)
    check_optimizer_backend("adamw", uses_deepspeed=True)
    check_optimizer_backend("normuon", uses_deepspeed=False)


def learning_rates(warmup_from_min: bool, steps: int = 10) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = cosine_schedule_with_warmup(optimizer, 1e-3, 1e-4, warmup_steps=4, total_steps=steps,
                                            warmup_from_min=warmup_from_min)  # fmt: skip
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def test_warmup_starts_from_the_minimum_learning_rate_when_asked():
    paper, default = learning_rates(True), learning_rates(False)
    assert paper[0] == pytest.approx(1e-4) and default[0] == 0.0
    assert paper[3] == pytest.approx(1e-3)  # the peak at the end of the warm-up
    assert all(a < b for a, b in zip(paper[:4], paper[1:4], strict=False))
    # then the same cosine to the minimum (transformers' warm-up-rate schedule runs it one step earlier)
    assert paper[4:-1] == pytest.approx(default[5:]) and paper[-1] == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="min_learning_rate 0.01 must lie between 0 and learning_rate 0.001"):
        cosine_schedule_with_warmup(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), 1e-3, 1e-2, 1, 5)


def dinov2_teacher(patch_size: int = 16, hidden_size: int = 64) -> Dinov2Model:
    config = Dinov2Config(hidden_size=hidden_size, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                          patch_size=patch_size, image_size=64)  # fmt: skip
    return Dinov2Model(config)


@pytest.mark.parametrize("teacher_kind", ["dinov2", "dinov3"])
@pytest.mark.parametrize("student_kind", ["veca", "dense"])
def test_auto_copies_the_teacher_patch_embedding_when_the_shapes_match(teacher_kind, student_kind, caplog):
    teacher = dinov2_teacher() if teacher_kind == "dinov2" else DINOv3ViTModel(tiny_dinov3_config())
    student = (
        VecaModel(tiny_config())
        if student_kind == "veca"
        else DINOv3ViTModel(full_attention_student_config(tiny_config()))
    )
    with caplog.at_level(logging.INFO):
        assert init_patch_embeddings_from_teacher(student, teacher, "auto")
    source, target = patch_embedding_conv(teacher), patch_embedding_conv(student)
    assert torch.equal(source.weight, target.weight) and torch.equal(source.bias, target.bias)
    assert "Patch embedding copied from the teacher" in caplog.text


def test_auto_skips_other_shapes_yes_refuses_them_and_no_never_copies(caplog):
    student = VecaModel(tiny_config())
    before = patch_embedding_conv(student).weight.detach().clone()
    teacher = dinov2_teacher(patch_size=14)  # (64, 3, 14, 14) against the student's (64, 3, 16, 16)
    with caplog.at_level(logging.INFO):
        assert not init_patch_embeddings_from_teacher(student, teacher, "auto")
    assert "not copied" in caplog.text and "(64, 3, 14, 14)" in caplog.text
    with pytest.raises(ValueError, match=r"\(64, 3, 14, 14\).*\(64, 3, 16, 16\)"):
        init_patch_embeddings_from_teacher(student, teacher, "yes")
    assert not init_patch_embeddings_from_teacher(student, dinov2_teacher(), "no")
    assert torch.equal(patch_embedding_conv(student).weight, before)
    with pytest.raises(ValueError, match="'maybe' is not one of auto, yes, no"):
        init_patch_embeddings_from_teacher(student, teacher, "maybe")
