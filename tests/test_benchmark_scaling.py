"""`benchmarks/scaling.py` and `benchmarks/scaling.py` on tiny models: a run of the model and block modes
writes its JSON, markdown and plots, every point's FLOPs counted by `torch.utils.flop_counter` equal the analytic
ones, the training mode counts training FLOPs and checks its targets, and the memory benchmark measures every point
in a fresh process and fits its slopes. Ratios and fits are checked against their samples; wall-clock times never
are."""

import json
import math
import mmap
import os
import platform
import subprocess
import sys

import pytest
import torch
from benchmark_support import BENCHMARKS, ENV, ROOT, import_benchmark, paired, run_script

from veca_hf.cpu.hardware import cpu_kind


SCRIPT = BENCHMARKS / "scaling.py"
RESOLUTIONS = (64, 96)
BUDGETS = (8, 16)
REPEATS = 2
TRAIN_REPEATS = 3


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


@pytest.mark.processes
def test_paired_ratios_are_medians_of_per_round_ratios(tiny_run):
    output_dir, _ = tiny_run
    result = json.loads((output_dir / "results.json").read_text())
    points = {(p["mode"], p["resolution"], p["label"]): p for p in result["points"]}
    label = f"VECA C={max(BUDGETS)}"
    for (mode, resolution, _name), point in points.items():
        dense = points[(mode, resolution, "DINOv3")]
        expected = paired(point["latency_ms"]["samples"], dense["latency_ms"]["samples"])
        assert point["paired_latency_ratio_vs_dinov3"] == pytest.approx(expected, rel=1e-9)
    for entry in result["summary"]:
        mode, small, large = entry["mode"], entry["reference_resolution"], entry["largest_resolution"]
        assert (
            entry["ratios"][str(large)]["paired_latency_ratio"]
            == points[(mode, large, label)]["paired_latency_ratio_vs_dinov3"]
        )
        for model, key in ((label, "veca"), ("DINOv3", "dinov3")):
            big, ref = points[(mode, large, model)], points[(mode, small, model)]
            per_round = paired(big["latency_ms"]["samples"], ref["latency_ms"]["samples"])
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
    scaling = import_benchmark("scaling")
    from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTAttention

    from veca_hf.model.modeling_veca import VecaCorePeripheryAttention

    args = scaling.parse_args(["--size", "veca-b16", "--output_dir", "unused"])
    veca_config, dinov3_config = import_benchmark("common").model_configs(args.size, budgets=args.budgets)
    with torch.device("meta"):
        veca_block = VecaCorePeripheryAttention(veca_config).eval()
        dinov3_block = DINOv3ViTAttention(dinov3_config).eval()
    veca_args, veca_kwargs = scaling.make_veca_block_inputs(veca_config, 1, 1024, 1024, 64, torch.float32, "meta")
    dense_args, dense_kwargs = scaling.make_dinov3_block_inputs(dinov3_config, 1, 1024, 1024, torch.float32, "meta")
    assert scaling.count_call(lambda: veca_block(*veca_args, **veca_kwargs)) == 21_252_538_368
    assert round(scaling.count_call(lambda: dinov3_block(*dense_args, **dense_kwargs)) / 1e9, 3) == 71.016


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
    common = import_benchmark("common")
    with mmap.mmap(-1, 64 * 2**20) as fresh:
        before = common.minor_page_faults()
        fresh.write(b"\x01" * len(fresh))
        assert common.minor_page_faults() - before >= 32


# --- training mode ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("train")
    completed = run_script(
        "scaling.py", "--tiny", "--size", "veca-s16", "--num_hidden_layers", "1", "--mode", "train",
        "--resolutions", "64,96", "--budgets", ",".join(map(str, BUDGETS)), "--warmup", "0",
        "--repeats", str(TRAIN_REPEATS), "--profile_repeats", "1", "--threads", "1", "--gemm_size", "128",
        "--gemm_repeats", "1", "--bf16_probe_size", "64", "--no_plots", "--output_dir", str(output_dir),
    )  # fmt: skip
    return json.loads((output_dir / "results.json").read_text()), completed.stdout


@pytest.mark.processes
def test_train_mode_counts_training_flops(train_run):
    result, stdout = train_run
    from veca_hf import VecaConfig
    from veca_hf.flops import dinov3_model_flops, patch_embedding_flops, veca_model_flops
    from veca_hf.training.distillation import full_attention_student_config

    common = import_benchmark("common")
    config = VecaConfig.from_preset("veca-s16", **{**common.TINY, "num_hidden_layers": 1})  # --num_hidden_layers 1
    dense = full_attention_student_config(config)
    assert len(result["points"]) == 2 * (1 + len(BUDGETS))
    assert (
        result["models"]["dense_student"]["use_gated_mlp"]
        and result["models"]["dense_student"]["num_hidden_layers"] == 1
    )
    for p in result["points"]:
        assert p["error"] is None and p["flops_counted"] == p["flops_analytic"] and p["flops_match"], p
        r = p["resolution"]
        forward = (
            dinov3_model_flops(dense, r, r) if p["model"] == "DINOv3" else veca_model_flops(config, r, r, p["budget"])
        )
        # the backward doubles every matmul except the patch embedding's (the image needs no gradient)
        assert p["flops_analytic"] == 3 * forward - patch_embedding_flops(config, r, r)
        assert len(p["latency_ms"]["samples"]) == TRAIN_REPEATS and p["images_per_s"] > 0
        if p["model"] == "DINOv3":  # the dense student: one CLS token, no registers
            assert p["num_tokens"] == p["num_patches"] + 1
    assert "Training targets" in stdout
    assert result["machine"]["bf16"]["mm_size"] == 64 and "fast_bf16" in result["machine"]["bf16"]
    assert result["machine"]["cpu_kind"] == cpu_kind() == result["machine"]["bf16"]["cpu_kind"]


@pytest.mark.processes
def test_train_mode_paired_ratios_are_medians_of_per_round_ratios(train_run):
    result, _ = train_run
    points = {(p["resolution"], p["label"]): p for p in result["points"]}
    for (resolution, _label), point in points.items():
        dense = points[(resolution, "DINOv3")]["latency_ms"]["samples"]
        expected = paired(point["latency_ms"]["samples"], dense)
        assert point["paired_latency_ratio_vs_dinov3"] == pytest.approx(expected, rel=1e-12)
    targets = result["train_targets"]
    assert len(targets) == 2 * (len(BUDGETS) + 1)
    for t in targets:
        if isinstance(t["budget"], list):  # step time at the smallest budget over the largest
            small, large = (points[(t["resolution"], f"VECA C={c}")]["latency_ms"]["samples"] for c in t["budget"])
            assert t["paired_ratio"] == pytest.approx(paired(small, large), rel=1e-12) and t["limit"] == 1.0
            numerators, denominators = small, large
        else:
            point = points[(t["resolution"], f"VECA C={t['budget']}")]
            assert t["paired_ratio"] == point["paired_latency_ratio_vs_dinov3"]
            assert t["limit"] == pytest.approx(point["flop_ratio_vs_dinov3"] + 0.03)
            numerators = point["latency_ms"]["samples"]
            denominators = points[(t["resolution"], "DINOv3")]["latency_ms"]["samples"]
        within = sum(a / b <= t["limit"] for a, b in zip(numerators, denominators, strict=True))
        assert t["rounds_within_limit"] == f"{within}/{TRAIN_REPEATS}"
        assert t["met"] == (t["paired_ratio"] <= t["limit"])
        assert t["target_resolution"] == (t["resolution"] in (512, 768)) or isinstance(t["budget"], list)


@pytest.mark.parametrize("budget", [None, 8, 16])
def test_counted_training_flops_equal_three_forwards_minus_patch_embedding(budget):
    """On the meta device: forward + backward of StudentWithLoss, counted, equals `3 F - patch embedding`."""
    from transformers import DINOv3ViTModel

    from veca_hf import VecaConfig, VecaModel
    from veca_hf.flops import count_training_flops, dinov3_training_flops, veca_training_flops
    from veca_hf.training.distillation import DistillationLoss, StudentWithLoss, full_attention_student_config

    config = VecaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=170,
                        core_bank_size=16, core_chunk_size=8)  # fmt: skip
    with torch.device("meta"):
        student = DINOv3ViTModel(full_attention_student_config(config)) if budget is None else VecaModel(config)
        module = StudentWithLoss(student, DistillationLoss(64, 64)).train()
        x, cls, patches = torch.empty(2, 3, 64, 96), torch.empty(2, 64), torch.empty(2, 24, 64)
    counted = count_training_flops(lambda: module(x, budget, cls, patches)["loss"])
    if budget is None:
        assert counted == dinov3_training_flops(full_attention_student_config(config), 64, 96, batch_size=2)
    else:
        assert counted == veca_training_flops(config, 64, 96, budget, batch_size=2)


@pytest.mark.processes
def test_train_mode_rejects_bf16_weights():
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "scaling.py"), "--mode", "train", "--dtype", "bf16"],
                               cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert completed.returncode == 2 and "bf16_autocast" in completed.stderr


# --- scaling.py ---------------------------------------------------------------------------------------------


def test_loglog_fit_recovers_slopes():
    scaling = import_benchmark("scaling")
    xs = [256, 1024, 4096]
    assert scaling.fit_loglog(xs, [3.0 * x for x in xs])["slope"] == pytest.approx(1.0)
    fit = scaling.fit_loglog(xs, [0.5 * x**2 for x in xs])
    assert fit["slope"] == pytest.approx(2.0) and fit["r2"] == pytest.approx(1.0)
    assert math.exp(fit["log_intercept"]) == pytest.approx(0.5)
    assert scaling.fit_loglog([256], [1.0]) is None


def test_largest_resolution_extrapolates_at_least_linearly():
    scaling = import_benchmark("scaling")
    points = [{"resolution": r, "num_patches": (r // 16) ** 2, "before_mb": 1000.0, "peak_mb": 1000.0 + n,
               "call_peak_mb": float(n)} for r, n in ((512, 1024), (1024, 4096))]  # fmt: skip
    fit = scaling.fit_loglog([1024, 4096], [1024.0, 4096.0])
    entry = scaling.largest_resolution(points, fit, limit_mb=1000.0 + 16384)
    # 1 MB per patch over a 1000 MB base: 16384 patches = 128 x 128 patches = 2048 px
    assert entry["extrapolated"] and entry["resolution"] == 2048 and entry["slope_used"] == 1.0
    entry = scaling.largest_resolution(points, fit, limit_mb=1000.0 + 2000)
    assert entry == {"resolution": 512, "extrapolated": False, "note": "measured: 1024 px did not fit or failed"}


@pytest.mark.processes
def test_memory_mode_reports_positive_peaks_and_slopes(tmp_path):
    run_script("scaling.py", "--mode", "memory", "--tiny", "--resolutions", "64,128", "--train_resolutions", "64,96",
               "--threads", "1", "--fit_min_patches", "1", "--output_dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert len(result["points"]) == 2 * 2 + 2 * 2
    for p in result["points"]:
        assert p.get("error") is None, p
        assert p["peak_mb"] > 0 and p["call_peak_mb"] >= 0 and p["weights_mb"] > 0 and p["method"]
        assert p["peak_mb"] >= p["call_peak_mb"]
    for key in ("inference/VECA", "inference/DINOv3", "train/VECA", "train/DINOv3"):
        assert isinstance(result["summary"]["fits"][key]["slope"], float), key
    assert set(result["summary"]["largest_resolution"]) == {"inference/VECA", "inference/DINOv3"}
    assert (tmp_path / "memory_vs_resolution.png").read_bytes()[:4] == b"\x89PNG"
