"""DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU processes: build (under `zero.Init` for ZeRO-3), train at changing budgets,
gather, save and reload. The steps run in `deepspeed_steps.py` under `torchrun`; these tests check what it reports."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


pytest.importorskip("deepspeed")

ROOT = Path(__file__).parent.parent
DRIVER = Path(__file__).parent / "deepspeed_steps.py"


def run_steps(stage: int, output_dir: Path) -> dict:
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",  # no CUDA probing; gloo
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(DRIVER), "--stage", str(stage), "--output_dir", str(output_dir),
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads((output_dir / "result.json").read_text())


@pytest.mark.processes
def test_zero2_and_zero3_train_save_and_reload_alike(tmp_path):
    """Both stages in one test, one after the other: two 2-process DeepSpeed runs at once (two test workers) slow
    each other down several times over, and each worker would repeat the other's stage."""
    results = {stage: run_steps(stage, tmp_path / f"zero{stage}") for stage in (2, 3)}
    for stage, result in results.items():
        assert result["world_size"] == 2, f"ZeRO-{stage}"
        assert len(result["losses"]) == 3 and all(loss == loss and loss < 1e6 for loss in result["losses"])
        assert result["parameters_not_moved"] == [], (
            f"ZeRO-{stage}"
        )  # every parameter trained (the budget-32 step used every chunk)
        assert result["core_coordinates_finite_in_range"]
        assert result["patch_embedding_copied_from_teacher"]  # on both ranks, from partitions under ZeRO-3
        # rank 0's save_pretrained of the gathered weights reloads exactly
        assert result["reload_keys_equal"] and result["reload_weights_equal"]
        assert result["reload_max_abs_diff"] == 0.0
    # `VecaModel(config)` under zero.Init was partitioned from the start (checked in the driver), and
    # `from_pretrained` under ZeRO-3 partitions and loads the same weights
    assert results[3]["zero3_reload_partitioned"] and results[3]["zero3_reload_equal"]
    # same seed, same data: the ZeRO-3 model (initialised on rank 0 under zero.Init, then broadcast) follows ZeRO-2's
    assert results[3]["losses"] == pytest.approx(results[2]["losses"], rel=1e-4)


@pytest.mark.processes
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_checkpoints_restore_as_data_and_a_planted_pickle_never_runs(stage, tmp_path):
    """DeepSpeed's engine loads its files with a full unpickle; `load_checkpoint` checks each one first and forces
    weights_only=True, allowing only DeepSpeed's plain data classes (`deepspeed_safe_globals`)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               str(Path(__file__).parent / "deepspeed_checkpoint.py"), "--stage", str(stage),
               "--output_dir", str(tmp_path)]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert any(name.endswith("optim_states.pt") for name in result["files"])  # DeepSpeed's own files
    assert result["changed"] and result["restored"]  # the second step was undone by the restore
    assert not result["code_ran"]
    assert f"{result['planted']} would run code to load" in result["refused"]
