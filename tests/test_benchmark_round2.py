"""Smoke tests of the benchmarks: training mode of `benchmarks/scaling.py`, `memory_scaling.py`,
`precision_check.py`, `int8_check.py`, `distill_step.py`, `attention_kernels.py` and `gpu_check.sh`. FLOP counts,
JSON structure and the arithmetic of the reported ratios and fits are asserted; wall-clock times never are."""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_pil_images

from veca_hf.cpu.hardware import cpu_kind


ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
BUDGETS = (8, 16)
REPEATS = 3


def run_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    completed = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], cwd=ROOT, env=ENV,
                               capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed


def import_benchmark(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def _paired(numerators, denominators):
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


# --- scaling.py --mode train ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("train")
    completed = run_script(
        "scaling.py", "--tiny", "--size", "veca-s16", "--num_hidden_layers", "1", "--mode", "train",
        "--resolutions", "64,96", "--budgets", ",".join(map(str, BUDGETS)), "--warmup", "0",
        "--repeats", str(REPEATS), "--profile_repeats", "1", "--threads", "1", "--gemm_size", "128",
        "--gemm_repeats", "1", "--bf16_probe_size", "64", "--no_plots", "--output_dir", str(output_dir),
    )  # fmt: skip
    return json.loads((output_dir / "results.json").read_text()), completed.stdout


@pytest.mark.processes
def test_train_mode_counts_training_flops(train_run):
    result, stdout = train_run
    from veca_hf import VecaConfig
    from veca_hf.flops import dinov3_model_flops, patch_embedding_flops, veca_model_flops
    from veca_hf.training.distillation import dense_student_config

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import scaling
    finally:
        sys.path.remove(str(BENCHMARKS))
    config = VecaConfig.from_preset("veca-s16", **{**scaling.TINY, "num_hidden_layers": 1})  # --num_hidden_layers 1
    dense = dense_student_config(config)
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
        assert len(p["latency_ms"]["samples"]) == REPEATS and p["images_per_s"] > 0
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
        expected = _paired(point["latency_ms"]["samples"], dense)
        assert point["paired_latency_ratio_vs_dinov3"] == pytest.approx(expected, rel=1e-12)
    targets = result["train_targets"]
    assert len(targets) == 2 * (len(BUDGETS) + 1)
    for t in targets:
        if isinstance(t["budget"], list):  # step time at the smallest budget over the largest
            small, large = (points[(t["resolution"], f"VECA C={c}")]["latency_ms"]["samples"] for c in t["budget"])
            assert t["paired_ratio"] == pytest.approx(_paired(small, large), rel=1e-12) and t["limit"] == 1.0
            numerators, denominators = small, large
        else:
            point = points[(t["resolution"], f"VECA C={t['budget']}")]
            assert t["paired_ratio"] == point["paired_latency_ratio_vs_dinov3"]
            assert t["limit"] == pytest.approx(point["flop_ratio_vs_dinov3"] + 0.03)
            numerators = point["latency_ms"]["samples"]
            denominators = points[(t["resolution"], "DINOv3")]["latency_ms"]["samples"]
        within = sum(a / b <= t["limit"] for a, b in zip(numerators, denominators, strict=True))
        assert t["rounds_within_limit"] == f"{within}/{REPEATS}"
        assert t["met"] == (t["paired_ratio"] <= t["limit"])
        assert t["target_resolution"] == (t["resolution"] in (512, 768)) or isinstance(t["budget"], list)


@pytest.mark.parametrize("budget", [None, 8, 16])
def test_counted_training_flops_equal_three_forwards_minus_patch_embedding(budget):
    """On the meta device: forward + backward of StudentWithLoss, counted, equals `3 F - patch embedding`."""
    from transformers import DINOv3ViTModel

    from veca_hf import VecaConfig, VecaModel
    from veca_hf.flops import count_training_flops, dinov3_training_flops, veca_training_flops
    from veca_hf.training.distillation import DistillationLoss, StudentWithLoss, dense_student_config

    config = VecaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=170,
                        core_bank_size=16, core_chunk_size=8)  # fmt: skip
    with torch.device("meta"):
        student = DINOv3ViTModel(dense_student_config(config)) if budget is None else VecaModel(config)
        module = StudentWithLoss(student, DistillationLoss(64, 64)).train()
        x, cls, patches = torch.empty(2, 3, 64, 96), torch.empty(2, 64), torch.empty(2, 24, 64)
    counted = count_training_flops(lambda: module(x, budget, cls, patches)["loss"])
    if budget is None:
        assert counted == dinov3_training_flops(dense_student_config(config), 64, 96, batch_size=2)
    else:
        assert counted == veca_training_flops(config, 64, 96, budget, batch_size=2)


@pytest.mark.processes
def test_train_mode_rejects_bf16_weights():
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "scaling.py"), "--mode", "train", "--dtype", "bf16"],
                               cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert completed.returncode == 2 and "bf16_autocast" in completed.stderr


# --- memory_scaling.py ---------------------------------------------------------------------------------------------


def test_loglog_fit_recovers_slopes():
    memory_scaling = import_benchmark("memory_scaling")
    xs = [256, 1024, 4096]
    assert memory_scaling.fit_loglog(xs, [3.0 * x for x in xs])["slope"] == pytest.approx(1.0)
    fit = memory_scaling.fit_loglog(xs, [0.5 * x**2 for x in xs])
    assert fit["slope"] == pytest.approx(2.0) and fit["r2"] == pytest.approx(1.0)
    assert math.exp(fit["log_intercept"]) == pytest.approx(0.5)
    assert memory_scaling.fit_loglog([256], [1.0]) is None


def test_largest_resolution_extrapolates_at_least_linearly():
    memory_scaling = import_benchmark("memory_scaling")
    points = [{"resolution": r, "num_patches": (r // 16) ** 2, "before_mb": 1000.0, "peak_mb": 1000.0 + n,
               "call_peak_mb": float(n)} for r, n in ((512, 1024), (1024, 4096))]  # fmt: skip
    fit = memory_scaling.fit_loglog([1024, 4096], [1024.0, 4096.0])
    entry = memory_scaling.largest_resolution(points, fit, limit_mb=1000.0 + 16384)
    # 1 MB per patch over a 1000 MB base: 16384 patches = 128 x 128 patches = 2048 px
    assert entry["extrapolated"] and entry["resolution"] == 2048 and entry["slope_used"] == 1.0
    entry = memory_scaling.largest_resolution(points, fit, limit_mb=1000.0 + 2000)
    assert entry == {"resolution": 512, "extrapolated": False, "note": "measured: 1024 px did not fit or failed"}


@pytest.mark.processes
def test_memory_mode_reports_positive_peaks_and_slopes(tmp_path):
    run_script("memory_scaling.py", "--tiny", "--resolutions", "64,128", "--train_resolutions", "64,96",
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


# --- precision_check.py, distill_step.py ---------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("inputs", ["noise", "images"])
def test_precision_check_reports_cosines(tmp_path, inputs):
    output = tmp_path / "precision.json"
    extra = []
    if inputs == "images":  # real-image path: a folder of (generated) photos through the processor
        for index, image in enumerate(random_pil_images(3, size=(90, 70))):
            image.save(tmp_path / f"{index}.png")
        extra = ["--images_dir", str(tmp_path), "--batch_size", "3"]
    run_script("precision_check.py", "--tiny", "--resolutions", "64", "--threads", "1", "--bf16_probe_size", "0",
               "--output", str(output), *extra)  # fmt: skip
    result = json.loads(output.read_text())
    assert result["inputs"] == (str(tmp_path) if inputs == "images" else "gaussian noise")
    rows = {(r["model"], r["check"]): r for r in result["rows"]}
    assert set(rows) == {(m, c) for m in ("VECA", "DINOv3") for c in ("bf16_autocast", "bf16_weights", "eager_sdpa")}
    for (_model, check), row in rows.items():
        assert 0.99 < row["last_hidden_state_cosine_min"] <= row["last_hidden_state_cosine_mean"] <= 1.0 + 1e-6
        if check == "eager_sdpa":  # fp32: the two backends agree to rounding
            assert row["relative_error"] < 1e-4
    assert result["machine"]["bf16"]["flags"] is not None or sys.platform != "linux"


def test_precision_check_images_dir_with_too_few_images_names_the_fix(tmp_path):
    precision_check = import_benchmark("precision_check")
    random_pil_images(1)[0].save(tmp_path / "only.png")
    with pytest.raises(ValueError, match="holds 1 images, fewer than --batch_size 2"):
        precision_check.load_images(str(tmp_path), 2)
    processor_input = precision_check.make_inputs(
        precision_check.parse_args(["--tiny"]), 32, precision_check.load_images(str(tmp_path), 1)
    )
    assert processor_input.shape == (1, 3, 32, 32)


@pytest.mark.processes
def test_distill_step_breakdown_and_paired_ratios(tmp_path):
    run_script("distill_step.py", "--tiny", "--resolutions", "64", "--batch_size", "2", "--budgets", "8,16",
               "--warmup", "0", "--repeats", "3", "--threads", "1", "--teacher_dtype", "bf16",
               "--output_dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["teacher_bf16_vs_fp32"]["64"]["patch_cosine_min"] > 0.99
    points = {p["student"]: p for p in result["points"]}
    assert set(points) == {"dense", "VECA C=8", "VECA C=16"}
    dense = points["dense"]["step_s"]["samples"]
    for p in points.values():
        samples = p["step_s"]["samples"]
        assert samples == pytest.approx([sum(parts.values()) for parts in p["parts_samples"]])
        assert p["paired_ratio_vs_dense"] == pytest.approx(_paired(samples, dense), rel=1e-12)
        assert sum(p["breakdown_share"].values()) == pytest.approx(1.0)
        assert p["images_per_s"] == pytest.approx(2 / statistics.median(samples))


@pytest.mark.processes
def test_feature_extraction_pipeline_loop_and_model_agree(tmp_path):
    run_script("feature_extraction.py", "--tiny", "--resolutions", "64", "--batch_sizes", "2", "--budgets", "8,16",
               "--num_images", "4", "--rounds", "2", "--image_size", "96x80", "--threads", "1",
               "--output_dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    cells = {(c["model"], c["path"]): c for c in result["cells"]}
    assert set(cells) == {(m, p) for m in ("DINOv3", "VECA C=8", "VECA C=16") for p in ("pipeline", "loop", "model")}
    for cell in cells.values():
        assert len(cell["seconds"]) == 2
        assert cell["images_per_s"] == pytest.approx(4 / statistics.median(cell["seconds"]))
        assert cell["max_abs_difference_to_pipeline"] <= 1e-5  # three ways to the same features
    for entry in result["summary"]:
        dinov3 = cells[("DINOv3", entry["path"])]["images_per_s"]
        assert entry["speedup_vs_dinov3"] == pytest.approx(entry["images_per_s"] / dinov3)
    assert result["machine"]["cpu_allocator"]["settings"]["M_MMAP_MAX"] == 0
    assert "| 64 | 2 | VECA C=16 |" in (tmp_path / "results.md").read_text()


@pytest.mark.processes
def test_research_form_computes_veca_and_is_timed_in_pairs(tmp_path):
    run_script("research_form.py", "--tiny", "--resolutions", "64,96", "--budget", "16", "--warmup", "0",
               "--repeats", "3", "--threads", "1", "--output_dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert [p["resolution"] for p in result["points"]] == [64, 96]
    for point in result["points"]:
        assert point["max_abs_difference"] < 1e-4  # the converted weights give the research form's outputs
        veca, research = point["seconds"]["VECA"], point["seconds"]["research form"]
        assert len(veca) == len(research) == 3
        assert point["paired_ratio"] == pytest.approx(_paired(veca, research), rel=1e-12)


@pytest.mark.processes
def test_research_form_times_training_steps_under_autocast(tmp_path):
    run_script("research_form.py", "--tiny", "--num_hidden_layers", "1", "--mode", "train", "--dtype",
               "bf16_autocast", "--resolutions", "64", "--budget", "16", "--warmup", "1", "--repeats", "2",
               "--threads", "1", "--output_dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    (point,) = result["points"]
    assert point["mode"] == "train" and point["dtype"] == "bf16_autocast"
    assert point["max_abs_difference"] < 1e-4  # compared in fp32 before the steps
    assert all(len(seconds) == 2 and min(seconds) > 0 for seconds in point["seconds"].values())
    assert "1 blocks, cpu, bf16_autocast, training step" in (tmp_path / "results.md").read_text()


@pytest.mark.processes
@pytest.mark.parametrize("backward", [False, True])
def test_attention_kernels_agree_and_are_timed_in_pairs(tmp_path, backward):
    run_script("attention_kernels.py", "--tiny", "--resolutions", "64", "--budgets", "8", "--dtypes", "fp32,bf16",
               "--rounds", "3", "--calls", "2", "--threads", "1", "--output_dir", str(tmp_path),
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
        assert point["paired_ratio"] == pytest.approx(_paired(seconds["matmul"], seconds["sdpa"]), rel=1e-12)
    markdown = (tmp_path / "results.md").read_text()
    assert ("forward + backward" in markdown) == backward
    assert f"| bf16 | 64 | {num_patches} | 8 | patches | {num_patches} x 8 |" in markdown


@pytest.mark.processes
def test_attention_kernels_rejects_unknown_dtype():
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "attention_kernels.py"), "--dtypes", "fp16"],
                               cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert completed.returncode == 2 and "--dtypes 'fp16'" in completed.stderr and "bf16" in completed.stderr


def test_research_code_clone_is_checked_and_loaded_without_timm(tmp_path):
    research_form = import_benchmark("research_form")
    with pytest.raises(ValueError, match="has no veca/model.py"):
        research_form.load_research_code(str(tmp_path))
    (tmp_path / "veca").mkdir()
    (tmp_path / "veca" / "model.py").write_text(
        "import timm\nimport torch.nn as nn\n\n\nclass VECA(nn.Module):\n    timm_module = timm\n"
    )
    had_timm = "timm" in sys.modules
    veca_class = research_form.load_research_code(str(tmp_path))
    assert veca_class.__name__ == "VECA" and issubclass(veca_class, torch.nn.Module)
    assert ("timm" in sys.modules) == had_timm  # a stand-in for a missing timm is removed again


def test_cpu_bf16_support_flags_only():
    from veca_hf.cpu.hardware import cpu_bf16_support

    info = cpu_bf16_support(measure_size=None)
    assert "mm_size" not in info and info["fast_bf16"] in (True, False, None)
    if info["flags"] is not None:
        assert info["fast_bf16"] == bool({"avx512_bf16", "amx_bf16"} & set(info["flags"]))


@pytest.mark.processes
def test_int8_check_times_compares_and_probes_every_candidate(tmp_path):
    pytest.importorskip("onnxruntime")
    from conftest import tiny_config

    from veca_hf import VecaModel

    torch.manual_seed(0)
    VecaModel(tiny_config()).save_pretrained(tmp_path / "tiny")
    (tmp_path / "photos").mkdir()
    for index, image in enumerate(random_pil_images(3, size=(90, 70))):
        image.save(tmp_path / "photos" / f"{index}.png")
    import numpy as np
    from conftest import write_idx

    (tmp_path / "fashion").mkdir()
    rng = np.random.default_rng(0)
    for prefix in ("train", "t10k"):
        write_idx(tmp_path / "fashion", prefix, 30, rng)
    run_script("int8_check.py", "--tiny", "--budget", "8", "--speed_resolutions", "64", "--rounds", "2",
               "--resolutions", "64", "--veca_model", str(tmp_path / "tiny"), "--images_dir", str(tmp_path / "photos"),
               "--num_images", "3", "--fashion_mnist_dir", str(tmp_path / "fashion"), "--probe_resolution", "64",
               "--probe_samples", "30", "--threads", "1", "--bf16_probe_size", "0",
               "--output_dir", str(tmp_path / "out"))  # fmt: skip
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    candidates = ["torch_int8_x86", "torch_int8_onednn", "onnxruntime_int8"]
    assert [row["runner"] for row in result["speed"]] == ["fp32", "bf16", *candidates]
    for row in result["speed"]:
        ratios = [a / b for a, b in zip(row["seconds"], result["speed"][0]["seconds"], strict=True)]
        assert len(row["seconds"]) == 2 and row["over_fp32"] == pytest.approx(statistics.median(ratios))
    assert [row["runner"] for row in result["fidelity"]] == candidates  # fp32 is the reference
    for row in result["fidelity"]:
        assert 0.9 < row["global_cosine_min"] <= row["global_cosine_mean"] + 1e-6 <= 1 + 2e-6
        assert 0.9 < row["patch_cosine_min"] <= row["patch_cosine_mean"] + 1e-6 <= 1 + 2e-6
    probes = {row["runner"]: row for row in result["probe"]}
    assert probes["fp32"]["minus_fp32"] == 0 and probes["fp32"]["minus_fp32_interval"] == [0, 0]
    for name, verdict in result["verdicts"].items():
        row = next(r for r in result["fidelity"] if r["runner"] == name)
        assert verdict["worst_cosine"] == min(row["global_cosine_min"], row["patch_cosine_min"])
        low, high = probes[name]["minus_fp32_interval"]
        assert verdict["fit_to_offer"] == (verdict["worst_cosine"] >= 0.99 and low <= 0 <= high)
    assert result["machine"]["bf16"]["flags"] is not None or sys.platform != "linux"


# --- model_revisions.py --------------------------------------------------------------------------------------------


@pytest.mark.processes
def test_model_revisions_times_a_revision_against_the_working_tree(tmp_path):
    """HEAD's model folder imported from git next to the working tree's: same weights, both timed, outputs compared."""
    run_script("model_revisions.py", "--before", "HEAD", "--tiny", "--resolutions", "32,48", "--budgets", "8,16",
               "--repeats", "3", "--warmup", "0", "--no_dinov3", "--threads", "1",
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


# --- gpu_check.sh --------------------------------------------------------------------------------------------------


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


@pytest.mark.processes
def test_dataset_embedding_times_the_script_the_model_and_the_data(tmp_path):
    run_script("dataset_embedding.py", "--tiny", "--resolutions", "64", "--dtypes", "fp32", "--processes", "1",
               "--num_images", "4", "--batch_size", "2", "--workers", "0", "--budgets", "8,16", "--threads", "1",
               "--output_dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    cells = {cell["model"]: cell for cell in result["cells"]}
    assert set(cells) == {"VECA C=8", "VECA C=16", "DINOv3"}
    for cell in cells.values():
        run = cell["end_to_end"]
        assert run["images"] == cell["data_only"]["images"] == 4  # every image, end to end and on the data side
        assert run["images_per_s"] == pytest.approx(run["images"] / run["seconds"])
        assert cell["share_not_model"] == pytest.approx(1 - run["images_per_s"] / cell["model_only"]["images_per_s"])
    assert result["args"]["output_dir"] == "OUTPUT_DIR" and str(tmp_path) not in result["command"]
    assert "| fp32 | 64 | VECA C=16 | 1 |" in (tmp_path / "results.md").read_text()
