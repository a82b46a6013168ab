# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Faults of long training runs: non-finite steps and preemption, decided the same way on every process, and the
process group of an elastic restart after a rank died (`join_restarted_group`).

`StepGuard` is called once per optimiser step, after the backward pass of the step's last micro-batch. It clips the
gradients, checks the loss and the gradients for NaN / inf, and with one all-reduce makes every process agree on two
things: whether to apply the update (a non-finite step is skipped on all of them) and whether to stop (SIGTERM on
any of them: write a checkpoint and exit). Too many non-finite steps in a row stop the run with an error.
`end_training_together` ends a run on every process at once.

```python
guard = StepGuard(max_consecutive_nonfinite_steps=10).install_signal_handler()
...
with accelerator.accumulate(model):
    loss = ...
    loss_finite &= bool(torch.isfinite(loss))
    accelerator.backward(loss)
    if accelerator.sync_gradients:
        outcome = guard.step(accelerator, model, optimizer, loss_finite, max_grad_norm=1.0)
...
if outcome.stop:
    save_checkpoint(...); sys.exit(PREEMPTED_EXIT_CODE)
```
"""

import datetime
import math
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers.utils import logging


logger = logging.get_logger(__name__)

# NOTE: 128 + SIGTERM, what a shell reports for a process killed by SIGTERM. Not 0: the run is not finished, and
# Kubernetes Jobs, torchrun and `cmd && next` would treat 0 as done; requeue logic can test for 143 specifically.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


def any_process(accelerator, *flags: bool) -> list[bool]:
    """For each flag, whether it is set on at least one process (one all-reduce for all of them; every process
    must call this with the same number of flags)."""
    if accelerator.num_processes == 1:
        return [bool(flag) for flag in flags]
    values = torch.tensor([float(bool(flag)) for flag in flags], device=accelerator.device)
    values = accelerator.reduce(values, reduction="sum")
    return [value > 0 for value in values.tolist()]


def end_training_together(accelerator) -> None:
    """`accelerator.end_training()` on every process at once: all of them leave the process group together (every
    process must call this, after its last collective)."""
    # NOTE: a process that exits while its peers still hold the group can abort (SIGABRT) in gloo's teardown, and
    # a launcher whose worker aborted leaves the other machines' launchers waiting at torchrun's exit barrier.
    accelerator.wait_for_everyone()
    accelerator.end_training()


@torch.no_grad()
def replicas_agree(accelerator, model: nn.Module) -> bool:
    """Whether every process holds the same weights (data parallelism keeps replicas equal; a diverged one would
    mean a broken step). One all-gather of two checksums per parameter; not for ZeRO-3's partitioned parameters."""
    if accelerator.num_processes == 1:
        return True
    parameters = [p.detach().double() for p in model.parameters()]
    checksums = torch.stack([torch.stack((p.sum(), p.abs().sum())) for p in parameters]).to(accelerator.device)
    gathered = accelerator.gather(checksums.unsqueeze(0))  # (processes, P, 2)
    return bool((gathered == gathered[:1]).all())


def nonfinite_tensor_names(*objects: nn.Module | torch.optim.Optimizer) -> list[str]:
    """Names of the parameters, buffers and optimiser states of `objects` that hold a NaN or an infinity.

    One device synchronisation when everything is finite; names are looked up only otherwise.
    """
    named = []
    names = {}  # id(parameter) -> name, to name optimiser states
    for obj in objects:
        if isinstance(obj, nn.Module):
            for name, tensor in (*obj.named_parameters(), *obj.named_buffers()):
                names[id(tensor)] = name
                named.append((name, tensor))
    for obj in objects:
        if not isinstance(obj, nn.Module):
            for position, (parameter, state) in enumerate(obj.state.items()):
                owner = names.get(id(parameter), f"parameter {position}")
                named.extend(
                    (f"optimizer state {key!r} of {owner}", value)
                    for key, value in state.items()
                    if isinstance(value, torch.Tensor)
                )
    named = [(name, tensor) for name, tensor in named if tensor.is_floating_point() and tensor.numel()]
    if not named or bool(torch.stack([torch.isfinite(tensor).all() for _, tensor in named]).all()):
        return []
    return [name for name, tensor in named if not bool(torch.isfinite(tensor).all())]


def gradients_are_finite(parameters) -> bool:
    """Whether every existing `.grad` is free of NaN and infinity (one device synchronisation)."""
    flags = [torch.isfinite(p.grad).all() for p in parameters if p.grad is not None]
    return bool(torch.stack(flags).all()) if flags else True


class NonFiniteStepsError(RuntimeError):
    """Too many optimiser steps in a row had a non-finite loss or gradients."""


@dataclass
class StepOutcome:
    """What `StepGuard.step` did: `applied` (the optimiser stepped), `stop` (some process asked to stop), and the
    gradient norm before clipping (`None` without clipping)."""

    applied: bool
    stop: bool
    grad_norm: float | None = None


class StepGuard:
    """
    Skips non-finite optimiser steps and turns SIGTERM into a clean stop, in agreement across processes.

    A step is non-finite when any micro-batch's loss, or any gradient after accumulation, holds a NaN or an infinity
    on any process. It is skipped on every process (gradients zeroed, no optimiser update; the caller still counts
    it as a step: its data is consumed and the LR schedule moves on), counted and logged. After
    `max_consecutive_nonfinite_steps` such steps in a row, `step` raises `NonFiniteStepsError`.

    `install_signal_handler` makes SIGTERM (what SLURM and Kubernetes send before killing a job) set a flag instead of
    killing the process; the next `step` reports `stop=True` on every process, so all of them stop after the same
    step. A second SIGTERM kills the process as usual (checkpoints are atomic, so even that loses no saved work).

    NOTE: under DeepSpeed the engine updates the weights inside `accelerator.backward`, before this guard runs: it
    can count non-finite steps and stop the run, but not skip them (DeepSpeed's fp16 loss scaler skips overflowing
    steps itself).

    Args:
        max_consecutive_nonfinite_steps (`int`, *optional*, defaults to 10):
            Stop after this many non-finite steps in a row (1: at the first one).
    """

    def __init__(self, max_consecutive_nonfinite_steps: int = 10):
        if max_consecutive_nonfinite_steps < 1:
            raise ValueError(f"--max_consecutive_nonfinite_steps must be >= 1, got {max_consecutive_nonfinite_steps}.")
        self.max_consecutive_nonfinite_steps = max_consecutive_nonfinite_steps
        self.nonfinite_steps = 0
        self.consecutive_nonfinite_steps = 0
        self.stop_requested = False
        self._previous_handler = None

    def install_signal_handler(self) -> "StepGuard":
        """Catch SIGTERM from now on (main thread only); `remove_signal_handler` restores the previous handler."""
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def remove_signal_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True
        self.remove_signal_handler()  # a second SIGTERM acts as usual
        logger.warning("SIGTERM received: the run will write a checkpoint after this step and exit.")

    def step(
        self,
        accelerator,
        model: nn.Module,
        optimizer,
        loss_finite: bool,
        max_grad_norm: float = 0.0,
        step: int | None = None,
    ) -> StepOutcome:
        """
        Clip, check, agree with the other processes, then apply or skip the optimiser step.

        Call it where `optimizer.step()` would go, once per optimiser step (`accelerator.sync_gradients`), on every
        process.

        Args:
            accelerator (`accelerate.Accelerator`): the run's accelerator.
            model (`nn.Module`): the prepared model (its gradients are checked and clipped).
            optimizer: the prepared optimiser.
            loss_finite (`bool`): whether every micro-batch loss of this step was finite on this process.
            max_grad_norm (`float`, *optional*, defaults to 0): clip the gradient norm to this (0: no clipping).
            step (`int`, *optional*): the step's number, for the log.

        Raises:
            `NonFiniteStepsError`: after `max_consecutive_nonfinite_steps` skipped steps in a row.
        """
        grad_norm = None
        if max_grad_norm > 0:
            total = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            grad_norm = None if total is None else float(total)
        # NOTE: a non-finite total norm means non-finite gradients; clipping by it made them all NaN, which is fine
        # since the step is then skipped.
        grads_finite = math.isfinite(grad_norm) if grad_norm is not None else gradients_are_finite(model.parameters())
        nonfinite, stop = any_process(accelerator, not (loss_finite and grads_finite), self.stop_requested)
        if nonfinite:
            optimizer.zero_grad(set_to_none=True)
            self.nonfinite_steps += 1
            self.consecutive_nonfinite_steps += 1
            logger.warning(
                f"{'' if step is None else f'Step {step}: '}non-finite loss or gradients (NaN or inf) on at least one "
                "process: step skipped, no update "
                f"({self.consecutive_nonfinite_steps} in a row, {self.nonfinite_steps} in all)."
            )
            if self.consecutive_nonfinite_steps >= self.max_consecutive_nonfinite_steps:
                raise NonFiniteStepsError(
                    f"{self.consecutive_nonfinite_steps} optimiser steps in a row had a non-finite loss or gradients "
                    f"(--max_consecutive_nonfinite_steps {self.max_consecutive_nonfinite_steps}); the weights were "
                    "not "
                    "updated by any of them. Check the data and the teacher's outputs, lower --learning_rate or set "
                    "--max_grad_norm, then resume from the last checkpoint (--resume_from_checkpoint latest)."
                )
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.consecutive_nonfinite_steps = 0
        return StepOutcome(applied=not nonfinite, stop=stop, grad_norm=grad_norm)

    def state_dict(self) -> dict:
        return {
            "nonfinite_steps": self.nonfinite_steps,
            "consecutive_nonfinite_steps": self.consecutive_nonfinite_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.nonfinite_steps = int(state.get("nonfinite_steps", 0))
        self.consecutive_nonfinite_steps = int(state.get("consecutive_nonfinite_steps", 0))


def ignore_sigterm(worker_id: int | None = None) -> None:
    """A DataLoader `worker_init_fn`: workers ignore SIGTERM, so that a SIGTERM sent to the whole process group
    (SLURM does) leaves them serving the main process until it has written its checkpoint.

    NOTE: the main process must then shut its loader down itself, also when it raises (close the iterator or the
    generator over it in a `finally`, as `examples/distill.py` does): multiprocessing's exit hook stops leftover
    workers with SIGTERM and waits for them, forever."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


__all__ = [
    "PREEMPTED_EXIT_CODE",
    "NonFiniteStepsError",
    "StepGuard",
    "StepOutcome",
    "any_process",
    "gradients_are_finite",
    "ignore_sigterm",
    "nonfinite_tensor_names",
    "replicas_agree",
]


def join_restarted_group(backend: str | None = None) -> bool:
    """Form the process group of an elastic restart (`accelerate launch --max_restarts N`, torchrun) under a store
    prefix of its own attempt; call it before `Accelerator()`, which then uses that group.

    torchrun's default (static) rendezvous keeps one TCPStore for all attempts, and the keys by which the ranks of the
    attempt that died found each other are still in it: a restarted rank can read a dead peer's address and fail to
    connect (gloo: `connectFullMesh failed ... Connection refused`) or wait forever. A prefix per attempt
    (`TORCHELASTIC_RESTART_COUNT`) leaves the old keys unread. Returns whether it formed the group: not in the first
    attempt, outside torchrun, or when a group exists already.

    Args:
        backend (`str`, *optional*): defaults to `"nccl"` on CUDA, `"gloo"` on CPU (or with `ACCELERATE_USE_CPU`).
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or not dist.is_available() or dist.is_initialized() or "MASTER_PORT" not in os.environ:
        return False
    if backend is None:
        use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
        backend = "gloo" if use_cpu or not torch.cuda.is_available() else "nccl"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # the launcher's agent serves the store at MASTER_ADDR:MASTER_PORT; without it rank 0 does (torch's own rule)
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_serves and rank == 0,
        timeout=datetime.timedelta(minutes=10),
        multi_tenant=not agent_serves,
    )
    dist.init_process_group(backend, store=dist.PrefixStore(f"veca_hf/attempt_{attempt}", store), rank=rank,
                            world_size=world_size)  # fmt: skip
    logger.warning(f"Restart {attempt} of an elastic launch: rank {rank} of {world_size} joined its new group.")
    return True
