"""`benchmarks/throughput.py` on tiny models: `pipeline` (the pipeline, a loop and the model alone agree), `dataset`
(the script end to end, the model and the data side), `distill` (a distillation step's parts and paired ratios) and
`resume` (the first batch of a resumed stream, with and without the positions a checkpoint holds)."""

import json
import statistics

import pytest
from benchmark_support import paired, run_script


@pytest.mark.processes
def test_pipeline_loop_and_model_agree(tmp_path):
    run_script("throughput.py", "pipeline", "--tiny", "--resolutions", "64", "--batch_sizes", "2", "--budgets", "8,16",
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
def test_dataset_times_the_script_the_model_and_the_data(tmp_path):
    run_script("throughput.py", "dataset", "--tiny", "--resolutions", "64", "--dtypes", "fp32", "--processes", "1",
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


@pytest.mark.processes
def test_distill_step_breakdown_and_paired_ratios(tmp_path):
    run_script("throughput.py", "distill", "--tiny", "--resolutions", "64", "--batch_size", "2", "--budgets", "8,16",
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
        assert p["paired_ratio_vs_dense"] == pytest.approx(paired(samples, dense), rel=1e-12)
        assert sum(p["breakdown_share"].values()) == pytest.approx(1.0)
        assert p["images_per_s"] == pytest.approx(2 / statistics.median(samples))


@pytest.mark.processes
def test_resume_times_skip_and_replay(tmp_path):
    run_script("throughput.py", "resume", "--steps", "6", "--replay_steps", "3", "--batch_size", "2", "--resolution",
               "32", "--image_size", "48", "--num_shards", "2", "--dataloader_num_workers", "0",
               "--shuffle_buffer_size", "4", "--output_dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "resume_skip.json").read_text())
    assert len(list((tmp_path / "shards").glob("*.parquet"))) == 2
    for key in ("first_batch_seconds", "skip_seconds", "replay_seconds_measured"):
        assert result[key] > 0
    extra = result["replay_seconds_measured"] - result["first_batch_seconds"]
    assert result["replay_seconds_scaled"] == pytest.approx(result["first_batch_seconds"] + extra * 6 / 3)
