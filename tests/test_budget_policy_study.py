"""studies/budget_policy/study.py on a tiny VECA and generated data: every fixed budget, the policy and the oracle
are scored, the policy's costs meet their targets, its real cascade picks what the policy picks (the study checks
and stops otherwise), and the table and plot are written."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config, tiny_dinov3_config, write_idx
from PIL import Image
from transformers import DINOv3ViTModel

from veca_hf import VecaModel


ROOT = Path(__file__).parent.parent


def load_study():
    spec = importlib.util.spec_from_file_location("budget_study", ROOT / "studies" / "budget_policy" / "study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_study_scores_fixed_budgets_policy_and_oracle(tmp_path):
    torch.manual_seed(0)
    VecaModel(tiny_config(core_bank_size=32, patch_size=8)).save_pretrained(tmp_path / "student")
    DINOv3ViTModel(tiny_dinov3_config(patch_size=8)).save_pretrained(tmp_path / "teacher")
    rng = np.random.default_rng(0)
    (tmp_path / "photos").mkdir()
    for index in range(6):
        Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(tmp_path / "photos" / f"{index}.png")
    (tmp_path / "fmnist").mkdir()
    write_idx(tmp_path / "fmnist", "train", 60, rng)
    write_idx(tmp_path / "fmnist", "t10k", 70, rng)
    study = load_study()
    # fmt: off
    result = study.main([
        "--student", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"),
        "--fashion_mnist_dir", str(tmp_path / "fmnist"), "--photos_dir", str(tmp_path / "photos"),
        "--resolutions", "32,48", "--target_fractions", "0.3,0.8", "--num_fit", "30", "--num_fit_crops", "10",
        "--num_reference", "40", "--num_queries", "30", "--num_photo_crops", "8", "--timing_images", "16",
        "--timing_rounds", "1", "--batch_size", "16", "--probe_steps", "50", "--results_dir", str(tmp_path / "out"),
    ])
    # fmt: on
    assert [block["resolution"] for block in result["resolutions"]] == [32, 48]
    for block in result["resolutions"]:
        methods = [row["method"] for row in block["rows"]]
        first_pass = block["relative_costs"]["8"]
        targets = [round(first_pass + fraction * (1 - first_pass), 3) for fraction in (0.3, 0.8)]
        assert methods == ["C = 8", "C = 16", "C = 32"] + [
            f"{kind} @ {t}" for t in targets for kind in ("policy", "oracle")
        ]
        rows = {row["method"]: row for row in block["rows"]}
        assert rows["C = 32"]["mean_cost"] == 1.0 and rows["C = 32"]["fidelity"]["queries"] == pytest.approx(1.0)
        assert rows["C = 8"]["mean_cost"] < rows["C = 16"]["mean_cost"] < 1.0
        for target in targets:
            policy = rows[f"policy @ {target}"]
            assert policy["fitted_mean_cost"] <= target
            assert rows["C = 8"]["mean_cost"] <= policy["mean_cost"] <= 1 + rows["C = 8"]["mean_cost"]
            assert sum(policy["budget_counts"].values()) == 30
            assert set(policy["knn_minus_fixed"]) == {"8", "16", "32"}
            assert policy["seconds_per_image"] > 0
        for row in block["rows"]:
            assert 0 <= row["knn_accuracy"] <= 1 and 0 <= row["linear_accuracy"] <= 1
        assert block["teacher"] is not None
        mixed = block["mixed_batch"]
        assert mixed["budgets"] == [8, 16, 32] and all(t > 0 for t in mixed["seconds_per_image"].values())
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["ladder"] == [8, 16, 32]
    assert f"| policy @ {targets[0]} |" in (tmp_path / "out" / "results.md").read_text()
    assert (tmp_path / "out" / "accuracy_vs_cost.png").stat().st_size > 0
