"""Smoke test of `benchmarks/scaling.py`: a tiny run of both modes writes its JSON, markdown and plots, and every
point's FLOPs counted by `torch.utils.flop_counter` equal the analytic ones. No timing assertions."""

import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scaling.py"
RESOLUTIONS = (64, 96)
BUDGETS = (8, 16)
REPEATS = 2


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("scaling")
    command = [
        sys.executable,
        str(SCRIPT),
        "--tiny",
        "--size", "veca-s16",
        "--mode", "both",
        "--resolutions", ",".join(map(str, RESOLUTIONS)),
        "--budgets", ",".join(map(str, BUDGETS)),
        "--batch_sizes", "1",
        "--warmup", "0",
        "--repeats", str(REPEATS),
        "--profile_repeats", "1",
        "--threads", "1",
        "--gemm_size", "128",
        "--gemm_repeats", "1",
        "--output_dir", str(output_dir),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return output_dir, completed.stdout


@pytest.mark.processes
def test_outputs_written(tiny_run):
    output_dir, stdout = tiny_run
    for name in ("results.json", "results.md", "latency_vs_resolution.png", "flops_vs_resolution.png"):
        assert (output_dir / name).stat().st_size > 0, name
    for name in ("latency_vs_resolution.png", "flops_vs_resolution.png"):
        assert (output_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (output_dir / "results.md").read_text()
    assert "## model mode" in markdown and "## block mode" in markdown and "## Summary" in markdown
    assert "GFLOPs analytic" in markdown and "latency ratio vs DINOv3" in markdown
    assert "Summary" in stdout and "VECA/DINOv3 latency ratio" in stdout


@pytest.mark.processes
def test_every_point_counted_equals_analytic(tiny_run):
    output_dir, _ = tiny_run
    result = json.loads((output_dir / "results.json").read_text())
    points = result["points"]
    # 2 modes x 2 resolutions x (DINOv3 + 2 budgets)
    assert len(points) == 2 * len(RESOLUTIONS) * (1 + len(BUDGETS))
    for point in points:
        assert point["error"] is None, point
        assert point["flops_counted"] == point["flops_analytic"] > 0, point
        assert point["flops_match"] is True
        latency = point["latency_ms"]
        assert latency["min"] <= latency["median"] <= latency["max"] and len(latency["samples"]) == REPEATS
        assert point["images_per_s"] > 0 and point["gemm_fraction"] > 0
        # each point is compared with the GEMM timed in its own interleaved rounds
        achieved = point["flops_analytic"] / (point["latency_ms"]["median"] / 1e3) / 1e9
        assert point["gemm_fraction"] == pytest.approx(achieved / point["gemm_reference_gflops_per_s"], rel=1e-9)
        assert 0.0 <= point["attention_core_share"] <= point["attention_module_share"] <= 1.0
        assert point["forward_peak_mb"] > 0 and point["peak_memory_mb"] > point["forward_peak_mb"]
        assert (
            isinstance(point["minor_page_faults_per_call"], (int, float)) and point["minor_page_faults_per_call"] >= 0
        )
        if point["model"] == "VECA":
            assert point["num_tokens"] == point["num_patches"] + point["budget"]
            assert point["latency_ratio_vs_dinov3"] > 0 and point["flop_ratio_vs_dinov3"] > 0
        else:
            assert point["num_tokens"] == point["num_patches"] + 5 and point["budget"] is None
    # every resolution of a mode runs in the same interleaved rounds, so they share one GEMM reference
    for mode in ("model", "block"):
        assert len({p["gemm_reference_gflops_per_s"] for p in points if p["mode"] == mode}) == 1


def _paired(numerators, denominators):
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


@pytest.mark.processes
def test_paired_ratios_are_medians_of_per_round_ratios(tiny_run):
    output_dir, _ = tiny_run
    result = json.loads((output_dir / "results.json").read_text())
    points = {(p["mode"], p["resolution"], p["label"]): p for p in result["points"]}
    label = f"VECA C={max(BUDGETS)}"
    for (mode, resolution, _name), point in points.items():
        dense = points[(mode, resolution, "DINOv3")]
        expected = _paired(point["latency_ms"]["samples"], dense["latency_ms"]["samples"])
        assert point["paired_latency_ratio_vs_dinov3"] == pytest.approx(expected, rel=1e-9)
    for entry in result["summary"]:
        mode, small, large = entry["mode"], entry["reference_resolution"], entry["largest_resolution"]
        assert (
            entry["ratios"][str(large)]["paired_latency_ratio"]
            == points[(mode, large, label)]["paired_latency_ratio_vs_dinov3"]
        )
        for model, key in ((label, "veca"), ("DINOv3", "dinov3")):
            big, ref = points[(mode, large, model)], points[(mode, small, model)]
            per_round = _paired(big["latency_ms"]["samples"], ref["latency_ms"]["samples"])
            expected = per_round * ref["num_tokens"] / big["num_tokens"]
            assert entry[f"{key}_paired_per_token_latency_ratio"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.processes
def test_json_metadata_and_summary(tiny_run):
    output_dir, _ = tiny_run
    result = json.loads((output_dir / "results.json").read_text())
    machine = result["machine"]
    assert machine["torch_version"] == torch.__version__ and machine["torch_num_threads"] == 1
    assert "cpu_model" in machine and machine["device"] == "cpu"
    assert machine["thp_mem_alloc_enable"] == os.environ.get("THP_MEM_ALLOC_ENABLE")
    assert machine["transparent_hugepage"] in (None, "always", "madvise", "never")
    assert machine["cpu_allocator"]["settings"]["M_MMAP_MAX"] == 0  # --cpu_allocator tuned, recorded
    assert machine["cpu_allocator"]["tuned"] == (platform.libc_ver()[0] == "glibc")
    assert "--tiny" in result["command"] and result["args"]["budgets"] == list(BUDGETS)
    assert result["gemm"]["median_gflops_per_s"] > 0
    assert result["models"]["veca"]["hidden_size"] == result["models"]["dinov3"]["hidden_size"] == 64
    summary = result["summary"]
    assert {(s["mode"], s["batch_size"]) for s in summary} == {("model", 1), ("block", 1)}
    for entry in summary:
        assert entry["budget"] == max(BUDGETS) and entry["largest_resolution"] == max(RESOLUTIONS)
        assert entry["veca_per_token_latency_ratio"] > 0 and entry["veca_gemm_fraction_at_largest"] > 0


def test_block_inputs_match_paper_table_on_meta():
    """The block-mode input helpers reproduce the paper's attention-block FLOPs (VECA-B, DINOv3-B, 1024 px, C=64)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import scaling
        import scaling_cases
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTAttention

    from veca_hf.model.modeling_veca import VecaCorePeripheryAttention

    args = scaling.parse_args(["--size", "veca-b16", "--output_dir", "unused"])
    veca_config, dinov3_config = scaling.build_configs(args)
    with torch.device("meta"):
        veca_block = VecaCorePeripheryAttention(veca_config).eval()
        dinov3_block = DINOv3ViTAttention(dinov3_config).eval()
    veca_args, veca_kwargs = scaling_cases.make_veca_block_inputs(
        veca_config, 1, 1024, 1024, 64, torch.float32, "meta"
    )
    dense_args, dense_kwargs = scaling_cases.make_dinov3_block_inputs(
        dinov3_config, 1, 1024, 1024, torch.float32, "meta"
    )
    assert scaling_cases.count_call(lambda: veca_block(*veca_args, **veca_kwargs)) == 21_252_538_368
    assert round(scaling_cases.count_call(lambda: dinov3_block(*dense_args, **dense_kwargs)) / 1e9, 3) == 71.016


@pytest.mark.processes
def test_compiled_models_are_timed_with_one_graph_each(tmp_path):
    """`--compile` wraps both models in `torch.compile(dynamic=True)` (here with the cheap `eager` backend)."""
    command = [
        sys.executable, str(SCRIPT), "--tiny", "--size", "veca-s16", "--mode", "model", "--resolutions", "64,96",
        "--budgets", "8,16", "--warmup", "1", "--repeats", "1", "--threads", "1", "--gemm_size", "128",
        "--gemm_repeats", "1", "--compile", "--compile_backend", "eager", "--no_plots", "--output_dir", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), "TORCH_LOGS": "recompiles"}
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["args"]["compile"] and result["args"]["no_profile"]
    assert all(p["latency_ms"]["median"] > 0 and p["flops_match"] for p in result["points"])
    assert all(p["first_call_s"] > 0 for p in result["points"])  # compile + one call, for the compile time
    # the second budget and the second resolution reuse the first graph
    assert "Recompiling function forward" not in completed.stderr


def test_minor_page_faults_see_fresh_memory():
    """The fault counter behind `minor_page_faults_per_call` sees a fresh 64 MiB mapping being touched: at least one
    fault per 2 MiB huge page, whatever the THP settings (a fresh mmap, not a tensor: once a VECA forward has run,
    glibc serves large tensors from memory the process already touched)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import scaling_measure
    finally:
        sys.path.remove(str(SCRIPT.parent))
    with mmap.mmap(-1, 64 * 2**20) as fresh:
        before = scaling_measure.minor_page_faults()
        fresh.write(b"\x01" * len(fresh))
        assert scaling_measure.minor_page_faults() - before >= 32
