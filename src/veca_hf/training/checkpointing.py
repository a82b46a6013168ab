# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Crash-safe training checkpoints on top of `Accelerator.save_state` / `load_state`.

A checkpoint is written into a hidden temporary folder and renamed to `checkpoint-{step}` only once every process
has finished writing, so a crash mid-save leaves the previous checkpoint intact. The last file written before the
rename is `manifest.json` (the size and SHA-256 of every other file), so a checkpoint damaged later (a disk failure,
a truncated copy) is recognised: `find_latest_checkpoint` skips it and falls back to the newest complete one. A folder
without a manifest, or whose manifest does not list exactly the files inside it, is not complete.
A failed save (disk full) removes its temporary folder and says so; older checkpoints are rotated away
(`total_limit`) only after the new one is complete, and non-finite weights or optimiser states are never saved.
A run that does not continue from the checkpoints in its folder refuses to start there (they are another run's,
which it would replace and rotate away), unless told to remove them (`overwrite`).

Resuming never runs code from a checkpoint: the manifest proves a checkpoint is whole, not who wrote it, so before
anything is restored every file is checked to load as data (`check_loads_as_data`: JSON, safetensors headers, and
torch files through `torch.load(weights_only=True)`), and a file that would need a full unpickle is refused with an
error naming it. Plain-number state (the learning-rate schedule) is stored as JSON, not pickled.
"""

import contextlib
import errno
import hashlib
import json
import logging as python_logging
import os
import pickle
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers.utils import logging

from .faults import any_process, nonfinite_tensor_names


logger = logging.get_logger(__name__)

# Accelerate logs five INFO lines per save (model, optimiser, scheduler, sampler, RNG): one of ours says it all.
_ACCELERATE_LOGGERS = ("accelerate.accelerator", "accelerate.checkpointing")


@contextlib.contextmanager
def _accelerate_warnings_only() -> Iterator[None]:
    loggers = [python_logging.getLogger(name) for name in _ACCELERATE_LOGGERS]
    levels = [item.level for item in loggers]
    for item in loggers:
        item.setLevel(max(item.getEffectiveLevel(), python_logging.WARNING))
    try:
        yield
    finally:
        for item, level in zip(loggers, levels, strict=True):
            item.setLevel(level)


CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
TRAINING_STATE_NAME = "training_state.json"
MANIFEST_NAME = "manifest.json"
# How a full disk shows in errors that are not OSError (safetensors: "StorageFull", torch.save: "file write failed").
_DISK_FULL_TEXTS = ("No space left", "StorageFull", "Disk quota exceeded", "code: 28")


def process_state_name(process_index: int) -> str:
    return f"process_state_{process_index}.json"


def checkpoint_steps(checkpoints_dir: str | Path) -> list[int]:
    """Steps of the `checkpoint-{step}` folders in `checkpoints_dir` (complete or not), ascending."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    steps = [
        int(m.group(1)) for p in checkpoints_dir.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name)) and p.is_dir()
    ]
    return sorted(steps)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files_in(folder: Path) -> set[str]:
    """The relative POSIX names of everything under `folder` that is not a folder (files and links of any kind),
    `manifest.json` left out: what its manifest must list."""
    names = set()
    for root, directories, files in os.walk(folder):  # NOTE: never descends into a linked folder
        for name in files + [d for d in directories if os.path.islink(os.path.join(root, d))]:
            names.add(Path(root, name).relative_to(folder).as_posix())
    names.discard(MANIFEST_NAME)
    return names


def write_manifest(folder: str | Path) -> None:
    """Write `manifest.json` (size and SHA-256 of every other file under `folder`); call it after everything else."""
    folder = Path(folder)
    manifest = {
        name: {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
        for name in sorted(_files_in(folder))
    }
    _write_json(folder / MANIFEST_NAME, {"files": manifest})


def checkpoint_problem(folder: str | Path, verify_checksums: bool = True) -> str | None:
    """
    Why a checkpoint folder cannot be resumed from, or `None` if it is complete.

    Complete means: its `manifest.json` is readable, lists exactly the files in the folder (no more, no fewer; each
    a regular file inside it: an absolute name, `..` or a link leading elsewhere is refused before anything is
    read), and each has the recorded size (and SHA-256, with `verify_checksums`). A folder without a manifest is
    not complete: its save never finished, or it was written before manifests existed and cannot be verified.

    Args:
        folder (`str` or `Path`): a `checkpoint-{step}` folder.
        verify_checksums (`bool`, *optional*, defaults to `True`): also compare checksums (reads every file).

    Returns:
        `str` or `None`: a short description of the first problem found (a missing or truncated file, ...).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return "not a folder"
    manifest_file = folder / MANIFEST_NAME
    if not manifest_file.is_file():
        return f"no {MANIFEST_NAME}"
    try:
        files = {
            name: (int(entry["size"]), str(entry["sha256"]))
            for name, entry in json.loads(manifest_file.read_text())["files"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"unreadable {MANIFEST_NAME} ({type(error).__name__}: {error})"
    on_disk, root = _files_in(folder), folder.resolve()
    for name, (expected_size, expected_sha256) in files.items():
        path = folder / name
        if name not in on_disk:  # `_files_in` names are plain relative paths: an absolute one or `..` is not
            is_plain = all(part not in ("", ".", "..") for part in name.split("/"))
            return f"{name} is missing" if is_plain else f"{name!r} in {MANIFEST_NAME} is not a file inside the folder"
        if not path.is_file() or not path.resolve().is_relative_to(root):  # a link leading elsewhere
            return f"{name!r} in {MANIFEST_NAME} is not a file inside the folder"
        size = path.stat().st_size
        if size != expected_size:
            return f"{name} has {size} bytes instead of {expected_size} (truncated or overwritten)"
        if verify_checksums and _sha256(path) != expected_sha256:
            return f"{name} does not match its checksum (corrupted)"
    unlisted = sorted(on_disk - files.keys())
    return f"{unlisted[0]} is not listed in {MANIFEST_NAME}" if unlisted else None


def find_latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    """
    The newest complete checkpoint folder (see `checkpoint_problem`), or `None` when there is no checkpoint at all.

    Newer checkpoints that are damaged are skipped with a warning naming the problem.

    Raises:
        `ValueError`: if there are checkpoints but none is complete (starting from scratch would silently lose them).
    """
    checkpoints_dir = Path(checkpoints_dir)
    problems = []
    for step in reversed(checkpoint_steps(checkpoints_dir)):
        folder = checkpoints_dir / f"checkpoint-{step}"
        problem = checkpoint_problem(folder)
        if problem is None:
            for damaged, why in problems:
                logger.warning(f"Skipping the damaged checkpoint {damaged} ({why}); resuming from {folder} instead.")
            return folder
        problems.append((folder, problem))
    if problems:
        listing = "; ".join(f"{folder.name}: {why}" for folder, why in problems)
        raise ValueError(
            f"--resume_from_checkpoint latest: no complete checkpoint in {checkpoints_dir} ({listing}). Resume "
            "from an intact copy (--resume_from_checkpoint <folder>), or move these folders away and leave out "
            "--resume_from_checkpoint to start from scratch."
        )
    return None


def resolve_resume_path(
    resume_from_checkpoint: str | None, checkpoints_dir: str | Path, overwrite: bool = False
) -> Path | None:
    """
    The checkpoint to resume from, after checking that the run may write into `checkpoints_dir`.

    `None` or `""` -> no resume; `"latest"` -> the newest complete checkpoint, falling back past damaged ones
    (`None`, with a warning, when `checkpoints_dir` holds no checkpoint yet, e.g. the first launch of a job that is
    always started with `latest`); else the given folder, which must be complete.

    A run that does not continue from a checkpoint of `checkpoints_dir` is a new run: the checkpoints there are
    another run's, which its saves would replace and its rotation delete, so they must not exist unless
    `overwrite` (the caller then removes them, see `resolve_resume_path_on_all_ranks`).

    Raises:
        `ValueError`: if the given folder is not a complete checkpoint, if `"latest"` finds checkpoints but none
        is complete, if a new run finds another run's checkpoints without `overwrite`, or if `overwrite` would
        remove the checkpoint to resume from.
    """
    checkpoints_dir = Path(checkpoints_dir)
    if overwrite and resume_from_checkpoint == "latest":
        raise ValueError(_overwrite_conflict(resume_from_checkpoint))
    path = None
    if resume_from_checkpoint == "latest":
        path = find_latest_checkpoint(checkpoints_dir)
        if path is None:
            logger.warning(
                f"--resume_from_checkpoint latest: no checkpoint in {checkpoints_dir} yet, starting at step 0."
            )
    elif resume_from_checkpoint:
        path = Path(resume_from_checkpoint)
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(
                f"--resume_from_checkpoint {resume_from_checkpoint!r} is not a complete checkpoint folder ({problem});"
                " pass 'latest' (the newest complete one) or another checkpoint-<step> folder."
            )
    if path is not None and path.resolve().parent == checkpoints_dir.resolve():  # continuing the run of this folder
        if overwrite:
            raise ValueError(_overwrite_conflict(resume_from_checkpoint))
        return path
    others = checkpoint_steps(checkpoints_dir)
    if others and not overwrite:
        names = ", ".join(f"checkpoint-{step}" for step in others)
        raise ValueError(
            f"{checkpoints_dir} holds the checkpoints of another run ({names}), which this run would replace and "
            "rotate away. Continue that run with --resume_from_checkpoint latest, start over with "
            "--overwrite_output_dir (removes them first), or choose another --output_dir."
        )
    return path


def _overwrite_conflict(resume_from_checkpoint: str) -> str:
    return (
        f"--overwrite_output_dir would remove the checkpoint that --resume_from_checkpoint {resume_from_checkpoint!r}"
        " resumes from: pass only --resume_from_checkpoint to continue that run, or only --overwrite_output_dir to "
        "start over."
    )


def clean_up_interrupted_saves(checkpoints_dir: str | Path) -> None:
    """What a save killed mid-way leaves: `.tmp-checkpoint-*` folders are removed, and an `.old-checkpoint-N` (a
    complete checkpoint set aside while `checkpoint-N` was re-saved) is put back if the new one never arrived, else
    removed. Call it on one process, before resolving the checkpoint to resume from."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return
    for path in checkpoints_dir.iterdir():
        if path.name.startswith(".tmp-checkpoint-"):
            logger.warning(f"Removing {path}: a checkpoint whose save was interrupted.")
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(".old-checkpoint-"):
            final = checkpoints_dir / path.name.removeprefix(".old-")
            if final.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                logger.warning(f"Restoring {final} from {path.name}: its re-save was interrupted.")
                os.replace(path, final)


def check_shared_folder(accelerator, folder: str | Path) -> None:
    """
    Checks that every process sees `folder` as the main process does. Every process writes its part of a checkpoint
    there (its RNG state and stream position; the main process also the weights, optimiser and manifest, and renames
    the folder once complete), and on resume every process reads the checkpoint the main process picked, so on
    several machines `folder` must be on a file system that all of them mount at the same path. The main process
    writes a file under a fresh random name; every process looks for it in its own `folder`.

    Raises:
        `ValueError`: on every process, naming the processes (and their hosts) that do not see the file.
    """
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import broadcast_object_list, gather_object

    folder = Path(folder)
    shared = [None, None, None]  # the main process's folder, host, and the file's name
    if accelerator.is_main_process:
        shared = [str(folder), socket.gethostname(), f".shared-folder-check-{uuid.uuid4().hex}"]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / shared[2]).touch()
    broadcast_object_list(shared, from_process=0)  # NOTE: also the barrier: the file exists before anyone looks
    seen = (folder / shared[2]).is_file()
    blind = gather_object([] if seen else [f"process {accelerator.process_index} on {socket.gethostname()}"])
    if accelerator.is_main_process:
        (folder / shared[2]).unlink()
    if blind:
        raise ValueError(
            f"The checkpoint folder {shared[0]} is not one folder shared by all processes: {', '.join(blind)} "
            f"cannot see the file that process 0 on {shared[1]} wrote there. Every process writes its part of each "
            "checkpoint into this folder and reads the checkpoint back from it on resume, so --output_dir must be "
            "on a file system that every machine mounts at the same path (NFS, Lustre, ...); see "
            "docs/training.md, 'Several machines'."
        )


def resolve_resume_path_on_all_ranks(
    accelerator, resume_from_checkpoint: str | None, checkpoints_dir, overwrite: bool = False
) -> Path | None:
    """`resolve_resume_path` on the main process only (after `check_shared_folder` on all of them, and
    `clean_up_interrupted_saves`), its answer broadcast to every process: all resume from the same checkpoint, and a
    `ValueError` is raised on every process. With
    `overwrite`, the main process removes another run's checkpoints before any process goes on."""
    from accelerate.utils import broadcast_object_list

    check_shared_folder(accelerator, checkpoints_dir)
    answer = [None, None]  # (path, error message)
    if accelerator.is_main_process:
        try:
            clean_up_interrupted_saves(checkpoints_dir)
            path = resolve_resume_path(resume_from_checkpoint, checkpoints_dir, overwrite)
            answer = [None if path is None else str(path), None]
        except ValueError as error:
            answer = [None, str(error)]
        if overwrite and answer[1] is None and (steps := checkpoint_steps(checkpoints_dir)):
            for step in steps:
                shutil.rmtree(Path(checkpoints_dir) / f"checkpoint-{step}")
            removed = ", ".join(f"checkpoint-{step}" for step in steps)
            logger.warning(f"--overwrite_output_dir: removed {removed} of an earlier run from {checkpoints_dir}.")
    # NOTE: the broadcast is also the barrier: no process goes on before the removal above is done.
    if accelerator.num_processes > 1:
        broadcast_object_list(answer, from_process=0)
    if answer[1] is not None:
        raise ValueError(answer[1])
    return None if answer[0] is None else Path(answer[0])


def save_checkpoint(
    accelerator,
    checkpoints_dir: str | Path,
    step: int,
    training_state: dict,
    process_state: dict,
    total_limit: int | None = None,
    check_finite: tuple = (),
) -> Path:
    """Saves model, optimiser, RNG and registered objects (Accelerate), plus JSON state and a manifest, atomically.

    Args:
        accelerator (`accelerate.Accelerator`): the run's accelerator (every process must call this).
        checkpoints_dir (`str` or `Path`): folder holding the `checkpoint-{step}` folders.
        step (`int`): the optimiser step just completed.
        training_state (`dict`): JSON-serialisable state shared by all processes (written by the main process).
        process_state (`dict`): JSON-serialisable state of this process (e.g. its position in its data stream).
        total_limit (`int`, *optional*): keep only this many newest complete checkpoints (older ones are deleted
            only once the new one is complete, and the new one never is); `0` or `None` keeps every checkpoint.
        check_finite (`tuple` of modules and optimisers, *optional*): refuse to save if any of their parameters,
            buffers or optimiser states holds a NaN or an infinity (on any process).

    Raises:
        `ValueError`: if `total_limit` is negative.
        `RuntimeError`: if `check_finite` finds a non-finite value (nothing is written), or if writing fails (e.g.
        the disk is full: the temporary folder is removed, the previous checkpoints are untouched).
    """
    if total_limit is not None and total_limit < 0:  # on every process, before any collective
        raise ValueError(
            f"total_limit={total_limit}: the number of checkpoints to keep cannot be negative; 0 or None keeps every "
            "checkpoint."
        )
    checkpoints_dir = Path(checkpoints_dir)
    final = checkpoints_dir / f"checkpoint-{step}"
    temporary = checkpoints_dir / f".tmp-checkpoint-{step}"
    bad = nonfinite_tensor_names(*check_finite) if check_finite else []
    if any_process(accelerator, bool(bad))[0]:
        where = f": {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}" if bad else " on another process"
        raise RuntimeError(
            f"Refusing to save checkpoint-{step}: non-finite values (NaN or inf) in the weights or optimiser state"
            f"{where}. The previous checkpoints are untouched; resume from the newest one (--resume_from_checkpoint "
            "latest), with a lower --learning_rate or a --max_grad_norm."
        )
    error = None
    try:
        if accelerator.is_main_process:
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir(parents=True)
        accelerator.wait_for_everyone()
        with _accelerate_warnings_only():
            accelerator.save_state(str(temporary))
        _write_json(temporary / process_state_name(accelerator.process_index), process_state)
        if accelerator.is_main_process:
            _write_json(temporary / TRAINING_STATE_NAME, training_state)
    # NOTE: any exception, not only OSError: safetensors and torch.save report a full disk as their own errors. Every
    # process reaches the agreement below, so none waits forever for one that failed.
    except Exception as caught:
        error = caught
    failed = any_process(accelerator, error is not None)[0]
    if not failed and accelerator.is_main_process:
        try:
            write_manifest(temporary)  # NOTE: last, once every process has written its files
        except Exception as caught:
            error = caught
    failed = any_process(accelerator, error is not None)[0]
    if failed:
        if accelerator.is_main_process:
            shutil.rmtree(temporary, ignore_errors=True)
        previous = [s for s in checkpoint_steps(checkpoints_dir) if s != step]
        kept = f"checkpoint-{previous[-1]} and older are" if previous else "no earlier checkpoint was"
        cause = f"{type(error).__name__}: {error}" if error is not None else "writing failed on another process"
        disk_full = error is not None and (
            getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
            or any(text in str(error) for text in _DISK_FULL_TEXTS)
        )
        raise RuntimeError(
            f"Could not save checkpoint-{step} in {checkpoints_dir} ({cause})"
            f"{': the disk is full' if disk_full else ''}. The partial folder was removed and {kept} untouched. "
            "Free space there (or lower --checkpoints_total_limit), then resume with --resume_from_checkpoint latest."
        ) from error
    if accelerator.is_main_process:
        set_aside = checkpoints_dir / f".old-checkpoint-{step}"
        if final.exists():  # re-saving the same step after a resume: the old copy is set aside, not deleted first
            shutil.rmtree(set_aside, ignore_errors=True)
            os.replace(final, set_aside)
        os.replace(temporary, final)
        shutil.rmtree(set_aside, ignore_errors=True)
        if total_limit:
            _rotate(checkpoints_dir, total_limit, step)
        logger.info(f"Saved checkpoint {final}")
    accelerator.wait_for_everyone()
    return final


def _rotate(checkpoints_dir: Path, total_limit: int, saved_step: int) -> None:
    """Delete every checkpoint older than the newest `total_limit` complete ones (sizes checked, not checksums),
    never `saved_step`, the one just written."""
    complete = [
        s
        for s in checkpoint_steps(checkpoints_dir)
        if checkpoint_problem(checkpoints_dir / f"checkpoint-{s}", verify_checksums=False) is None
    ]
    if len(complete) <= total_limit:
        return
    oldest_kept = complete[-total_limit]
    for old_step in checkpoint_steps(checkpoints_dir):
        if old_step < oldest_kept and old_step != saved_step:
            shutil.rmtree(checkpoints_dir / f"checkpoint-{old_step}", ignore_errors=True)


# Files torch.save writes (Accelerate: optimizer.bin, random_states_*.pkl; DeepSpeed: *.pt).
TORCH_FILE_SUFFIXES = (".bin", ".pkl", ".pt", ".pth")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that cannot be loaded as plain data (it would need a full unpickle, or is not what its name
    says)."""


def _refuse(path: Path, why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"Refusing to resume from {path.parent}: {path.name} {why}. A checkpoint holds only tensors, plain numbers "
        "and JSON, so this file was replaced or written by other code. Resume only from checkpoints you (or someone "
        "you trust) wrote; see docs/training.md, 'What is loaded safely'."
    )


def check_loads_as_data(folder: str | Path, safe_globals: list | None = None) -> None:
    """
    Checks that every file of a checkpoint folder loads as data, without running code from it: JSON files parse,
    safetensors headers parse, and every torch file (`.bin`, `.pkl`, `.pt`, `.pth`) loads with
    `torch.load(weights_only=True)` (memory-mapped where possible, so only its pickle is read).

    Args:
        folder (`str` or `Path`): a checkpoint folder.
        safe_globals (`list`, *optional*): classes allowed in torch files beyond tensors and plain containers
            (Accelerate's NumPy RNG state types are always allowed).

    Raises:
        `UnsafeCheckpointError` (a `ValueError`): naming the first file that does not load as data.
    """
    from accelerate.utils.other import TORCH_SAFE_GLOBALS
    from safetensors import safe_open

    allowed = [*TORCH_SAFE_GLOBALS, *(safe_globals or [])]
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        if path.suffix == ".json":
            try:
                json.loads(path.read_text())
            except (UnicodeDecodeError, ValueError) as error:
                raise _refuse(path, f"is not JSON ({type(error).__name__})") from None
        elif path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt"):
                    pass
            except Exception as error:  # safetensors' SafetensorError
                raise _refuse(path, f"is not a safetensors file ({error})") from None
        elif path.suffix in TORCH_FILE_SUFFIXES:
            with torch.serialization.safe_globals(allowed):
                try:
                    try:
                        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                    except RuntimeError as error:  # not a zip file (legacy format): mmap is impossible
                        if "zip" not in str(error).lower() and "mmap" not in str(error).lower():
                            raise
                        torch.load(path, map_location="cpu", weights_only=True)
                except pickle.UnpicklingError as error:
                    reason = str(error).strip().splitlines()
                    detail = next((line for line in reason if "GLOBAL" in line or "Unsupported" in line), reason[0])
                    raise _refuse(path, f"would run code to load: torch.load(weights_only=True) refuses it "
                                        f"({detail.strip()})") from None  # fmt: skip
                except Exception as error:
                    raise _refuse(path, f"is not a torch file ({type(error).__name__}: {error})") from None


def deepspeed_safe_globals() -> list:
    """The plain data classes DeepSpeed's ZeRO-2/3 optimiser states pickle (an int enum, the loss scaler's two numbers,
    a fragment's offset and size): allowed in `torch.load(weights_only=True)`, which refuses anything else."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


@contextlib.contextmanager
def _weights_only_loading(safe_globals: list) -> Iterator[None]:
    """Every `torch.load` inside loads with `weights_only=True`, also where a library asks for a full unpickle
    (DeepSpeed's checkpoint engine, Accelerate's custom objects): `TORCH_FORCE_WEIGHTS_ONLY_LOAD` for the duration."""
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(safe_globals):
            yield
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


def load_checkpoint(accelerator, path: str | Path) -> tuple[dict, dict]:
    """Restores what `save_checkpoint` wrote, after `check_loads_as_data`, with every `torch.load` forced to
    `weights_only=True` (DeepSpeed's engine included); returns `(training_state, this process's state)`."""
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    path = Path(path)
    safe_globals = deepspeed_safe_globals() if accelerator.state.deepspeed_plugin is not None else []
    check_loads_as_data(path, safe_globals)
    training_state = json.loads((path / TRAINING_STATE_NAME).read_text())
    saved_processes = training_state.get("num_processes")
    if saved_processes is not None and saved_processes != accelerator.num_processes:
        # NOTE: raised on every process before any collective, so no rank waits for another that stopped.
        raise ValueError(
            f"{path} was written by a run with {saved_processes} processes; this run has "
            f"{accelerator.num_processes}. Each process's position in its share of the data is part of the "
            f"checkpoint, so resume with {saved_processes} processes (accelerate launch --num_processes "
            f"{saved_processes}), or start a new run without --resume_from_checkpoint."
        )
    process_file = path / process_state_name(accelerator.process_index)
    if not process_file.is_file():
        raise ValueError(
            f"{path} has no state for process {accelerator.process_index}: it was written by a run with fewer "
            "processes. Resume with the same number of processes."
        )
    with _accelerate_warnings_only(), _weights_only_loading([*TORCH_SAFE_GLOBALS, *safe_globals]):
        accelerator.load_state(str(path))
    return training_state, json.loads(process_file.read_text())


def _write_json(path: Path, data: dict) -> None:
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(temporary, path)


__all__ = [
    "UnsafeCheckpointError",
    "check_loads_as_data",
    "check_shared_folder",
    "checkpoint_problem",
    "clean_up_interrupted_saves",
    "deepspeed_safe_globals",
    "find_latest_checkpoint",
    "load_checkpoint",
    "resolve_resume_path",
    "resolve_resume_path_on_all_ranks",
    "save_checkpoint",
    "write_manifest",
]
