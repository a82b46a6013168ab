# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Crash-safe training checkpoints on top of `Accelerator.save_state` / `load_state`.

A checkpoint is written into a hidden temporary folder and renamed to `checkpoint-{step}` only once every process
has finished writing, so a folder with a final name is always complete: a crash mid-save leaves the previous
checkpoint intact, and `find_latest_checkpoint` never picks a half-written one.
"""

import json
import os
import re
import shutil
from pathlib import Path

from transformers.utils import logging


logger = logging.get_logger(__name__)

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
TRAINING_STATE_NAME = "training_state.json"


def process_state_name(process_index: int) -> str:
    return f"process_state_{process_index}.json"


def checkpoint_steps(checkpoints_dir: str | Path) -> list[int]:
    """Steps of the complete checkpoints in `checkpoints_dir`, ascending."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    steps = [int(m.group(1)) for p in checkpoints_dir.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name)) and p.is_dir()]
    return sorted(steps)


def find_latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder, or `None`."""
    steps = checkpoint_steps(checkpoints_dir)
    return Path(checkpoints_dir) / f"checkpoint-{steps[-1]}" if steps else None


def resolve_resume_path(resume_from_checkpoint: str | None, checkpoints_dir: str | Path) -> Path | None:
    """`None` -> no resume; `"latest"` -> the newest checkpoint (or `None` when there is none yet); else the path."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint == "latest":
        return find_latest_checkpoint(checkpoints_dir)
    path = Path(resume_from_checkpoint)
    if not (path / TRAINING_STATE_NAME).is_file():
        raise ValueError(
            f"--resume_from_checkpoint {resume_from_checkpoint!r} is not a complete checkpoint folder (no "
            f"{TRAINING_STATE_NAME}); pass 'latest' or a checkpoint-<step> folder."
        )
    return path


def save_checkpoint(accelerator, checkpoints_dir: str | Path, step: int, training_state: dict, process_state: dict,
                    total_limit: int | None = None) -> Path:
    """Saves model, optimiser, RNG and registered objects (Accelerate), plus JSON state, atomically.

    Args:
        accelerator (`accelerate.Accelerator`): the run's accelerator (every process must call this).
        checkpoints_dir (`str` or `Path`): folder holding the `checkpoint-{step}` folders.
        step (`int`): the optimiser step just completed.
        training_state (`dict`): JSON-serialisable state shared by all processes (written by the main process).
        process_state (`dict`): JSON-serialisable state of this process (e.g. its position in its data stream).
        total_limit (`int`, *optional*): keep only this many newest checkpoints.
    """
    checkpoints_dir = Path(checkpoints_dir)
    final = checkpoints_dir / f"checkpoint-{step}"
    temporary = checkpoints_dir / f".tmp-checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(temporary))
    _write_json(temporary / process_state_name(accelerator.process_index), process_state)
    if accelerator.is_main_process:
        _write_json(temporary / TRAINING_STATE_NAME, training_state)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():  # re-saving the same step after a resume
            shutil.rmtree(final)
        os.replace(temporary, final)
        if total_limit:
            for old_step in checkpoint_steps(checkpoints_dir)[:-total_limit]:
                shutil.rmtree(checkpoints_dir / f"checkpoint-{old_step}", ignore_errors=True)
        logger.info(f"Saved checkpoint {final}")
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: str | Path) -> tuple[dict, dict]:
    """Restores what `save_checkpoint` wrote; returns `(training_state, this process's state)`."""
    path = Path(path)
    accelerator.load_state(str(path))
    training_state = json.loads((path / TRAINING_STATE_NAME).read_text())
    process_file = path / process_state_name(accelerator.process_index)
    if not process_file.is_file():
        raise ValueError(
            f"{path} has no state for process {accelerator.process_index}: it was written by a run with fewer "
            "processes. Resume with the same number of processes."
        )
    return training_state, json.loads(process_file.read_text())


def _write_json(path: Path, data: dict) -> None:
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(temporary, path)


__all__ = ["find_latest_checkpoint", "load_checkpoint", "resolve_resume_path", "save_checkpoint"]
