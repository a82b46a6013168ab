"""`benchmarks/gpu_check.sh`: it parses, and its dry run (every stage at tiny sizes on CPU) writes its table and
JSON."""

import json
import subprocess
import sys

import pytest
import torch
from benchmark_support import BENCHMARKS, ENV, ROOT


@pytest.mark.processes
def test_gpu_check_parses():
    assert subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_check.sh")]).returncode == 0


@pytest.mark.processes
def test_gpu_check_dry_run(tmp_path):
    """Every stage at tiny sizes on CPU; the DeepSpeed stages are skipped with their reason (no CUDA here)."""
    if torch.cuda.is_available():
        pytest.skip("the dry run is the CPU path")
    env = {**ENV, "GPU_CHECK_DRY_RUN": "1", "PYTHON": sys.executable}  # the interpreter that runs the tests
    env.pop("OUT", None)
    completed = subprocess.run(["bash", str(BENCHMARKS / "gpu_check.sh"), str(tmp_path)], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=400)  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = {s["stage"]: s for s in result["stages"]}
    assert {stages[name]["status"] for name in ("scaling", "kernels", "precision", "distill")} == {"ok"}, stages
    assert "resumed from step 2" in stages["distill"]["detail"]
    for name in ("zero2", "zero3"):
        assert stages[name]["status"] == "skipped" and "CUDA" in stages[name]["detail"]
    assert {r["model"] for r in result["scaling"]} == {"DINOv3", "VECA C=16"}
    assert result["precision"] and result["all_ok"]
    kernel_rows = {(r["kernel"], r["mode"], r["model"]): r for r in result["kernels"]}
    for kernel in ("sdpa", "eager"):
        for mode in ("forward", "train"):
            for model in ("DINOv3", "VECA C=8", "VECA C=64"):
                assert kernel_rows[(kernel, mode, model)]["ms"] > 0
            assert kernel_rows[(kernel, mode, "VECA C=8")]["ratio_vs_dinov3"] > 0
    assert "| stage | status |" in completed.stdout and "| kernel | res | batch | mode |" in completed.stdout
