"""Distillation pieces: losses, budget/resolution sampling, teacher targets, parameter groups, overfitting."""

from collections import Counter

import pytest
import torch
from conftest import tiny_config, tiny_dinov3_config
from transformers import Dinov2Config, Dinov2Model, DINOv3ViTModel

from veca_hf import VecaModel
from veca_hf.budgets import BudgetSampler, paper_budget_weights, training_budgets
from veca_hf.training.distillation import (
    PAPER_STAGE2_RESOLUTION_SCHEDULE,
    DistillationLoss,
    ResolutionSchedule,
    StudentWithLoss,
    TeacherTargets,
    before_after_table,
    build_student_config,
    compute_teacher_targets,
    full_attention_student_config,
    teacher_autocast_dtype,
    teacher_image_size,
    validation_losses,
)
from veca_hf.training.distillation_run import StudentBudgets, budget_label
from veca_hf.training.optimization import get_parameter_groups


# The paper's elastic training: budgets 8..64 drawn with weights 1,1,2,2,3,3,4,4 (E[C] = 44).
PAPER_BUDGETS = (8, 16, 24, 32, 40, 48, 56, 64)
PAPER_WEIGHTS = (1, 1, 2, 2, 3, 3, 4, 4)


def test_loss_matches_a_hand_computation():
    generator = torch.Generator().manual_seed(0)
    student_global, teacher_cls = torch.randn(3, 8, generator=generator), torch.randn(3, 8, generator=generator)
    student_patches, teacher_patches = (
        torch.randn(3, 5, 8, generator=generator),
        torch.randn(3, 5, 8, generator=generator),
    )
    terms = DistillationLoss(8, 8, dense_weight=0.5, mse_weight=2.0)(
        student_global, student_patches, TeacherTargets(teacher_cls, teacher_patches)
    )

    def cosine(a, b):
        return sum(x * y for x, y in zip(a, b, strict=True)) / (
            sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5
        )

    global_loss = sum(1 - cosine(s.tolist(), t.tolist()) for s, t in zip(student_global, teacher_cls, strict=True)) / 3
    dense_cos = (
        sum(
            1 - cosine(s.tolist(), t.tolist())
            for sb, tb in zip(student_patches, teacher_patches, strict=True)
            for s, t in zip(sb, tb, strict=True)
        )
        / 15
    )
    dense_mse = sum(
        (x - y) ** 2
        for x, y in zip(student_patches.flatten().tolist(), teacher_patches.flatten().tolist(), strict=True)
    ) / (3 * 5 * 8)
    assert terms["global_loss"].item() == pytest.approx(global_loss, rel=1e-5)
    assert terms["dense_cosine_loss"].item() == pytest.approx(dense_cos, rel=1e-5)
    assert terms["dense_mse_loss"].item() == pytest.approx(dense_mse, rel=1e-5)
    assert terms["loss"].item() == pytest.approx(global_loss + 0.5 * (dense_cos + 2.0 * dense_mse), rel=1e-5)


def test_loss_projects_when_widths_differ_and_checks_grids():
    loss = DistillationLoss(8, 12)
    assert loss.projection is not None and DistillationLoss(8, 8).projection is None
    terms = loss(torch.randn(2, 8), torch.randn(2, 4, 8), TeacherTargets(torch.randn(2, 12), torch.randn(2, 4, 12)))
    terms["loss"].backward()
    assert loss.projection.weight.grad is not None
    with pytest.raises(ValueError, match="patch grids"):
        DistillationLoss(8, 8)(
            torch.randn(2, 8), torch.randn(2, 4, 8), TeacherTargets(torch.randn(2, 8), torch.randn(2, 5, 8))
        )


def test_budget_sampler_is_identical_across_ranks_and_follows_the_weights():
    rank0, rank1 = (
        BudgetSampler(PAPER_BUDGETS, PAPER_WEIGHTS, seed=3),
        BudgetSampler(PAPER_BUDGETS, PAPER_WEIGHTS, seed=3),
    )
    draws = [rank0(step) for step in range(20000)]
    assert draws == [rank1(step) for step in range(20000)]  # every rank, no communication
    assert draws[:50] != [BudgetSampler(PAPER_BUDGETS, PAPER_WEIGHTS, seed=4)(step) for step in range(50)]
    counts = Counter(draws)
    total = sum(PAPER_WEIGHTS)
    for budget, weight in zip(PAPER_BUDGETS, PAPER_WEIGHTS, strict=True):
        assert abs(counts[budget] / len(draws) - weight / total) < 0.012, budget
    assert abs(sum(draws) / len(draws) - 44) < 0.5  # E[C] = 44 (the paper's elastic training)


def test_default_budgets_follow_the_student_bank():
    """Every chunk multiple up to the bank, weights ceil(4 i / K): the paper's 1,1,2,2,3,3,4,4 for a bank of 64."""
    assert paper_budget_weights(8) == list(PAPER_WEIGHTS)
    assert training_budgets(tiny_config(core_bank_size=64)) == (list(PAPER_BUDGETS), list(PAPER_WEIGHTS))
    assert training_budgets(tiny_config(core_bank_size=16)) == ([8, 16], [2, 4])
    assert training_budgets(tiny_config(core_bank_size=32)) == ([8, 16, 24, 32], [1, 2, 3, 4])
    assert training_budgets(tiny_config(core_bank_size=16, core_chunk_size=4)) == ([4, 8, 12, 16], [1, 2, 3, 4])
    for count in range(1, 20):  # non-decreasing, ends at 4
        weights = paper_budget_weights(count)
        assert weights == sorted(weights) and weights[-1] == 4 and len(weights) == count


def test_training_budgets_defaults_and_errors():
    config = tiny_config(core_bank_size=16)
    assert training_budgets(config) == ([8, 16], [2.0, 4.0])
    assert training_budgets(config, "16,8") == ([16, 8], [4.0, 2.0])  # weights follow the budget, not the position
    assert training_budgets(config, "8,16", "1,1") == ([8, 16], [1.0, 1.0])
    assert training_budgets(config, None, "3,1") == ([8, 16], [3.0, 1.0])
    with pytest.raises(ValueError, match="--budgets entry=24 is not a valid budget"):
        training_budgets(config, "8,24")
    with pytest.raises(ValueError, match=r"--budget_weights '1,1,2' has 3 weights.*\[8, 16\] has 2"):
        training_budgets(config, None, "1,1,2")
    with pytest.raises(ValueError, match="--budgets '8,x' is not a comma-separated list"):
        training_budgets(config, "8,x")


def test_budget_sampler_rejects_bad_weights():
    with pytest.raises(ValueError, match="weights"):
        BudgetSampler(budgets=(8, 16), weights=(1,))
    with pytest.raises(ValueError, match="non-negative"):
        BudgetSampler(budgets=(8, 16), weights=(1, -1))


def test_resolution_schedule_switches_stage_and_parses_the_paper_recipe():
    schedule = ResolutionSchedule(PAPER_STAGE2_RESOLUTION_SCHEDULE, seed=0)
    early = {schedule(step) for step in range(0, 3000)}
    late = Counter(schedule(step) for step in range(7000, 17000))
    assert early == {256, 384, 512}
    assert set(late) == {256, 384, 512, 768} and abs(late[768] / 10000 - 0.30) < 0.02
    assert schedule.max_resolution == 768
    assert {ResolutionSchedule("256")(step) for step in range(10)} == {256}


@pytest.mark.parametrize("text", ["abc", "0:256@1,2", "5:256", "0:-16"])
def test_resolution_schedule_rejects_bad_text(text):
    with pytest.raises(ValueError):
        ResolutionSchedule(text)


def test_teacher_targets_drop_cls_and_registers():
    teacher = DINOv3ViTModel(tiny_dinov3_config()).eval()
    pixel_values = torch.randn(3, 3, 64, 48)
    targets = compute_teacher_targets(teacher, pixel_values, student_patch_size=16, micro_batch_size=2)
    with torch.no_grad():
        hidden = teacher(pixel_values=pixel_values).last_hidden_state  # 1 CLS + 4 registers + 12 patches
    torch.testing.assert_close(targets.cls, hidden[:, 0])
    torch.testing.assert_close(targets.patches, hidden[:, 5:])
    assert targets.patches.shape == (3, 12, 64)


def test_teacher_targets_keep_the_teacher_in_eval_mode():
    teacher = DINOv3ViTModel(tiny_dinov3_config())
    teacher.train()  # DINOv3's train mode rescales RoPE at random
    pixel_values = torch.randn(2, 3, 32, 32)
    first = compute_teacher_targets(teacher, pixel_values, 16)
    second = compute_teacher_targets(teacher, pixel_values, 16)
    assert not teacher.training
    torch.testing.assert_close(first.patches, second.patches)


def test_teacher_with_another_patch_size_sees_the_same_grid():
    teacher = Dinov2Model(
        Dinov2Config(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            patch_size=14,
            image_size=56,
        )
    ).eval()
    assert teacher_image_size(64, 48, 16, 14) == (56, 42)
    targets = compute_teacher_targets(teacher, torch.randn(2, 3, 64, 48), student_patch_size=16)
    assert targets.patches.shape == (2, 12, 32)


def test_teacher_grid_mismatch_is_a_clear_error():
    class WrongTeacher(torch.nn.Module):
        config = tiny_dinov3_config(num_register_tokens=0)

        def forward(self, pixel_values):
            return type("Output", (), {"last_hidden_state": torch.zeros(pixel_values.shape[0], 7, 64)})()

    with pytest.raises(ValueError, match="the student has 4"):
        compute_teacher_targets(WrongTeacher(), torch.randn(1, 3, 32, 32), 16)
    with pytest.raises(ValueError, match="patch size"):
        teacher_image_size(30, 32, 16, 14)


def test_parameter_groups_keep_weight_decay_off_cores_coordinates_norms_and_biases():
    model = VecaModel(tiny_config())
    decay, no_decay = get_parameter_groups(model, weight_decay=0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert {
        "embeddings.core_tokens.0",
        "embeddings.core_coordinates.1",
        "encoder.core_coordinate_heads.0.step",
    } <= no_decay_names
    assert "norm.weight" in no_decay_names and "encoder.layer.0.attention.qkv_proj.bias" in no_decay_names
    assert "encoder.layer.0.attention.qkv_proj.weight" in decay_names
    assert "embeddings.patch_embeddings.weight" in decay_names
    assert len(decay_names) + len(no_decay_names) == len(list(model.parameters()))
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0


def test_loss_falls_when_overfitting_a_tiny_set():
    torch.manual_seed(0)
    student = VecaModel(tiny_config()).train()
    teacher = DINOv3ViTModel(tiny_dinov3_config()).eval()
    pixel_values = torch.randn(4, 3, 32, 32)
    targets = compute_teacher_targets(teacher, pixel_values, 16)
    criterion = DistillationLoss(64, 64)
    optimizer = torch.optim.AdamW(get_parameter_groups(student, 0.01), lr=3e-3)
    sampler = BudgetSampler(budgets=(8, 16), weights=(1, 1))
    losses = []
    for step in range(40):
        budget = sampler(step)
        outputs = student(pixel_values, num_core_tokens=budget)
        loss = criterion(outputs.pooler_output, outputs.last_hidden_state[:, budget:], targets)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5


def test_dense_student_matches_veca_size_except_cores_and_layer_scale():
    config = tiny_config()
    dense = DINOv3ViTModel(full_attention_student_config(config))
    veca = VecaModel(config)
    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "patch_size",
        "rope_theta",
        "pos_embed_shift",
        "pos_embed_rescale",
        "layer_norm_eps",
    ):
        assert getattr(dense.config, name) == getattr(config, name), name
    assert dense.config.use_gated_mlp and dense.config.key_bias and dense.config.num_register_tokens == 0

    def count(model, exclude=()):
        return sum(p.numel() for n, p in model.named_parameters() if not any(e in n for e in exclude))

    # Same blocks: the only parameters that differ are VECA's core bank + coordinate heads and DINOv3's CLS, mask
    # token and LayerScales.
    veca_only = ("core_tokens", "core_coordinates", "core_coordinate_heads")
    dense_only = ("cls_token", "mask_token", "layer_scale")
    assert count(veca, veca_only) == count(dense, dense_only)


def test_student_with_loss_reads_cls_and_patches_of_a_dense_student():
    torch.manual_seed(0)
    config = tiny_config()
    teacher = DINOv3ViTModel(tiny_dinov3_config()).eval()
    pixel_values = torch.randn(2, 3, 32, 48)
    targets = compute_teacher_targets(teacher, pixel_values, 16)
    for num_register_tokens in (0, 2):
        dense = DINOv3ViTModel(full_attention_student_config(config, num_register_tokens=num_register_tokens)).eval()
        criterion = DistillationLoss(64, 64)
        terms = StudentWithLoss(dense, criterion)(pixel_values, None, targets.cls, targets.patches)
        hidden = dense(pixel_values).last_hidden_state  # (2, 1 + R + 6, 64)
        expected = criterion(hidden[:, 0], hidden[:, 1 + num_register_tokens :], targets)
        torch.testing.assert_close(terms["loss"], expected["loss"])

    veca = VecaModel(config).eval()
    terms = StudentWithLoss(veca, DistillationLoss(64, 64))(pixel_values, 8, targets.cls, targets.patches)
    outputs = veca(pixel_values, num_core_tokens=8)
    expected = DistillationLoss(64, 64)(outputs.pooler_output, outputs.last_hidden_state[:, 8:], targets)
    torch.testing.assert_close(terms["loss"], expected["loss"])


def test_build_student_config_from_preset_or_saved_config_with_overrides(tmp_path):
    config = build_student_config(None, "veca-s16", '{"num_hidden_layers": 4, "patch_size": 14}')
    assert (config.hidden_size, config.num_hidden_layers, config.patch_size) == (384, 4, 14)
    assert build_student_config().hidden_size == 768  # the default preset, veca-b16
    tiny_config(out_features=["stage1", "stage2"]).save_pretrained(tmp_path)
    assert build_student_config(str(tmp_path)).out_features == ["stage1", "stage2"]
    deeper = build_student_config(str(tmp_path), student_overrides={"num_hidden_layers": 3})
    assert deeper.num_hidden_layers == 3 and deeper.stage_names[-1] == "stage3"  # stages follow the new depth


def test_teacher_autocast_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert teacher_autocast_dtype("auto", cpu) is None and teacher_autocast_dtype("auto", cuda) is torch.bfloat16
    assert (
        teacher_autocast_dtype("bfloat16", cpu) is torch.bfloat16 and teacher_autocast_dtype("float32", cuda) is None
    )
    assert teacher_autocast_dtype("float16", cpu) is torch.float16
    # The short spellings (accelerate's --mixed_precision uses them) read the same.
    assert teacher_autocast_dtype("bf16", cpu) is torch.bfloat16 and teacher_autocast_dtype("fp32", cuda) is None
    with pytest.raises(ValueError, match="--teacher_dtype 'float8' is not one of .*: pass one of them"):
        teacher_autocast_dtype("float8", cpu)


def test_validation_losses_are_per_budget_means_over_images(accelerator):
    """Batches of different sizes: the result is the mean over images, not over batches, for every budget."""
    student = VecaModel(tiny_config()).eval()
    model = StudentWithLoss(student, DistillationLoss(64, 64)).train()
    batches = [(torch.randn(n, 3, 32, 32), torch.randn(n, 64), torch.randn(n, 4, 64)) for n in (3, 1)]
    results = validation_losses(model, batches, [8, 16], accelerator)
    assert model.training  # back in train mode
    for budget in (8, 16):
        with torch.no_grad():
            model.eval()
            per_image = [model(x[i : i + 1], budget, cls[i : i + 1], patches[i : i + 1])["loss"]
                         for x, cls, patches in batches for i in range(len(x))]  # fmt: skip
        assert results[budget]["loss"] == pytest.approx(float(torch.stack(per_image).mean()), rel=1e-5)
        assert set(results[budget]) == {"loss", "global_loss", "dense_cosine_loss", "dense_mse_loss"}
    assert results[8]["loss"] != results[16]["loss"]


def test_before_after_table_shows_loss_and_cosines_per_budget():
    before = {"8": {"loss": 4.5, "global_loss": 0.99, "dense_cosine_loss": 0.9}}
    after = {"8": {"loss": 1.25, "global_loss": 0.09, "dense_cosine_loss": 0.3}}
    table = before_after_table(before, after, step=120, resolution=224, num_images=3)
    assert table.splitlines()[0] == "Held-out images (3 at 224 px), before the first step -> after step 120:"
    assert table.splitlines()[-1] == "| 8 | 4.5000 -> 1.2500 | 0.0100 -> 0.9100 | 0.1000 -> 0.7000 |"
    assert "before" not in before_after_table(None, after, 120, 224, 3) and "| 8 | 1.2500 | 0.9100 |" in (
        before_after_table(None, after, 120, 224, 3)
    )


def test_a_veca_student_draws_its_budgets_and_the_dense_control_has_one():
    budgets = StudentBudgets.for_student(VecaModel(tiny_config()), "8,16", seed=0)
    assert budgets.values == [8, 16] and {budgets.at(step) for step in range(50)} == {8, 16}
    control = StudentBudgets.for_student(DINOv3ViTModel(full_attention_student_config(tiny_config())))
    assert control.values == [None] and control.at(3) is None
    assert [budget_label(b) for b in (8, None)] == ["8", "dense"]
