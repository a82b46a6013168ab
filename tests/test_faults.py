"""Faults of training steps (`veca_hf.training.faults`) and of teacher / student pairs, each injected.

The step guard runs on a real single-process `Accelerator` and a tiny linear model; the two-process agreement runs
under `accelerate.debug_launcher` (gloo, forked CPU processes).
"""

import logging
import os
import signal

import pytest
import torch
from accelerate import Accelerator, debug_launcher
from accelerate.state import AcceleratorState, GradientState
from conftest import prepared_linear, tiny_config, tiny_dinov3_config
from transformers import Dinov2Config

from veca_hf.data import build_transform
from veca_hf.training.distillation import check_teacher_student, teacher_normalization, transform_normalization
from veca_hf.training.faults import NonFiniteStepsError, StepGuard, any_process, nonfinite_tensor_names


# ----------------------------------------------------------------------------------------------------------------
# The step guard: non-finite steps, gradient accumulation, SIGTERM
# ----------------------------------------------------------------------------------------------------------------


def _guarded_step(accelerator, model, optimizer, guard, targets, max_grad_norm=1.0):
    """One optimiser step over the micro-batch targets (a NaN target stands for a corrupt teacher output)."""
    loss_finite = True
    for target in targets:
        with accelerator.accumulate(model):
            loss = (model(torch.ones(2, 4)) - target).square().mean()
            loss_finite &= bool(torch.isfinite(loss))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                outcome = guard.step(accelerator, model, optimizer, loss_finite, max_grad_norm)
    return outcome


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_non_finite_step_is_skipped_counted_and_stops_after_a_run_of_them(accelerator, max_grad_norm, caplog):
    model, optimizer = prepared_linear(accelerator)
    guard = StepGuard(max_consecutive_nonfinite_steps=2)
    assert _guarded_step(accelerator, model, optimizer, guard, [torch.zeros(3)], max_grad_norm).applied
    before = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer_steps = next(iter(optimizer.state.values()))["step"].clone()
    with caplog.at_level(logging.WARNING):
        outcome = _guarded_step(accelerator, model, optimizer, guard, [torch.full((3,), float("nan"))], max_grad_norm)
    assert not outcome.applied and not outcome.stop and "step skipped" in caplog.text
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert torch.equal(next(iter(optimizer.state.values()))["step"], optimizer_steps)  # no AdamW update either
    assert all(p.grad is None for p in model.parameters())
    assert nonfinite_tensor_names(model, optimizer) == []
    assert _guarded_step(accelerator, model, optimizer, guard, [torch.zeros(3)], max_grad_norm).applied  # resets
    assert guard.state_dict() == {"nonfinite_steps": 1, "consecutive_nonfinite_steps": 0}
    # A finite loss whose gradient overflows (an exploding step) is skipped too.
    handle = model.weight.register_hook(lambda grad: grad * float("inf"))
    assert not _guarded_step(accelerator, model, optimizer, guard, [torch.zeros(3)], max_grad_norm).applied
    handle.remove()
    with pytest.raises(NonFiniteStepsError, match="2 optimiser steps in a row had a non-finite loss"):
        _guarded_step(accelerator, model, optimizer, guard, [torch.full((3,), float("nan"))], max_grad_norm)


def test_a_non_finite_micro_batch_skips_the_whole_accumulated_step(tmp_path):
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    try:
        model, optimizer = prepared_linear(accelerator)
        guard = StepGuard()
        before = model.weight.detach().clone()
        # The first micro-batch is corrupt, the second fine: the step is still skipped.
        assert not _guarded_step(
            accelerator, model, optimizer, guard, [torch.full((3,), float("nan")), torch.zeros(3)]
        ).applied
        assert torch.equal(model.weight, before) and model.weight.grad is None
        # The next step starts from clean gradients and applies.
        assert _guarded_step(accelerator, model, optimizer, guard, [torch.zeros(3), torch.zeros(3)]).applied
        assert not torch.equal(model.weight, before) and torch.isfinite(model.weight).all()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_sigterm_asks_the_guard_to_stop_after_the_step(accelerator):
    model, optimizer = prepared_linear(accelerator)
    guard = StepGuard().install_signal_handler()
    try:
        assert not _guarded_step(accelerator, model, optimizer, guard, [torch.zeros(3)]).stop
        os.kill(os.getpid(), signal.SIGTERM)
        outcome = _guarded_step(accelerator, model, optimizer, guard, [torch.zeros(3)])
        assert outcome.stop and outcome.applied  # the step itself completes
        assert signal.getsignal(signal.SIGTERM) is not guard._on_sigterm  # a second SIGTERM acts as usual
    finally:
        guard.remove_signal_handler()


def _two_process_agreement():
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    assert any_process(accelerator, rank == 1, False, rank == 0) == [True, False, True]
    model, optimizer = prepared_linear(accelerator)
    before = accelerator.unwrap_model(model).weight.detach().clone()
    guard = StepGuard()
    guard.stop_requested = rank == 0  # SIGTERM reached one process only
    # Rank 1's teacher output is corrupt, rank 0's is fine: both skip, both stop.
    target = torch.full((3,), float("nan")) if rank == 1 else torch.zeros(3)
    outcome = _guarded_step(accelerator, model, optimizer, guard, [target])
    assert not outcome.applied and outcome.stop, (rank, outcome)
    assert torch.equal(accelerator.unwrap_model(model).weight, before)
    assert _guarded_step(accelerator, model, optimizer, guard, [torch.zeros(3)]).applied


@pytest.mark.processes
def test_all_processes_agree_to_skip_and_to_stop():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        debug_launcher(_two_process_agreement, num_processes=2)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


# ----------------------------------------------------------------------------------------------------------------
# Teacher and student must agree before the first step
# ----------------------------------------------------------------------------------------------------------------


IMAGENET = transform_normalization(build_transform(32, train=True))


def test_matching_teacher_and_student_pass():
    check_teacher_student(tiny_dinov3_config(), tiny_config(), [32, 64], IMAGENET, IMAGENET)
    # DINOv2 (patch 14) under a patch-16 student: the teacher sees 14 x the student's grid, which always fits.
    check_teacher_student(Dinov2Config(patch_size=14), tiny_config(), [32, 48], None, IMAGENET)


def test_resolution_not_a_multiple_of_the_student_patch_size():
    with pytest.raises(ValueError, match=r"Resolution\(s\) \[40\] are not multiples of the student's patch size 16"):
        check_teacher_student(Dinov2Config(patch_size=14), tiny_config(), [32, 40], None, None)


def test_different_channel_counts():
    with pytest.raises(ValueError, match="teacher takes 1-channel images and the student 3-channel"):
        check_teacher_student(tiny_dinov3_config(num_channels=1), tiny_config(), [32], None, None)


def test_teacher_normalisation_differing_from_the_student_pipeline(tmp_path):
    # DINOv3's satellite (SAT-493M) checkpoints normalise with these statistics, not ImageNet's.
    (tmp_path / "preprocessor_config.json").write_text(
        '{"image_mean": [0.430, 0.411, 0.296], "image_std": [0.213, 0.156, 0.143]}'
    )
    teacher = teacher_normalization(str(tmp_path))
    assert teacher == ([0.43, 0.411, 0.296], [0.213, 0.156, 0.143])
    with pytest.raises(
        ValueError,
        match=r"teacher expects images normalised with mean \[0.43, 0.411, 0.296\].*"
        r"student's data pipeline normalises with mean \[0.485",
    ):
        check_teacher_student(tiny_dinov3_config(), tiny_config(), [32], teacher, IMAGENET)
    assert teacher_normalization(str(tmp_path / "no-config")) is None  # unknown: not checked
