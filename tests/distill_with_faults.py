"""A test-only entry point: `examples/distill.py` with faults injected by patching, none of it in the training path.

    python tests/distill_with_faults.py <distill.py arguments>      (or as the script of `accelerate launch`)

Environment variables choose the faults:
- `VECA_HF_TEST_NAN_TEACHER_STEPS="STEP[:RANK],..."`: the teacher's outputs are NaN at those optimiser steps (on
  every rank, or on RANK only): a corrupt teacher output.
- `VECA_HF_TEST_PAUSE_AFTER_STEP=STEP`: after that step's checkpoint the run waits until SIGUSR1 (it goes on),
  SIGTERM (it goes on to its next step, checkpoints and exits) or a kill, so that a test, not a race, decides when a
  run is interrupted.
- `VECA_HF_TEST_KILL_AFTER_STEP=STEP:RANK`: once that step's checkpoint is complete, process RANK SIGKILLs itself (in
  the first attempt only, `TORCHELASTIC_RESTART_COUNT` 0, so that a restarted group runs on): a rank dies.
"""

import importlib.util
import os
import signal
import sys
import time
from pathlib import Path

from veca_hf.training import distillation_run


DISTILL = Path(__file__).resolve().parent.parent / "examples" / "distill.py"


def load_distill():
    spec = importlib.util.spec_from_file_location("distill", DISTILL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nan_steps() -> set[tuple[int, int | None]]:
    steps = set()
    for item in filter(None, os.environ.get("VECA_HF_TEST_NAN_TEACHER_STEPS", "").replace(" ", "").split(",")):
        step, _, rank = item.partition(":")
        steps.add((int(step), int(rank) if rank else None))
    return steps


def inject(distill) -> None:
    state = {"step": None, "guard": None}  # the optimiser step being computed, the run's StepGuard
    rank = int(os.environ.get("RANK", "0"))

    schedule_call = distill.ResolutionSchedule.__call__

    def resolution_at(self, step):  # called once at the start of every optimiser step, with the step done so far
        state["step"] = step + 1
        return schedule_call(self, step)

    distill.ResolutionSchedule.__call__ = resolution_at

    install = distill.StepGuard.install_signal_handler

    def remember_guard(self):
        state["guard"] = self
        return install(self)

    distill.StepGuard.install_signal_handler = remember_guard

    corrupt = nan_steps()
    teacher_targets = distillation_run.compute_teacher_targets

    def maybe_corrupt(*args, **kwargs):
        targets = teacher_targets(*args, **kwargs)
        if (state["step"], None) in corrupt or (state["step"], rank) in corrupt:
            targets.cls.fill_(float("nan"))
        return targets

    distillation_run.compute_teacher_targets = maybe_corrupt

    pause_after = os.environ.get("VECA_HF_TEST_PAUSE_AFTER_STEP")
    save = distillation_run.save_checkpoint

    def save_then_maybe_pause(accelerator, checkpoints_dir, step, *args, **kwargs):
        path = save(accelerator, checkpoints_dir, step, *args, **kwargs)
        if pause_after is not None and step == int(pause_after):
            resumed = []
            previous = signal.signal(signal.SIGUSR1, lambda *_: resumed.append(True))
            print(f"Paused after step {step}; SIGUSR1 continues, SIGTERM stops.", file=sys.stderr, flush=True)
            try:
                while not (resumed or (state["guard"] is not None and state["guard"].stop_requested)):
                    time.sleep(0.02)
            finally:
                signal.signal(signal.SIGUSR1, previous)
        return path

    kill_step, _, kill_rank = os.environ.get("VECA_HF_TEST_KILL_AFTER_STEP", "").partition(":")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def save_then_maybe_die(accelerator, checkpoints_dir, step, *args, **kwargs):
        path = save_then_maybe_pause(accelerator, checkpoints_dir, step, *args, **kwargs)
        if kill_step and step == int(kill_step) and rank == int(kill_rank) and first_attempt:
            print(f"Rank {rank} dies after step {step}.", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    distillation_run.save_checkpoint = save_then_maybe_die


if __name__ == "__main__":
    distill = load_distill()
    inject(distill)
    sys.argv = [str(DISTILL), *sys.argv[1:]]
    distill.main()
