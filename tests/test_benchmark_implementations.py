"""`benchmarks/implementations.py` on tiny models: `research` (against a stand-in clone of the research code built
from tests/reference_veca.py: the same outputs, paired timings, forward and training steps), `kernels` (SDPA and
matmul agree, paired timings) and `revision` (HEAD's model against the working tree's)."""

import json
import subprocess
import sys

import pytest
import torch
from benchmark_support import BENCHMARKS, ENV, ROOT, import_benchmark, paired, run_script


@pytest.fixture(scope="module")
def research_clone(tmp_path_factory):
    """A stand-in for a clone of the research code: `veca/model.py` with its `VECA(settings)` class, here the
    plain re-implementation of tests/reference_veca.py (the same checkpoint layout) behind the research code's
    constructor."""
    clone = tmp_path_factory.mktemp("research_code")
    (clone / "veca").mkdir()
    (clone / "veca" / "model.py").write_text(f"""import sys
sys.path.insert(0, {str(ROOT / "tests")!r})
from reference_veca import ReferenceVeca


class VECA(ReferenceVeca):
    def __init__(self, cfg):
        super().__init__(cfg.hidden_dim, cfg.num_heads, cfg.num_layers, int(cfg.hidden_dim * cfg.mlp_ratio),
                         cfg.num_query_tokens, cfg.nested_chunk_size, cfg.patch_size, cfg.in_channels)
""")
    return clone


@pytest.mark.processes
def test_research_code_computes_veca_and_is_timed_in_pairs(tmp_path, research_clone):
    run_script("implementations.py", "research", "--research_code", str(research_clone), "--tiny", "--resolutions",
               "64,96", "--budget", "16", "--warmup", "0", "--repeats", "3", "--threads", "1",
               "--output_dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert [p["resolution"] for p in result["points"]] == [64, 96]
    for point in result["points"]:
        assert point["max_abs_difference"] < 1e-4  # the converted weights give the clone's outputs
        veca, research = point["seconds"]["VECA"], point["seconds"]["research code"]
        assert len(veca) == len(research) == 3
        assert point["paired_ratio"] == pytest.approx(paired(veca, research), rel=1e-12)


@pytest.mark.processes
def test_research_code_times_training_steps_under_autocast(tmp_path, research_clone):
    run_script("implementations.py", "research", "--research_code", str(research_clone), "--tiny",
               "--num_hidden_layers", "1", "--mode", "train", "--dtype", "bf16_autocast", "--resolutions", "64",
               "--budget", "16", "--warmup", "1", "--repeats", "2", "--threads", "1",
               "--output_dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    (point,) = result["points"]
    assert point["mode"] == "train" and point["dtype"] == "bf16_autocast"
    assert point["max_abs_difference"] < 1e-4  # compared in fp32 before the steps
    assert all(len(seconds) == 2 and min(seconds) > 0 for seconds in point["seconds"].values())
    assert "1 blocks, cpu, bf16_autocast, training step" in (tmp_path / "results.md").read_text()


def test_research_code_clone_is_checked_and_loaded_without_timm(tmp_path):
    implementations = import_benchmark("implementations")
    with pytest.raises(ValueError, match="has no veca/model.py"):
        implementations.load_research_code(str(tmp_path))
    (tmp_path / "veca").mkdir()
    (tmp_path / "veca" / "model.py").write_text(
        "import timm\nimport torch.nn as nn\n\n\nclass VECA(nn.Module):\n    timm_module = timm\n"
    )
    had_timm = "timm" in sys.modules
    veca_class = implementations.load_research_code(str(tmp_path))
    assert veca_class.__name__ == "VECA" and issubclass(veca_class, torch.nn.Module)
    assert ("timm" in sys.modules) == had_timm  # a stand-in for a missing timm is removed again


@pytest.mark.processes
@pytest.mark.parametrize("backward", [False, True])
def test_attention_kernels_agree_and_are_timed_in_pairs(tmp_path, backward):
    run_script("implementations.py", "kernels", "--tiny", "--resolutions", "64", "--budgets", "8", "--dtypes",
               "fp32,bf16", "--repeats", "3", "--calls", "2", "--threads", "1", "--output_dir", str(tmp_path),
               *(["--backward"] if backward else []))  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    points = {(p["dtype"], p["call"]): p for p in result["points"]}
    assert set(points) == {(d, c) for d in ("fp32", "bf16") for c in ("cores", "patches")}
    num_patches = (64 // 16) ** 2
    for (dtype, call), point in points.items():
        assert (point["queries"], point["keys"]) == ((8, 8 + num_patches) if call == "cores" else (num_patches, 8))
        tolerance = 1e-5 if dtype == "fp32" else 5e-2  # bf16 inputs' rounding, both forms alike
        assert max(point["max_abs_error_to_fp32_sdpa"].values()) <= tolerance
        seconds = point["seconds"]
        assert len(seconds["sdpa"]) == len(seconds["matmul"]) == 3 and min(seconds["sdpa"] + seconds["matmul"]) > 0
        assert point["paired_ratio"] == pytest.approx(paired(seconds["matmul"], seconds["sdpa"]), rel=1e-12)
    markdown = (tmp_path / "results.md").read_text()
    assert ("forward + backward" in markdown) == backward
    assert f"| bf16 | 64 | {num_patches} | 8 | patches | {num_patches} x 8 |" in markdown


@pytest.mark.processes
def test_attention_kernels_rejects_unknown_dtype():
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "implementations.py"), "kernels", "--dtypes", "fp16"],
                               cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert completed.returncode == 2 and "--dtypes: 'fp16'" in completed.stderr and "bf16" in completed.stderr


@pytest.mark.processes
def test_model_revisions_times_a_revision_against_the_working_tree(tmp_path):
    """HEAD's model folder imported from git next to the working tree's: same weights, both timed, outputs compared."""
    run_script("implementations.py", "revision", "--before", "HEAD", "--tiny", "--resolutions", "32,48",
               "--budgets", "8,16", "--repeats", "3", "--warmup", "0", "--no_dinov3", "--threads", "1",
               "--output_dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    assert result["before"] == head.strip() and result["after"] == "working tree"
    assert [(p["resolution"], p["budget"]) for p in result["points"]] == [(32, 8), (32, 16), (48, 8), (48, 16)]
    model_unchanged = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src/veca_hf/model"], cwd=ROOT)
    for point in result["points"]:
        assert point["before_ms"] > 0 and point["after_ms"] > 0 and len(point["after_over_before_rounds"]) == 3
        low, high = point["after_over_before_interval"]
        assert low <= point["after_over_before_geometric_mean"] <= high
        if model_unchanged.returncode == 0:  # the same code at both ends computes the same numbers
            assert point["max_abs_output_difference"] == 0.0
    assert "| 48 | 16 | 3 |" in (tmp_path / "results.md").read_text()
