"""benchmarks/cpu_distillation_arms.py --smoke: three arms (AdamW; the paper's recipe; another resolution and length)
through distillation, probes, alignment and the report, on tiny models and generated data; a second call skips
every finished arm."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from test_cpu_distillation_study import study_inputs  # noqa: F401 (the fixture)


ROOT = Path(__file__).parent.parent


def load_arms():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "cpu_distillation_arms", ROOT / "benchmarks" / "cpu_distillation_arms.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_arms_write_gaps_curves_and_skip_finished_arms(study_inputs, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    arms = load_arms()
    results_dir = tmp_path / "results"
    argv = ["--smoke", "--teacher_name_or_path", str(study_inputs / "teacher"),
            "--photos_dir", str(study_inputs / "photos"), "--fashion_mnist_dir", str(study_inputs / "fashion-mnist"),
            "--output_dir", str(tmp_path / "study"), "--results_dir", str(results_dir), "--arms", "1,3,4"]  # fmt: skip
    summary = arms.main(argv)

    assert [arm["name"] for arm in summary["arms"]] == ["4x384-adamw", "4x384-paper-recipe", "4x384-224px"]
    for arm in summary["arms"]:
        # held-out loss and its terms at every validation, for both students
        for kind, label in (("veca", "16"), ("dense", "dense")):
            history = arm["validation_history"][kind]
            assert [h["step"] for h in history] == list(range(0, arm["settings"]["max_train_steps"] + 1, 2))
            assert set(history[-1]["losses"][label]) == {"loss", "global_loss", "dense_cosine_loss", "dense_mse_loss"}
        # VECA minus dense, with paired intervals on the probes, and the patch cosines
        knn = arm["gaps"]["knn: VECA C=16 - dense"]
        assert knn["interval"][0] <= knn["value"] <= knn["interval"][1]
        assert "held-out dense_cosine_loss: VECA C=16 / dense - 1" in arm["gaps"]
        assert "patches cosine to the teacher (heldout_photos): VECA C=16 - dense" in arm["gaps"]
        assert isinstance(arm["goal"]["met"], bool)
    # the arms really differ: the recipe arm ran NorMuon and copied the patch embedding; arm 4 another resolution
    recipe = summary["arms"][1]
    assert recipe["settings"]["distill_flags"]["optimizer"] == "normuon"
    log = tmp_path / "study" / "arms" / "4x384-paper-recipe" / "logs" / "distill_veca.log"
    assert "NorMuon for" in log.read_text() and "Patch embedding copied from the teacher" in log.read_text()
    assert summary["arms"][2]["settings"]["resolution"] == 48
    markdown = (results_dir / "study.md").read_text()
    assert "3. 4x384-paper-recipe" in markdown and "goal" in markdown
    assert (results_dir / "curves.png").stat().st_size > 10_000
    assert "correct" not in json.dumps(json.loads((results_dir / "study.json").read_text())["arms"][0]["probes"])

    capsys.readouterr()
    again = arms.main(argv)
    assert capsys.readouterr().out.count("done already") == 3
    assert again["arms"][0]["gaps"] == summary["arms"][0]["gaps"]


def test_unknown_arm_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown arm"):
        load_arms().main(["--fashion_mnist_dir", str(tmp_path), "--arms", "9", "--output_dir", str(tmp_path)])
