"""benchmarks/cpu_distillation_arms.py --smoke: three arms (AdamW; the paper's recipe; another resolution and length)
through distillation, probes, alignment and the report, on tiny models and generated data; a second call skips
every finished arm."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
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
        patches = arm["gaps"]["patches cosine to the teacher (heldout_photos): VECA C=16 - dense"]
        assert patches["interval"][0] <= patches["value"] <= patches["interval"][1]  # per-image values, paired
        assert isinstance(arm["goal"]["met"], bool)
        assert [row["step"] for row in arm["gap_history"]] == [h["step"] for h in arm["validation_history"]["veca"]]
    # what each factor does to the gap, against arm 1, on the same test images
    assert set(summary["effects"]) == {"recipe", "N = 4C (224 px, 500 steps)"}
    for effect in summary["effects"].values():
        for name in ("20-NN (points)", "patch cosine, photos", "global cosine, FMNIST"):
            row = effect["measures"][name]
            assert row["change"] == pytest.approx(row["gap"] - row["baseline_gap"])
            assert row["interval"][0] - 1e-9 <= row["change"] <= row["interval"][1] + 1e-9
        assert effect["measures"]["held-out loss (% of dense)"]["interval"] is None
    # arm 4 trains 2 steps, arm 1 4: the held-out loss compares at equal steps (arm 1's curve at step 2), the probes
    # with arm 1's end
    baseline_curve = {row["step"]: row for row in summary["arms"][0]["gap_history"]}
    for name, row in summary["effects"]["N = 4C (224 px, 500 steps)"]["measures"].items():
        if name.startswith("held-out"):
            term = name.removeprefix("held-out ").removesuffix(" (% of dense)")
            assert row["baseline_step"] == 2 and row["baseline_gap"] == pytest.approx(baseline_curve[2][term])
        else:
            assert row["baseline_step"] == 4
    assert summary["effects"]["recipe"]["measures"]["held-out loss (% of dense)"]["baseline_step"] == 4
    # the arms really differ: the recipe arm ran NorMuon and copied the patch embedding; arm 4 another resolution
    recipe = summary["arms"][1]
    assert recipe["settings"]["distill_flags"]["optimizer"] == "normuon"
    log = tmp_path / "study" / "arms" / "4x384-paper-recipe" / "logs" / "distill_veca.log"
    assert "NorMuon for" in log.read_text() and "Patch embedding copied from the teacher" in log.read_text()
    assert summary["arms"][2]["settings"]["resolution"] == 48
    markdown = (results_dir / "study.md").read_text()
    assert "3. 4x384-paper-recipe" in markdown and "goal" in markdown and "What each factor does" in markdown
    assert (results_dir / "curves.png").stat().st_size > 10_000
    assert "correct" not in json.dumps(json.loads((results_dir / "study.json").read_text())["arms"][0]["probes"])

    # an arm finished before the alignment kept per-image values gets them measured again, nothing else rerun
    arm_json = results_dir / "arms" / "1-4x384-adamw.json"
    old = json.loads(arm_json.read_text())
    for row in old["alignment"]:
        for feature in ("global", "patches"):
            row.get(feature, {}).pop("per_image", None)
            row.get(feature, {}).pop("per_image_centred", None)
    arm_json.write_text(json.dumps(old))
    (tmp_path / "study" / "arms" / "4x384-adamw" / "alignment.json").write_text(json.dumps(old["alignment"]))
    capsys.readouterr()
    again = arms.main(argv)
    out = capsys.readouterr().out
    assert out.count("done already") == 3 and out.count("measuring its alignment per image") == 1
    assert again["arms"][0]["gaps"] == summary["arms"][0]["gaps"]
    assert again["effects"] == summary["effects"]


def test_per_image_cosines_average_to_the_set_cosines():
    from veca_hf import evaluation

    arms = load_arms()
    generator = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(2, 5, 3, 3, 8, generator=generator).unbind(0)  # (N, Hp, Wp, D)
    student = student + teacher  # correlated
    pairs = [(student, teacher, evaluation.patch_feature_cosine), (student[:, 0, 0], teacher[:, 0, 0],
             evaluation.global_feature_cosine)]  # fmt: skip
    for features, targets, whole_set in pairs:
        per_image, whole = arms.per_image_cosines(features, targets), whole_set(features, targets)
        assert len(per_image["per_image"]) == 5
        assert sum(per_image["per_image"]) / 5 == pytest.approx(whole["cosine"], abs=1e-6)
        assert sum(per_image["per_image_centred"]) / 5 == pytest.approx(whole["centred_cosine"], abs=1e-6)


def test_unknown_arm_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown arm"):
        load_arms().main(["--fashion_mnist_dir", str(tmp_path), "--arms", "9", "--output_dir", str(tmp_path)])
