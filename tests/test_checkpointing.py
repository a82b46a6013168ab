"""Checkpoints that survive faults (`veca_hf.training.checkpointing`), each fault injected: a damaged latest
checkpoint, a full disk while saving, non-finite state, a save killed mid-way, a file replaced by code-running pickle,
another process count. A real single-process `Accelerator` on a tiny linear model.
"""

import errno
import hashlib
import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import accelerate.checkpointing
import pytest
import torch
from conftest import prepared_linear

from veca_hf.training import checkpointing
from veca_hf.training.checkpointing import (
    MANIFEST_NAME,
    UnsafeCheckpointError,
    checkpoint_problem,
    clean_up_interrupted_saves,
    find_latest_checkpoint,
    load_checkpoint,
    resolve_resume_path,
    resolve_resume_path_on_all_ranks,
    save_checkpoint,
    write_manifest,
)


def _train_step(accelerator, model, optimizer):
    accelerator.backward(model(torch.randn(2, 4)).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def _save(accelerator, directory, step, **kwargs):
    return save_checkpoint(
        accelerator, directory, step, training_state={"step": step}, process_state={"batches": step}, **kwargs
    )


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints: manifest, damaged latest, disk full, non-finite state
# ----------------------------------------------------------------------------------------------------------------


def test_checkpoint_has_a_manifest_and_round_trips(accelerator, tmp_path):
    model, optimizer = prepared_linear(accelerator)
    _train_step(accelerator, model, optimizer)
    path = _save(accelerator, tmp_path, 2)
    manifest = json.loads((path / MANIFEST_NAME).read_text())["files"]
    assert {"model.safetensors", "optimizer.bin", "training_state.json", "process_state_0.json"} <= set(manifest)
    assert checkpoint_problem(path) is None
    saved = model.weight.detach().clone()
    _train_step(accelerator, model, optimizer)
    training_state, process_state = load_checkpoint(accelerator, path)
    assert torch.equal(model.weight, saved) and training_state == {"step": 2} and process_state == {"batches": 2}


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip"])
def test_latest_falls_back_past_a_damaged_checkpoint(accelerator, tmp_path, damage, caplog):
    model, optimizer = prepared_linear(accelerator)
    for step in (2, 4):
        _train_step(accelerator, model, optimizer)
        _save(accelerator, tmp_path, step)
    target = tmp_path / "checkpoint-4" / ("optimizer.bin" if damage == "delete" else "model.safetensors")
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        target.unlink()
    else:
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    expected = {"truncate": "truncated", "delete": "optimizer.bin is missing", "flip": "checksum"}[damage]
    assert expected in checkpoint_problem(tmp_path / "checkpoint-4")
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_path("latest", tmp_path) == tmp_path / "checkpoint-2"
    assert "Skipping the damaged checkpoint" in caplog.text and "checkpoint-4" in caplog.text
    # Named explicitly, the damaged one is refused.
    with pytest.raises(ValueError, match="not a complete checkpoint folder"):
        resolve_resume_path(str(tmp_path / "checkpoint-4"), tmp_path)


def test_latest_with_no_complete_checkpoint_is_an_error_not_a_fresh_start(accelerator, tmp_path):
    model, optimizer = prepared_linear(accelerator)
    _save(accelerator, tmp_path, 2)
    (tmp_path / "checkpoint-2" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no complete checkpoint in .*checkpoint-2: model.safetensors is missing"):
        resolve_resume_path("latest", tmp_path)
    with pytest.raises(ValueError, match="holds the checkpoints of another run"):  # nor a fresh start over them
        resolve_resume_path(None, tmp_path)
    assert resolve_resume_path(None, tmp_path, overwrite=True) is None  # unless asked for
    assert find_latest_checkpoint(tmp_path / "nothing-yet") is None  # the first launch of an always-`latest` job


def test_disk_full_while_saving_keeps_the_previous_checkpoint(accelerator, tmp_path, monkeypatch):
    model, optimizer = prepared_linear(accelerator)
    _save(accelerator, tmp_path, 2, total_limit=1)
    real_save = accelerate.checkpointing.save

    def save_until_the_disk_is_full(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.bin"):  # the model file was written; the optimiser's runs out of space
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(accelerate.checkpointing, "save", save_until_the_disk_is_full)
    _train_step(accelerator, model, optimizer)
    with pytest.raises(RuntimeError, match="Could not save checkpoint-4") as error:
        _save(accelerator, tmp_path, 4, total_limit=1)
    message = str(error.value)
    assert "the disk is full" in message and "checkpoint-2 and older are untouched" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]  # no temporary folder, no rotation
    assert checkpoint_problem(tmp_path / "checkpoint-2") is None


def test_rotation_keeps_complete_checkpoints(accelerator, tmp_path):
    model, optimizer = prepared_linear(accelerator)
    for step in (2, 4, 6):
        _save(accelerator, tmp_path, step, total_limit=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    (tmp_path / "checkpoint-6" / "optimizer.bin").unlink()  # damaged: does not count towards the limit
    _save(accelerator, tmp_path, 8, total_limit=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]


@pytest.mark.parametrize("where", ["weights", "optimizer"])
def test_non_finite_state_is_never_saved(accelerator, tmp_path, where):
    model, optimizer = prepared_linear(accelerator)
    _train_step(accelerator, model, optimizer)
    with torch.no_grad():
        if where == "weights":
            model.bias[1] = float("nan")
        else:
            next(iter(optimizer.state.values()))["exp_avg_sq"].view(-1)[0] = float("inf")
    with pytest.raises(RuntimeError, match="Refusing to save checkpoint-2: non-finite") as error:
        _save(accelerator, tmp_path, 2, check_finite=(model, optimizer))
    assert ("bias" if where == "weights" else "'exp_avg_sq' of weight") in str(error.value)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------------------------------
# Trust: a checkpoint never runs code; another process count; interrupted re-saves
# ----------------------------------------------------------------------------------------------------------------


class _RunsCode:
    """Unpickling this runs code: it creates the file `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _plant(path: Path, marker: Path) -> None:
    """Replace `path` by a code-running pickle in the format its name suggests (torch's zip for torch files)."""
    if path.suffix in (".bin", ".pkl", ".pt", ".pth"):
        torch.save({"state": _RunsCode(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(_RunsCode(marker)))
    write_manifest(path.parent)  # the manifest proves a checkpoint is whole, not who wrote it


@pytest.mark.parametrize(
    "name",
    ["model.safetensors", "optimizer.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl", "training_state.json",
     "process_state_0.json", "manifest.json"],
)  # fmt: skip
def test_a_code_running_pickle_in_any_checkpoint_file_never_runs(accelerator, tmp_path, name):
    model, optimizer = prepared_linear(accelerator)
    _train_step(accelerator, model, optimizer)
    path = _save(accelerator, tmp_path, 2)
    assert "random_states_0.pkl" in os.listdir(path) and "custom_checkpoint_0.pkl" not in os.listdir(path)
    marker = tmp_path / "code-ran"
    planted = path / name
    _plant(planted, marker)
    if name == "manifest.json":
        planted.write_bytes(pickle.dumps(_RunsCode(marker)))  # not rewritten by itself: the checkpoint is damaged
        with pytest.raises(ValueError, match="no complete checkpoint.*unreadable manifest.json"):
            resolve_resume_path("latest", tmp_path)
    else:
        resumed = resolve_resume_path("latest", tmp_path)
        with pytest.raises(UnsafeCheckpointError, match=f"Refusing to resume from {path}: {name} ") as error:
            load_checkpoint(accelerator, resumed)
        assert "you trust" in str(error.value)
    assert not marker.exists()


def test_resuming_with_another_process_count_is_a_clear_error(accelerator, tmp_path):
    model, optimizer = prepared_linear(accelerator)
    path = save_checkpoint(accelerator, tmp_path, 2, training_state={"step": 2, "num_processes": 2},
                           process_state={"batches": 2})  # fmt: skip
    saved = model.weight.detach().clone()
    _train_step(accelerator, model, optimizer)
    with pytest.raises(ValueError, match="written by a run with 2 processes; this run has 1.*--num_processes 2"):
        load_checkpoint(accelerator, path)
    assert not torch.equal(model.weight, saved)  # refused before anything was restored


def test_an_interrupted_re_save_keeps_the_old_copy_and_leftovers_are_cleaned(accelerator, tmp_path, monkeypatch):
    model, optimizer = prepared_linear(accelerator)
    first = _save(accelerator, tmp_path, 2)
    weights = (first / "model.safetensors").read_bytes()
    _train_step(accelerator, model, optimizer)
    real_replace, calls = os.replace, []

    def killed_after_setting_aside(source, target):  # the process dies between the two renames
        calls.append(Path(target).name)
        if Path(target).name == "checkpoint-2":
            raise KeyboardInterrupt
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", killed_after_setting_aside)
    with pytest.raises(KeyboardInterrupt):
        _save(accelerator, tmp_path, 2)
    monkeypatch.setattr(os, "replace", real_replace)
    assert ".old-checkpoint-2" in calls and not first.exists()  # never deleted before the new copy was in place
    clean_up_interrupted_saves(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"] and checkpoint_problem(first) is None
    assert (first / "model.safetensors").read_bytes() == weights  # the old copy is back
    # a re-save that completes replaces it; a temporary folder left by a killed save is removed at the next start
    _save(accelerator, tmp_path, 2)
    assert (first / "model.safetensors").read_bytes() != weights and checkpoint_problem(first) is None
    shutil.copytree(first, tmp_path / ".tmp-checkpoint-3")
    assert resolve_resume_path_on_all_ranks(accelerator, "latest", tmp_path) == first
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]


# ----------------------------------------------------------------------------------------------------------------
# What counts as complete: the manifest lists exactly the folder's files
# ----------------------------------------------------------------------------------------------------------------


def test_a_folder_without_a_manifest_is_incomplete_and_latest_falls_back(accelerator, tmp_path, caplog):
    model, optimizer = prepared_linear(accelerator)
    for step in (2, 4):
        _train_step(accelerator, model, optimizer)
        _save(accelerator, tmp_path, step)
    # what a save killed before its manifest, or a partial copy, leaves: the state file, a truncated optimiser
    (tmp_path / "checkpoint-4" / MANIFEST_NAME).unlink()
    optimizer_file = tmp_path / "checkpoint-4" / "optimizer.bin"
    optimizer_file.write_bytes(optimizer_file.read_bytes()[:10])
    assert checkpoint_problem(tmp_path / "checkpoint-4") == f"no {MANIFEST_NAME}"
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_path("latest", tmp_path) == tmp_path / "checkpoint-2"
    assert f"Skipping the damaged checkpoint {tmp_path / 'checkpoint-4'} (no {MANIFEST_NAME})" in caplog.text


def _rewrite_manifest(folder: Path, change) -> None:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    change(manifest["files"])
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


def _entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


@pytest.mark.parametrize("case", ["empty", "extra file", "relative outside", "absolute", "symlink outside"])
def test_the_manifest_must_list_exactly_the_files_inside_the_folder(accelerator, tmp_path, monkeypatch, case):
    model, optimizer = prepared_linear(accelerator)
    path = _save(accelerator, tmp_path / "checkpoints", 2)
    outside = tmp_path / "outside.txt"  # stands for /etc/hostname: a file the check must never open
    outside.write_text("not part of any checkpoint")
    if case == "empty":
        _rewrite_manifest(path, dict.clear)
        expected = "model.safetensors is not listed in manifest.json"
    elif case == "extra file":
        (path / "extra.bin").write_bytes(b"planted")
        expected = "extra.bin is not listed in manifest.json"
    elif case == "relative outside":
        _rewrite_manifest(path, lambda files: files.update({"../../outside.txt": _entry(outside)}))
        expected = "'../../outside.txt' in manifest.json is not a file inside the folder"
    elif case == "absolute":
        _rewrite_manifest(path, lambda files: files.update({str(outside): _entry(outside)}))
        expected = f"{str(outside)!r} in manifest.json is not a file inside the folder"
    else:
        (path / "linked.bin").symlink_to(outside)
        write_manifest(path)
        expected = "'linked.bin' in manifest.json is not a file inside the folder"
    hashed = []
    real_sha256 = checkpointing._sha256
    monkeypatch.setattr(
        checkpointing, "_sha256", lambda file: hashed.append(Path(file).resolve()) or real_sha256(file)
    )
    assert checkpoint_problem(path) == expected
    assert outside.resolve() not in hashed
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resolve_resume_path("latest", tmp_path / "checkpoints")


# ----------------------------------------------------------------------------------------------------------------
# A fresh run never deletes another run's checkpoints
# ----------------------------------------------------------------------------------------------------------------


def _another_runs_checkpoints(accelerator, directory: Path) -> None:
    prepared_linear(accelerator)
    for step in (1000, 1500):
        _save(accelerator, directory, step, total_limit=2)


def test_a_fresh_run_refuses_a_folder_holding_another_runs_checkpoints(accelerator, tmp_path):
    _another_runs_checkpoints(accelerator, tmp_path)
    with pytest.raises(ValueError, match=r"holds the checkpoints of another run \(checkpoint-1000, checkpoint-1500\)"
                                         r".*--resume_from_checkpoint latest.*--overwrite_output_dir"):  # fmt: skip
        resolve_resume_path_on_all_ranks(accelerator, None, tmp_path)
    # resuming from a checkpoint outside the folder makes a new run there too
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "checkpoint-1000", elsewhere / "checkpoint-1000")
    with pytest.raises(ValueError, match="holds the checkpoints of another run"):
        resolve_resume_path_on_all_ranks(accelerator, str(elsewhere / "checkpoint-1000"), tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1000", "checkpoint-1500", "elsewhere"]
    # continuing that run is what the folder is for
    assert resolve_resume_path_on_all_ranks(accelerator, "latest", tmp_path) == tmp_path / "checkpoint-1500"
    assert resolve_resume_path_on_all_ranks(accelerator, str(tmp_path / "checkpoint-1000"), tmp_path) == (
        tmp_path / "checkpoint-1000"
    )


def test_overwrite_removes_another_runs_checkpoints_but_never_the_one_resumed_from(accelerator, tmp_path, caplog):
    _another_runs_checkpoints(accelerator, tmp_path)
    for resume_from_checkpoint in ("latest", str(tmp_path / "checkpoint-1000")):
        with pytest.raises(ValueError, match="--overwrite_output_dir would remove the checkpoint"):
            resolve_resume_path_on_all_ranks(accelerator, resume_from_checkpoint, tmp_path, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1000", "checkpoint-1500"]
    with caplog.at_level(logging.WARNING):
        assert resolve_resume_path_on_all_ranks(accelerator, None, tmp_path, overwrite=True) is None
    assert os.listdir(tmp_path) == []
    assert "--overwrite_output_dir: removed checkpoint-1000, checkpoint-1500" in caplog.text


def test_rotation_never_deletes_the_checkpoint_it_just_saved(accelerator, tmp_path):
    _another_runs_checkpoints(accelerator, tmp_path)
    path = _save(accelerator, tmp_path, 500, total_limit=2)
    assert path.is_dir() and checkpoint_problem(path) is None


def test_a_negative_total_limit_is_refused_before_anything_is_written(accelerator, tmp_path):
    prepared_linear(accelerator)
    with pytest.raises(ValueError, match=r"total_limit=-1: .*0 or None keeps every checkpoint"):
        _save(accelerator, tmp_path, 2, total_limit=-1)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
