"""examples/distill.py end to end: single process, two processes, corrupt images, kill-and-resume, SIGTERM."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import warm_python
from conftest import tiny_config, tiny_dinov3_config
from huggingface_hub import ModelCard
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModel, Dinov2Config, Dinov2Model, DINOv3ViTModel, ViTConfig

from veca_hf import VecaConfig, VecaModel
from veca_hf.cpu.hardware import cpu_bf16_support
from veca_hf.training.distillation import full_attention_student_config


ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "examples" / "distill.py"
# distill.py with faults injected by patching (VECA_HF_TEST_NAN_TEACHER_STEPS, VECA_HF_TEST_PAUSE_AFTER_STEP)
FAULTS_SCRIPT = Path(__file__).parent / "distill_with_faults.py"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny teacher, a tiny student config, and an image folder of 24 distinct images plus one corrupt file."""
    root = tmp_path_factory.mktemp("distill")
    torch.manual_seed(0)
    DINOv3ViTModel(tiny_dinov3_config()).save_pretrained(root / "teacher")
    tiny_config().save_pretrained(root / "student")
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for index in range(24):
        array = rng.integers(0, 256, (72 + index % 5 * 8, 80, 3), dtype=np.uint8)
        Image.fromarray(array).save(images / f"img_{index:02d}.jpg")
    (images / "zz_corrupt.jpg").write_bytes(b"not a jpeg at all" * 10)  # sorts last: lands in the training stream
    return root


def distill_args(workspace: Path, output_dir: Path, **overrides) -> list[str]:
    values = {
        "teacher_name_or_path": workspace / "teacher",
        "student_config": workspace / "student",
        "dataset_name": workspace / "images",
        "output_dir": output_dir,
        "resolution": 32,
        "validation_size": 4,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "max_train_steps": 4,
        "warmup_steps": 1,
        "learning_rate": 1e-3,
        "min_learning_rate": 1e-4,
        "budgets": "8,16",
        "budget_weights": "1,1",
        "checkpointing_steps": 2,
        "validation_steps": 2,
        "dataloader_num_workers": 0,
        "shuffle_buffer_size": 8,
        "seed": 0,
    }
    values.update(overrides)
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def run_env() -> dict:
    # One thread per process: the runs compared for bit-exactness must use identical kernels.
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run_distill(
    args: list[str], launcher: list[str] | None = None, timeout: int = 300, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    script = FAULTS_SCRIPT if any(name.startswith("VECA_HF_TEST_") for name in env or {}) else SCRIPT
    command = (launcher or [sys.executable]) + [str(script)] + args
    env = {**run_env(), "ACCELERATE_USE_CPU": "true", **(env or {})}
    runner = subprocess.run if launcher else warm_python.run  # the launcher's workers start as fresh interpreters
    result = runner(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def two_cpu_processes(port: int) -> list[str]:
    """`accelerate launch` of 2 gloo processes on CPU (with ACCELERATE_USE_CPU=true, which `run_distill` sets).

    NOTE: `accelerate launch --cpu --num_processes 2` needs MPI (mpirun); the torchrun launcher behind `--multi_gpu`
    does not."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(port)]  # fmt: skip


def first_log_line(result: subprocess.CompletedProcess) -> str:
    return next(line for line in result.stderr.splitlines() if " __main__: " in line)


@pytest.mark.processes
def test_single_process_run_trains_validates_checkpoints_and_saves(workspace, tmp_path):
    output_dir = tmp_path / "run"
    # 6 steps x 4 images > the 21 training files: the whole first epoch, corrupt file included, is read.
    result = run_distill(
        distill_args(workspace, output_dir, log_sample_sources="true", max_train_steps=6, checkpointing_steps=3)
    )
    # what the run did: held-out loss and cosines to the teacher at initialisation and after the last step
    assert "Held-out images (4 at 32 px), before the first step -> after step 6:" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("| 8 |"))
    assert row.count(" -> ") == 3 and "| 16 |" in result.stdout and "Next: probe it" in result.stdout
    # one log line per checkpoint (Accelerate's own five are kept below WARNING)
    assert result.stderr.count("Saved checkpoint") == 2 and "Random states saved" not in result.stderr
    summary = json.loads((output_dir / "distill_results.json").read_text())
    assert summary["step"] == 6
    assert summary["skipped_images"] >= 1  # the corrupt file was skipped, counted, and the run went on
    assert set(summary["validation"]) == {"8", "16"}
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == ["checkpoint-3", "checkpoint-6"]
    model = AutoModel.from_pretrained(output_dir)
    assert isinstance(model, VecaModel)
    assert model(torch.randn(1, 3, 32, 32), num_core_tokens=8).last_hidden_state.shape == (1, 8 + 4, 64)
    sources = (output_dir / "sample_sources" / "rank0.txt").read_text().splitlines()
    assert len(sources) >= 6 * 4 - 1 and not any("corrupt" in line for line in sources)
    # The folder is publishable: a model card whose metadata parses back, with the held-out loss per budget.
    card = ModelCard.load(output_dir / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "image-feature-extraction"
    assert "| 8 |" in card.text and "| 16 |" in card.text and "| base model | a local folder |" in card.text
    assert str(workspace) not in card.text  # a public card names no path of this machine


@pytest.mark.processes
def test_two_processes_stream_disjoint_data_skip_a_non_finite_step_together_and_save(workspace, tmp_path):
    """Also a fault: the teacher's output is NaN on rank 1 at step 1 (a test hook); both ranks skip that update."""
    output_dir = tmp_path / "ddp"
    launcher = two_cpu_processes(29533)
    # 2 ranks x 2 steps x 4 images = 16 <= the 20 training images: within one epoch nothing may repeat.
    result = run_distill(
        distill_args(workspace, output_dir, max_train_steps=2, log_sample_sources="true"),
        launcher=launcher,
        env={"VECA_HF_TEST_NAN_TEACHER_STEPS": "1:1"},
    )
    assert "Step 1: non-finite loss or gradients (NaN or inf) on at least one process: step skipped" in result.stderr
    assert json.loads((output_dir / "distill_results.json").read_text())["nonfinite_steps"] == 1
    assert all(torch.isfinite(value).all() for value in load_file(output_dir / "model.safetensors").values())
    seen = [
        [line.split("\t")[1] for line in (output_dir / "sample_sources" / f"rank{rank}.txt").read_text().splitlines()]
        for rank in range(2)
    ]
    assert all(len(part) >= 7 for part in seen)
    assert set(seen[0]).isdisjoint(seen[1])
    assert len(set(seen[0])) == len(seen[0]) and len(set(seen[1])) == len(seen[1])
    checkpoint = output_dir / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "process_state_0.json").is_file() and (checkpoint / "process_state_1.json").is_file()
    assert json.loads((checkpoint / "training_state.json").read_text())["num_processes"] == 2
    assert isinstance(AutoModel.from_pretrained(output_dir), VecaModel)


INTERRUPTED_RUN = {
    "max_train_steps": 8,
    "checkpointing_steps": 2,
    "validation_steps": 100,
    "dataloader_num_workers": 2,
}


@pytest.fixture(scope="module")
def uninterrupted_run(workspace, tmp_path_factory) -> Path:
    """The reference for the interrupted-and-resumed runs."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    run_distill(distill_args(workspace, output_dir, **INTERRUPTED_RUN))
    return output_dir


def assert_same_final_weights(reference_dir: Path, resumed_dir: Path) -> None:
    reference, resumed = load_file(reference_dir / "model.safetensors"), load_file(resumed_dir / "model.safetensors")
    assert reference.keys() == resumed.keys()
    for key in reference:
        assert torch.equal(reference[key], resumed[key]), key
    assert json.loads((resumed_dir / "distill_results.json").read_text())["step"] == INTERRUPTED_RUN["max_train_steps"]
    assert not list((resumed_dir / "checkpoints").glob(".tmp-*"))


@pytest.mark.processes
def test_a_rank_dies_and_the_elastic_launcher_restarts_the_group_which_resumes_exactly(workspace, tmp_path):
    """`accelerate launch --max_restarts 1`: rank 1 is SIGKILLed once checkpoint-2 is complete; torchrun restarts
    both processes, they form a new group (`join_restarted_group`), resume from checkpoint-2 and end with the weights
    of an uninterrupted 2-process run."""
    run = {**INTERRUPTED_RUN, "dataloader_num_workers": 0, "resume_from_checkpoint": "latest"}
    run_distill(distill_args(workspace, tmp_path / "clean", **run), launcher=two_cpu_processes(29536))
    result = run_distill(
        distill_args(workspace, tmp_path / "restarted", **run),
        launcher=two_cpu_processes(29537) + ["--max_restarts", "1"],
        env={"VECA_HF_TEST_KILL_AFTER_STEP": "2:1"},
    )
    assert "Rank 1 dies after step 2." in result.stderr
    assert "Restart 1 of an elastic launch: rank 1 of 2 joined its new group." in result.stderr
    assert "Resumed from " + str(tmp_path / "restarted" / "checkpoints" / "checkpoint-2") in result.stderr
    assert_same_final_weights(tmp_path / "clean", tmp_path / "restarted")


def start_when_checkpoint_2_exists(command: list[str], output_dir: Path, **popen_kwargs) -> subprocess.Popen:
    """Starts the run (`command` runs FAULTS_SCRIPT); it waits after step 2 until it is signalled, so the test decides
    when it stops."""
    env = {**run_env(), "VECA_HF_TEST_PAUSE_AFTER_STEP": "2"}
    process = subprocess.Popen(command, env=env, cwd=ROOT, **popen_kwargs)
    deadline = time.time() + 240
    while not (output_dir / "checkpoints" / "checkpoint-2").is_dir():
        assert process.poll() is None, "the run ended before it could be interrupted"
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    return process


@pytest.mark.processes
def test_killed_run_resumes_to_the_same_weights(workspace, tmp_path, uninterrupted_run):
    steps, resumed_dir = INTERRUPTED_RUN, tmp_path / "killed"

    # Start the same run, SIGKILL it once checkpoint-2 is complete, then resume from "latest".
    command = [sys.executable, str(FAULTS_SCRIPT)] + distill_args(workspace, resumed_dir, **steps)
    process = start_when_checkpoint_2_exists(
        command, resumed_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (resumed_dir / "model.safetensors").exists()  # it really died before finishing
    run_distill(distill_args(workspace, resumed_dir, resume_from_checkpoint="latest", **steps))
    assert_same_final_weights(uninterrupted_run, resumed_dir)


@pytest.mark.processes
def test_sigterm_writes_a_checkpoint_exits_143_and_resumes_to_the_same_weights(workspace, tmp_path, uninterrupted_run):
    """Preemption as SLURM does it: SIGTERM to the whole process group (the DataLoader workers too)."""
    resumed_dir = tmp_path / "preempted"
    command = [sys.executable, str(FAULTS_SCRIPT)] + distill_args(workspace, resumed_dir, **INTERRUPTED_RUN)
    process = start_when_checkpoint_2_exists(
        command, resumed_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    os.killpg(process.pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=240)
    assert process.returncode == 143, stderr[-6000:]
    stopped_at = int(stderr.split("Stopped by SIGTERM after step ")[1].split(";")[0])
    assert 2 <= stopped_at < INTERRUPTED_RUN["max_train_steps"], stderr[-3000:]
    assert (resumed_dir / "checkpoints" / f"checkpoint-{stopped_at}" / "manifest.json").is_file()
    assert not (resumed_dir / "model.safetensors").exists()  # stopped, not finished
    assert "Traceback" not in stderr
    run_distill(distill_args(workspace, resumed_dir, resume_from_checkpoint="latest", **INTERRUPTED_RUN))
    assert_same_final_weights(uninterrupted_run, resumed_dir)


@pytest.mark.processes
def test_resume_never_runs_code_planted_in_a_checkpoint(workspace, tmp_path):
    """The audit's reproduction: a pickle whose unpickling runs code, written as the scheduler's
    `custom_checkpoint_0.pkl` with the manifest rewritten, is refused by name and its code never runs; the schedule
    itself is JSON in training_state.json."""
    import pickle

    from veca_hf.training.checkpointing import write_manifest

    output_dir = tmp_path / "planted"
    run_distill(distill_args(workspace, output_dir, max_train_steps=2))
    checkpoint = output_dir / "checkpoints" / "checkpoint-2"
    assert not list(checkpoint.glob("custom_checkpoint_*"))  # nothing of ours needs a full unpickle
    state = json.loads((checkpoint / "training_state.json").read_text())
    assert state["scheduler"]["last_epoch"] == 2 and len(state["scheduler"]["_last_lr"]) >= 1
    marker = tmp_path / "code-ran"

    class RunsCode:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').close()",)

    torch.save({"last_epoch": RunsCode()}, checkpoint / "custom_checkpoint_0.pkl", pickle_module=pickle)
    write_manifest(checkpoint)
    result = run_distill(distill_args(workspace, output_dir, max_train_steps=4, resume_from_checkpoint="latest"),
                         check=False)  # fmt: skip
    assert result.returncode != 0 and not marker.exists()
    assert f"Refusing to resume from {checkpoint}: custom_checkpoint_0.pkl would run code to load" in result.stderr


@pytest.mark.processes
def test_bad_arguments_fail_with_a_clear_message(workspace, tmp_path):
    command = [sys.executable, str(SCRIPT)] + distill_args(workspace, tmp_path / "bad", budgets="8,12")
    result = warm_python.run(command, capture_output=True, text=True, timeout=300, env=run_env(), cwd=ROOT)
    assert result.returncode != 0
    assert "--budgets entry=12 is not a valid budget" in result.stderr


@pytest.mark.processes
def test_hub_model_id_without_push_to_hub_is_refused_before_any_work(workspace, tmp_path):
    command = [sys.executable, str(SCRIPT)] + distill_args(workspace, tmp_path / "hub", hub_model_id="me/veca")
    result = warm_python.run(command, capture_output=True, text=True, timeout=300, env=run_env(), cwd=ROOT)
    assert result.returncode != 0
    assert "--hub_model_id given without --push_to_hub" in result.stderr
    assert not (tmp_path / "hub").exists()


@pytest.mark.processes
def test_dense_student_sees_the_same_data_and_saves_a_dinov3_model(workspace, tmp_path):
    """The attention-pattern control, chosen by its config: same stream, steps and loss as VECA, a `DINOv3ViTModel`
    saved at the end."""
    common = dict(log_sample_sources="true", max_train_steps=3, checkpointing_steps=0, validation_steps=3)
    run_distill(distill_args(workspace, tmp_path / "veca", **common))
    dense_config = full_attention_student_config(VecaConfig.from_pretrained(workspace / "student"))
    dense_config.save_pretrained(tmp_path / "dense-config")
    result = run_distill(
        distill_args(workspace, tmp_path / "dense", student_config=tmp_path / "dense-config", **common)
    )
    assert "| dense |" in result.stdout
    summary = json.loads((tmp_path / "dense" / "distill_results.json").read_text())
    assert summary["student_model_type"] == "dinov3_vit" and set(summary["validation"]) == {"dense"}
    assert not (tmp_path / "dense" / "README.md").exists()  # no VECA model card for the control
    model = AutoModel.from_pretrained(tmp_path / "dense")
    assert isinstance(model, DINOv3ViTModel)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2 and model.config.use_gated_mlp
    sources = [(tmp_path / kind / "sample_sources" / "rank0.txt").read_text() for kind in ("veca", "dense")]
    assert sources[0] == sources[1] and len(sources[0].splitlines()) == 3 * 4


@pytest.mark.processes
def test_a_student_config_of_another_model_fails_with_a_clear_message(workspace, tmp_path):
    ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path / "vit")
    command = [sys.executable, str(SCRIPT)] + distill_args(
        workspace, tmp_path / "bad", student_config=tmp_path / "vit"
    )
    result = warm_python.run(command, capture_output=True, text=True, timeout=300, env=run_env(), cwd=ROOT)
    assert result.returncode != 0
    assert f"The student {tmp_path / 'vit'} is a 'vit' model" in result.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


def without(args: list[str], *flags: str) -> list[str]:
    """`args` without the given flags and their values."""
    pairs = list(zip(args[::2], args[1::2], strict=True))
    return [item for flag, value in pairs if flag not in flags for item in (flag, value)]


@pytest.mark.processes
def test_launcher_mixed_precision_is_used_unless_the_flag_is_given(workspace, tmp_path):
    """`accelerate launch --mixed_precision bf16` (or its config file) sets ACCELERATE_MIXED_PRECISION: it wins over
    the script's default, and an explicit --mixed_precision wins over it; the first log line says which is used."""
    common = dict(max_train_steps=1, checkpointing_steps=0, validation_steps=1)
    result = run_distill(
        distill_args(workspace, tmp_path / "launcher", **common), env={"ACCELERATE_MIXED_PRECISION": "bf16"}
    )
    assert first_log_line(result).endswith("Mixed precision: bf16; 1 process(es) on cpu.")
    # bf16 runs as asked; where this CPU lacks bf16 instructions the log says, measured, how much slower it is.
    slow_bf16 = cpu_bf16_support(measure_size=None)["fast_bf16"] is False
    assert ("mixed precision bf16: this CPU" in result.stderr and "x slower" in result.stderr) == slow_bf16
    result = run_distill(
        distill_args(workspace, tmp_path / "flag", mixed_precision="no", **common),
        env={"ACCELERATE_MIXED_PRECISION": "bf16"},
    )
    assert first_log_line(result).endswith("Mixed precision: no; 1 process(es) on cpu.")


@pytest.mark.processes
def test_default_budgets_cover_a_custom_core_bank(workspace, tmp_path):
    """A student with 16 cores (not the presets' 64) trains with no budget flags: budgets 8 and 16."""
    assert VecaConfig.from_pretrained(workspace / "student").core_bank_size == 16
    output_dir = tmp_path / "run"
    args = without(
        distill_args(workspace, output_dir, max_train_steps=2, checkpointing_steps=0, validation_steps=2),
        "--budgets",
        "--budget_weights",
    )
    result = run_distill(args)
    assert "budgets [8, 16]" in result.stderr
    assert set(json.loads((output_dir / "distill_results.json").read_text())["validation"]) == {"8", "16"}


@pytest.mark.processes
def test_teacher_that_cannot_be_loaded_is_an_error_unless_the_fallback_is_asked_for(workspace, tmp_path):
    args = distill_args(
        workspace,
        tmp_path / "run",
        teacher_name_or_path="veca-test/not-a-cached-teacher",
        teacher_fallback_dir=tmp_path / "fallback",
        max_train_steps=1,
        checkpointing_steps=0,
    )
    result = run_distill(args, check=False)
    assert result.returncode != 0
    assert "Cannot use teacher 'veca-test/not-a-cached-teacher'" in result.stderr
    assert "offline mode" in result.stderr and "--allow_teacher_fallback" in result.stderr

    # Opted in: the fallback folder (here a tiny DINOv2, patch 14, already extracted) is used, with a warning.
    Dinov2Model(
        Dinov2Config(
            hidden_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=128,
            patch_size=14,
            image_size=56,
        )
    ).save_pretrained(tmp_path / "fallback")
    (tmp_path / "fallback" / "preprocessor_config.json").write_text("{}")
    result = run_distill(args + ["--allow_teacher_fallback", "true"])
    assert "Falling back to the real DINOv2-S/14 teacher" in result.stderr
    assert json.loads((tmp_path / "run" / "distill_results.json").read_text())["step"] == 1


@pytest.mark.processes
def test_held_out_split_taking_every_image_says_so(workspace, tmp_path):
    result = run_distill(distill_args(workspace, tmp_path / "run", validation_size=100), check=False)
    assert result.returncode != 0
    assert "the held-out validation split (the first --validation_size 100 images) took every image" in result.stderr
    assert "Lower --validation_size, or pass --validation_split" in result.stderr


@pytest.mark.processes
def test_a_failing_run_with_dataloader_workers_exits_instead_of_hanging(workspace, tmp_path):
    """DataLoader workers ignore SIGTERM (for SLURM), so a run that raises must shut them down itself: otherwise
    multiprocessing's exit hook terminates them with SIGTERM and waits for them forever. Here the teacher's output
    is NaN at steps 1 and 2 and the guard stops the run after 2 non-finite steps in a row."""
    args = distill_args(workspace, tmp_path / "failing", dataloader_num_workers=1, max_consecutive_nonfinite_steps=2)
    result = run_distill(args, env={"VECA_HF_TEST_NAN_TEACHER_STEPS": "1,2"}, timeout=120, check=False)
    assert result.returncode != 0 and "NonFiniteStepsError" in result.stderr


@pytest.mark.processes
def test_rerunning_a_finished_run_keeps_its_validation(workspace, tmp_path):
    """Resumed from its last checkpoint, a finished run trains no step but still validates the student it saves."""
    args = distill_args(workspace, tmp_path / "finished", max_train_steps=2, resume_from_checkpoint="latest")
    run_distill(args)
    first = json.loads((tmp_path / "finished" / "distill_results.json").read_text())
    run_distill(args)
    again = json.loads((tmp_path / "finished" / "distill_results.json").read_text())
    assert set(again["validation"]) == {"8", "16"} and again["step"] == 2
    for budget, terms in first["validation"].items():
        assert again["validation"][budget]["loss"] == pytest.approx(terms["loss"], rel=1e-5)


@pytest.mark.processes
def test_normuon_run_logs_its_split_and_resumes_exactly(workspace, tmp_path):
    """The paper's recipe end to end: NorMuon + AdamW, the teacher's patch embedding, warm-up from the minimum; a run
    resumed from its step-2 checkpoint (optimiser state included) ends with the uninterrupted run's weights."""
    recipe = dict(optimizer="normuon", init_patch_embeddings_from_teacher="yes", warmup_from_min_learning_rate="true",
                  max_train_steps=4, checkpointing_steps=2, validation_steps=2)  # fmt: skip
    result = run_distill(distill_args(workspace, tmp_path / "full", **recipe))
    assert "NorMuon for 7 hidden matrices" in result.stderr  # 2 blocks x 4 linear weights, less the last MLP output
    assert "Patch embedding copied from the teacher: weight (64, 3, 16, 16)" in result.stderr
    history = json.loads((tmp_path / "full" / "distill_results.json").read_text())["validation_history"]
    assert [h["step"] for h in history] == [0, 2, 4] and set(history[0]["losses"]) == {"8", "16"}
    optimizer_state = torch.load(
        tmp_path / "full" / "checkpoints" / "checkpoint-2" / "optimizer.bin", weights_only=False
    )
    assert [group["use_muon"] for group in optimizer_state["param_groups"]] == [True, False, False]

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "checkpoint-2", resumed / "checkpoints" / "checkpoint-2")
    run_distill(distill_args(workspace, resumed, resume_from_checkpoint="latest", **recipe))
    full, again = load_file(tmp_path / "full" / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.equal(full[key], again[key]) for key in full)
    # the resumed run kept the validation history written before the checkpoint
    assert json.loads((resumed / "distill_results.json").read_text())["validation_history"] == history

    adamw = tmp_path / "adamw"
    run_distill(distill_args(workspace, adamw, **{**recipe, "optimizer": "adamw"}))
    assert not torch.equal(load_file(adamw / "model.safetensors")["encoder.layer.0.attention.qkv_proj.weight"],
                           full["encoder.layer.0.attention.qkv_proj.weight"])  # fmt: skip


@pytest.mark.processes
def test_normuon_under_ddp_keeps_replicas_equal_and_skips_a_non_finite_step(workspace, tmp_path):
    output_dir = tmp_path / "ddp-normuon"
    launcher = two_cpu_processes(29534)
    result = run_distill(
        distill_args(workspace, output_dir, optimizer="normuon", max_train_steps=3),
        launcher=launcher,
        env={"VECA_HF_TEST_NAN_TEACHER_STEPS": "2:1"},
    )
    assert "Step 2: non-finite loss or gradients (NaN or inf) on at least one process: step skipped" in result.stderr
    assert "The weights agree on all 2 processes." in result.stderr
    assert json.loads((output_dir / "distill_results.json").read_text())["nonfinite_steps"] == 1
    assert all(torch.isfinite(value).all() for value in load_file(output_dir / "model.safetensors").values())


@pytest.mark.processes
def test_start_from_a_saved_student(workspace, tmp_path):
    """Stage 2 starts from stage 1's folder: with a zero learning rate the weights come out as they went in, and the
    patch embedding is not replaced by the teacher's under `auto`."""
    torch.manual_seed(3)
    VecaModel(tiny_config()).save_pretrained(tmp_path / "stage1")
    args = without(distill_args(workspace, tmp_path / "stage2", max_train_steps=1, learning_rate=0.0,
                                min_learning_rate=0.0, checkpointing_steps=0), "--student_config")  # fmt: skip
    run_distill(args + ["--student_name_or_path", str(tmp_path / "stage1")])
    before, after = (
        load_file(tmp_path / "stage1" / "model.safetensors"),
        load_file(tmp_path / "stage2" / "model.safetensors"),
    )
    assert all(torch.equal(before[key], after[key]) for key in before)
    result = run_distill(
        distill_args(workspace, tmp_path / "both", student_name_or_path=tmp_path / "stage1"), check=False
    )
    assert result.returncode != 0 and "brings its own config; drop --student_config" in result.stderr
    # the dense control too
    DINOv3ViTModel(full_attention_student_config(tiny_config())).save_pretrained(tmp_path / "dense-stage1")
    run_distill(args + ["--student_name_or_path", str(tmp_path / "dense-stage1"),
                        "--output_dir", str(tmp_path / "dense-stage2")])  # fmt: skip
    before = load_file(tmp_path / "dense-stage1" / "model.safetensors")
    after = load_file(tmp_path / "dense-stage2" / "model.safetensors")
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_credentials_never_reach_disk_logs_or_trackers(workspace, tmp_path, monkeypatch, capfd):
    """A fake Hub token through a run with checkpoints, a tensorboard tracker, a model card and an upload (the Hub's
    API replaced by a recorder): no file the run wrote and nothing it printed holds the token."""
    import importlib.util

    import huggingface_hub

    token = "hf_FAKEtokenNEVERonDISK0123456789"
    uploads = []
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "create_repo",
        lambda self, repo_id, **kw: huggingface_hub.RepoUrl(f"https://huggingface.co/me/{repo_id.split('/')[-1]}"),
    )
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: uploads.append(kw))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "restored after the test")  # the run moves --hub_token into HF_TOKEN
    monkeypatch.delenv("HF_TOKEN")
    spec = importlib.util.spec_from_file_location("distill_secrets", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    output_dir = tmp_path / "secret-run"
    argv = distill_args(workspace, output_dir, max_train_steps=2, checkpointing_steps=1, report_to="tensorboard",
                        model_card_latency="false") + ["--push_to_hub", "--hub_token", token]  # fmt: skip
    secret = "FAKEstorageSECRETkey987"  # storage keys for remote shards take the same way
    argv += ["--storage_options", json.dumps({"key": "AKIAFAKEKEYID", "secret": secret, "anon": False})]
    monkeypatch.setattr(sys, "argv", ["distill.py", *argv])
    script.main()
    assert len(uploads) == 1  # the upload happened (with the token, in this process's HF_TOKEN only)
    assert os.environ["HF_TOKEN"] == token and token not in " ".join(sys.argv) and secret not in " ".join(sys.argv)
    written = [path for path in output_dir.rglob("*") if path.is_file()]
    assert any("events.out.tfevents" in p.name for p in written) and any(
        p.name == "training_state.json" for p in written
    )
    assert [p for p in written if token.encode() in p.read_bytes() or secret.encode() in p.read_bytes()] == []
    state = json.loads(next(p for p in written if p.name == "training_state.json").read_text())
    assert state["args"]["hub_token"] is None  # taken out of the arguments before anything is written
    options = json.loads(state["args"]["storage_options"])  # every option's whole value; the names stay
    assert options == {"key": "<REDACTED>", "secret": "<REDACTED>", "anon": "<REDACTED>"}
    out, err = capfd.readouterr()
    assert token not in out + err and secret not in out + err


def parse_distill_args(argv: list[str]):
    import importlib.util

    spec = importlib.util.spec_from_file_location("distill_arguments", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.parse_args(argv)


@pytest.mark.parametrize(
    "flag, value, fix",
    [("checkpoints_total_limit", "-1", "0 or null keeps every checkpoint"), ("checkpointing_steps", "-5", "0 never"),
     ("max_consecutive_nonfinite_steps", "0", "1 stops"), ("warmup_steps", "-1", "0 means no warm-up"),
     ("teacher_micro_batch_size", "0", "leave it out"), ("validation_size", "-1", "0 holds out nothing"),
     ("shuffle_buffer_size", "-1", "0 streams without shuffling"), ("dataloader_num_workers", "-2", "0 loads"),
     ("min_image_size", "-1", "0 keeps every image"), ("stream_retries", "0", "1 tries"),
     ("stream_retry_wait", "-1.0", "0 retries at once"), ("stream_timeout", "-1.0", "aiohttp's default")],
)  # fmt: skip
def test_every_count_flag_is_checked_when_parsed(flag, value, fix):
    with pytest.raises(ValueError, match=rf"--{flag} must be at least 0?1?, got {value}: .*{fix}"):
        parse_distill_args(["--dataset_name", "images", f"--{flag}", value])


def test_checkpoints_total_limit_0_keeps_every_checkpoint():
    args = parse_distill_args(["--dataset_name", "images", "--checkpoints_total_limit", "0"])[2]
    assert args.checkpoints_total_limit == 0 and "0 or null: keep every checkpoint" in str(
        type(args).__dataclass_fields__["checkpoints_total_limit"].metadata["help"]
    )


def test_the_demo_config_starts_over_each_time():
    """`bash run.sh` twice in a row distils into the same folder: each run replaces the last one's checkpoints."""
    args = parse_distill_args([str(ROOT / "examples" / "configs" / "demo_cpu.yaml")])[2]
    assert args.overwrite_output_dir and args.resume_from_checkpoint is None


@pytest.mark.processes
def test_a_new_run_never_deletes_another_runs_checkpoints(workspace, tmp_path):
    """Another run left checkpoint-4 and checkpoint-6 (limit 2); a new run there would save checkpoint-2 and rotate it
    away at once, then replace the others: it stops before any work, unless --overwrite_output_dir."""
    output_dir = tmp_path / "used"
    run_distill(distill_args(workspace, output_dir, max_train_steps=6, checkpoints_total_limit=2))
    checkpoints = output_dir / "checkpoints"
    weights = (checkpoints / "checkpoint-6" / "model.safetensors").read_bytes()
    new_run = distill_args(workspace, output_dir, max_train_steps=2, checkpoints_total_limit=2)
    result = run_distill(new_run, check=False)
    assert result.returncode != 0
    assert "holds the checkpoints of another run (checkpoint-4, checkpoint-6)" in result.stderr
    assert "--resume_from_checkpoint latest" in result.stderr and "--overwrite_output_dir" in result.stderr
    # refused before the teacher, the data or a step
    assert "Patch embedding copied from the teacher" not in result.stderr and "Student:" not in result.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert (checkpoints / "checkpoint-6" / "model.safetensors").read_bytes() == weights

    result = run_distill(new_run + ["--overwrite_output_dir", "true"])
    assert "--overwrite_output_dir: removed checkpoint-4, checkpoint-6 of an earlier run" in result.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-2"]
    assert json.loads((output_dir / "distill_results.json").read_text())["step"] == 2
