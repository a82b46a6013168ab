"""studies/cpu_distillation/arms.py --smoke: two configurations (AdamW; the paper's recipe) through distillation,
probes, alignment and the report, on tiny models and generated data; a second call skips the finished runs and adds
a second seed. A configuration of another resolution and length is compared at equal steps from the same runs."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from test_cpu_distillation_study import study_inputs  # noqa: F401 (the fixture)


ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.slow  # a study, not a unit: minutes of distillation in subprocesses


def load_arms():
    sys.path.insert(0, str(ROOT / "studies" / "cpu_distillation"))
    spec = importlib.util.spec_from_file_location("arms", ROOT / "studies" / "cpu_distillation" / "arms.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.processes
def test_smoke_runs_write_gaps_seed_spread_and_skip_finished_runs(study_inputs, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    arms = load_arms()
    monkeypatch.setattr(arms.base, "subprocess", warm_python.as_subprocess_module())  # stages forked, not started
    results_dir = tmp_path / "results"
    argv = ["--smoke", "--teacher_name_or_path", str(study_inputs / "teacher"),
            "--photos_dir", str(study_inputs / "photos"), "--fashion_mnist_dir", str(study_inputs / "fashion-mnist"),
            "--output_dir", str(tmp_path / "study"), "--results_dir", str(results_dir),
            "--configurations", "4x384-adamw,4x384-paper-recipe"]  # fmt: skip
    summary = arms.main(argv)

    assert [run["label"] for run in summary["runs"]] == ["4x384-adamw-seed0", "4x384-paper-recipe-seed0"]
    for run in summary["runs"]:
        assert run["seed"] == 0 and run["settings"]["distill_seed"] == 0
        # held-out loss and its terms at every validation, for both students
        for kind, label in (("veca", "16"), ("dense", "dense")):
            history = run["validation_history"][kind]
            assert [h["step"] for h in history] == list(range(0, run["settings"]["max_train_steps"] + 1, 2))
            assert set(history[-1]["losses"][label]) == {"loss", "global_loss", "dense_cosine_loss", "dense_mse_loss"}
        # VECA minus dense, with paired intervals on the probes, and the patch cosines
        knn = run["gaps"]["knn: VECA C=16 - dense"]
        assert knn["interval"][0] <= knn["value"] <= knn["interval"][1]
        assert "held-out dense_cosine_loss: VECA C=16 / dense - 1" in run["gaps"]
        patches = run["gaps"]["patches cosine to the teacher (heldout_photos): VECA C=16 - dense"]
        assert patches["interval"][0] <= patches["value"] <= patches["interval"][1]  # per-image values, paired
        assert isinstance(run["goal"]["met"], bool)
        assert [row["step"] for row in run["gap_history"]] == [h["step"] for h in run["validation_history"]["veca"]]
    # what each factor does to the gap, against the baseline, on the same test images
    assert set(summary["effects"]) == {"recipe"}
    # a configuration that trains 2 steps where the baseline trains 4 (the baseline's run, stopped at step 2)
    baseline = json.loads((results_dir / "runs" / "4x384-adamw-seed0.json").read_text())  # with per-image values
    shorter = {**baseline, "name": "4x384-224px", "settings": {**baseline["settings"], "max_train_steps": 2}}
    effects = {
        **summary["effects"],
        **arms.factor_effects({("4x384-adamw", 0): baseline, ("4x384-224px", 0): shorter}, 16),
    }
    assert set(effects) == {"recipe", "N = 4C (224 px, 500 steps)"}
    for effect in effects.values():
        assert effect["baseline"] == "4x384-adamw" and effect["seed"] == 0
        for name in ("20-NN (points)", "patch cosine, photos", "global cosine, FMNIST"):
            row = effect["measures"][name]
            assert row["change"] == pytest.approx(row["gap"] - row["baseline_gap"])
            assert row["interval"][0] - 1e-9 <= row["change"] <= row["interval"][1] + 1e-9
        assert effect["measures"]["held-out loss (% of dense)"]["interval"] is None
    # the held-out loss compares at equal steps (the baseline's curve at step 2), the probes with the baseline's end
    baseline_curve = {row["step"]: row for row in summary["runs"][0]["gap_history"]}
    for name, row in effects["N = 4C (224 px, 500 steps)"]["measures"].items():
        if name.startswith("held-out"):
            term = name.removeprefix("held-out ").removesuffix(" (% of dense)")
            assert row["baseline_step"] == 2 and row["baseline_gap"] == pytest.approx(baseline_curve[2][term])
        else:
            assert row["baseline_step"] == 4
    # the configurations really differ: the recipe ran NorMuon and copied the patch embedding
    recipe = summary["runs"][1]
    assert recipe["settings"]["distill_flags"]["optimizer"] == "normuon"
    log = tmp_path / "study" / "runs" / "4x384-paper-recipe" / "seed0" / "logs" / "distill_veca.log"
    assert "NorMuon for" in log.read_text() and "Patch embedding copied from the teacher" in log.read_text()
    assert summary["seed_spread"] == {}  # one seed each
    markdown = (results_dir / "study.md").read_text()
    assert "4x384-paper-recipe-seed0" in markdown and "goal" in markdown and "What each factor does" in markdown
    assert (results_dir / "curves.png").stat().st_size > 10_000
    assert "correct" not in json.dumps(json.loads((results_dir / "study.json").read_text())["runs"][0]["probes"])

    # a second seed of one configuration: only that run is distilled; the report spreads its gaps over the seeds
    capsys.readouterr()
    again = arms.main(argv[:-1] + ["4x384-paper-recipe", "--seeds", "0,1"])
    out = capsys.readouterr().out
    assert out.count("done already") == 1 and "[4x384-paper-recipe-seed1]" in out
    assert len(again["runs"]) == 3  # the report covers every finished run
    seed0, seed1 = (next(r for r in again["runs"] if r["label"] == f"4x384-paper-recipe-seed{s}") for s in (0, 1))
    assert seed1["settings"]["distill_seed"] == 1 and "--seed 1" in seed1["commands"]["veca"]
    # committed results name this machine's paths by what they are
    assert "--output_dir OUTPUT_DIR/runs/4x384-paper-recipe/seed1/veca" in seed1["commands"]["veca"]
    assert str(tmp_path) not in json.dumps(seed1["commands"]) + json.dumps(seed1["settings"])
    assert seed0["validation"] != seed1["validation"]  # another initialisation and data order
    assert seed0["settings"]["photo_crops"] == seed1["settings"]["photo_crops"]  # the same pool
    spread = again["seed_spread"]["4x384-paper-recipe"]
    row = spread["measures"]["held-out loss (% of dense)"]
    per_seed = [r["gaps"]["held-out loss: VECA C=16 / dense - 1"]["value"] for r in (seed0, seed1)]
    assert list(row["per_seed"].values()) == pytest.approx(per_seed)
    assert row["mean"] == pytest.approx(sum(per_seed) / 2) and row["min"] == min(per_seed)
    assert row["t_interval"][0] <= row["mean"] <= row["t_interval"][1]
    assert isinstance(spread["knn_within_1_point_in_every_seed"], bool)
    # the recipe's students measured at other resolutions without retraining (their own JSON keeps the per-image
    # values; the report the paired gaps)
    transfer = seed1["transfer"]
    assert [row["resolution"] for row in transfer["rows"]] == [32, 64]
    for row in transfer["rows"]:
        assert set(row["models"]) == {"veca C=8", "veca C=16", "dense", "teacher"}
        assert all(m["seconds_per_image"] > 0 for m in row["models"].values())
        gap = row["patches gap VECA C=16 - dense"]
        assert gap["interval"][0] - 1e-9 <= gap["value"] <= gap["interval"][1] + 1e-9
        veca, dense = row["models"]["veca C=16"], row["models"]["dense"]
        assert gap["value"] == pytest.approx(veca["patches"] - dense["patches"], abs=1e-6)
    fall = transfer["patch_cosine_fall"]
    assert fall["veca minus dense"]["value"] == pytest.approx(fall["veca"] - fall["dense"], abs=1e-6)
    assert set(transfer["knn"]) == {"32", "64"} and transfer["knn_samples"] == 24
    assert "resolution_transfer" in json.loads((results_dir / "runs" / "4x384-paper-recipe-seed1.json").read_text())
    assert "Resolution transfer of **4x384-paper-recipe-seed1**" in (results_dir / "study.md").read_text()
    assert all(run.get("transfer") is None for run in again["runs"] if run["name"] != "4x384-paper-recipe")
    assert "Over the seeds of **4x384-paper-recipe**" in (results_dir / "study.md").read_text()


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


def test_unknown_configuration_or_bad_seeds_are_clear_errors(tmp_path):
    arms = load_arms()
    with pytest.raises(ValueError, match="unknown configuration"):
        arms.main(["--fashion_mnist_dir", str(tmp_path), "--configurations", "9", "--output_dir", str(tmp_path)])
    for seeds in ("0,x", "1,1", ""):
        with pytest.raises(ValueError, match="--seeds"):
            arms.main(["--fashion_mnist_dir", str(tmp_path), "--seeds", seeds, "--output_dir", str(tmp_path)])
