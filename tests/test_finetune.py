"""Fine-tuning: the example script, `VecaTrainer` (decay groups, per-step budgets, budget sweeps), the shipped metric
modules and `pick_budget`. Tiny models and generated images; the script runs once, in a subprocess."""

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import evaluate
import numpy as np
import pytest
import torch
from conftest import tiny_config
from huggingface_hub import ModelCard
from PIL import Image
from torch import nn
from transformers import AutoImageProcessor, AutoModelForImageClassification, Trainer, TrainingArguments

from veca_hf import VecaForImageClassification, VecaImageProcessor, VecaImageProcessorPil, VecaModel
from veca_hf.budgets import BudgetSampler
from veca_hf.latency import BudgetChoice, pick_budget, time_budgets
from veca_hf.metrics import available_metrics, load_metric
from veca_hf.training.trainer import VecaTrainer, evaluate_budgets


REPO = Path(__file__).resolve().parents[1]
COLOURS = {"blue": (30, 30, 200), "green": (30, 200, 30), "red": (200, 30, 30)}  # sorted: label ids 0, 1, 2


def colour_image(colour, size: int, rng: np.random.Generator) -> np.ndarray:
    """A solid colour with Gaussian noise: `(size, size, 3)` uint8. Learnable from the mean colour."""
    return np.clip(np.array(colour) + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)


def write_image_folder(root: Path, per_class: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    for name, colour in COLOURS.items():
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            Image.fromarray(colour_image(colour, 64, rng)).save(root / name / f"{index}.png")
    return root


class ColourImages(torch.utils.data.Dataset):
    """`per_class` normalised 32 x 32 images of each colour, with their labels."""

    def __init__(self, per_class: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.examples = [
            (torch.from_numpy(colour_image(colour, 32, rng)).permute(2, 0, 1).float() / 127.5 - 1, label)
            for label, colour in enumerate(COLOURS.values())
            for _ in range(per_class)
        ]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        pixel_values, label = self.examples[index]
        return {"pixel_values": pixel_values, "labels": label}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine two threads run several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def training_args(tmp_path: Path, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=6,
        per_device_eval_batch_size=12,
        learning_rate=3e-3,
        weight_decay=0.05,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def classifier() -> VecaForImageClassification:
    return VecaForImageClassification(tiny_config(num_labels=len(COLOURS)))


class BudgetSpy:
    """Records `(global_step, training, num_core_tokens)` of every forward call of the model."""

    def __init__(self, model: nn.Module, trainer_ref: list):
        self.calls = []
        self.trainer_ref = trainer_ref
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        trainer = self.trainer_ref[0]
        self.calls.append((trainer.state.global_step, module.training, kwargs.get("num_core_tokens")))


# ----------------------------------------------------------------------------------------------------------------
# The example script (one run shared by the tests below)
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory) -> Path:
    """Runs examples/finetune_classification.py on a tiny model and a 3-class image folder; returns output_dir."""
    root = tmp_path_factory.mktemp("finetune")
    write_image_folder(root / "train", per_class=6, seed=0)
    write_image_folder(root / "validation", per_class=2, seed=1)
    VecaModel(tiny_config()).save_pretrained(root / "tiny")
    VecaImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(
        root / "tiny"
    )
    output_dir = root / "out"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(root / "modules"),  # a fresh evaluate modules cache: the metric loads from the package
        "HF_DATASETS_CACHE": str(root / "datasets"),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, str(REPO / "examples" / "finetune_classification.py"),
        "--model_name_or_path", str(root / "tiny"),
        "--train_dir", str(root / "train"), "--validation_dir", str(root / "validation"),
        "--output_dir", str(output_dir), "--do_train", "--do_eval",
        "--num_core_tokens", "8", "--sample_budgets", "--eval_budgets", "8,16",
        "--max_steps", "3", "--per_device_train_batch_size", "6", "--learning_rate", "1e-3",
        "--save_strategy", "no", "--logging_steps", "1", "--use_cpu", "--report_to", "none", "--seed", "0",
    ]  # fmt: skip
    result = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return output_dir


@pytest.mark.processes
def test_script_writes_accuracy_per_budget(finetuned):
    results = json.loads((finetuned / "all_results.json").read_text())
    for budget in (8, 16):
        assert 0.0 <= results[f"eval_C{budget}_accuracy"] <= 1.0
        assert math.isfinite(results[f"eval_C{budget}_loss"])
    assert math.isfinite(results["train_loss"])
    assert (finetuned / "train_results.json").is_file() and (finetuned / "eval_results.json").is_file()


@pytest.mark.processes
def test_script_saves_a_model_with_label_maps(finetuned):
    model = AutoModelForImageClassification.from_pretrained(finetuned)
    assert isinstance(model, VecaForImageClassification)
    assert model.config.id2label == {0: "blue", 1: "green", 2: "red"}
    assert model.config.label2id == {"blue": 0, "green": 1, "red": 2}
    assert model.config.default_num_core_tokens == 8  # --num_core_tokens becomes the saved default budget
    assert isinstance(AutoImageProcessor.from_pretrained(finetuned, backend="pil"), VecaImageProcessorPil)
    assert isinstance(AutoImageProcessor.from_pretrained(finetuned), VecaImageProcessor)  # torchvision backend
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).logits.shape == (1, 3)


@pytest.mark.processes
def test_script_writes_a_model_card_with_accuracy_per_budget(finetuned):
    card = ModelCard.load(finetuned / "README.md")
    assert card.data.pipeline_tag == "image-classification" and card.data.library_name == "transformers"
    assert "| 8 |" in card.text and "| 16 |" in card.text and "accuracy" in card.text


# ----------------------------------------------------------------------------------------------------------------
# VecaTrainer
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.processes
def test_a_script_without_do_train_or_do_eval_stops_instead_of_doing_nothing(tmp_path, monkeypatch):
    """`TrainingArguments` defaults both to False: the README's command once exited 0 having written nothing."""
    from veca_hf.training.scripts import parse_finetuning_args

    monkeypatch.setattr(sys, "argv", ["finetune.py", "--output_dir", str(tmp_path / "out"), "--use_cpu"])
    with pytest.raises(ValueError, match="Nothing to do: pass --do_train .*--do_eval"):
        parse_finetuning_args((), logging.getLogger("test"))
    monkeypatch.setattr(sys, "argv", ["finetune.py", "--output_dir", str(tmp_path / "out"), "--use_cpu", "--do_eval"])
    assert parse_finetuning_args((), logging.getLogger("test"))[-1].do_eval


def test_resume_from_checkpoint_latest_means_the_newest_checkpoint_in_the_output_dir(tmp_path):
    """As in `examples/distill.py`: `latest` is the newest checkpoint-<step>, none yet is a fresh start, and a folder
    is passed on unchanged (Trainer itself would look for a folder called "latest")."""
    from veca_hf.training.scripts import resume_checkpoint

    args = TrainingArguments(output_dir=str(tmp_path / "out"), resume_from_checkpoint="latest", use_cpu=True)
    assert resume_checkpoint(args) is None
    for step in (5, 10, 2):
        (tmp_path / "out" / f"checkpoint-{step}").mkdir(parents=True)
    assert resume_checkpoint(args) == str(tmp_path / "out" / "checkpoint-10")
    args.resume_from_checkpoint = str(tmp_path / "out" / "checkpoint-5")
    assert resume_checkpoint(args) == str(tmp_path / "out" / "checkpoint-5")


def test_loss_falls(tmp_path):
    torch.manual_seed(0)
    args = training_args(tmp_path, max_steps=10, per_device_train_batch_size=12, learning_rate=3e-3)
    trainer = VecaTrainer(model=classifier(), args=args, train_dataset=ColourImages(per_class=8), num_core_tokens=8)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 10
    assert np.mean(losses[-3:]) < 0.5 * np.mean(losses[:3]), losses


def test_no_weight_decay_on_cores_in_the_optimizer(tmp_path):
    model = classifier()
    trainer = VecaTrainer(model=model, args=training_args(tmp_path), train_dataset=ColourImages(2))
    groups = trainer.create_optimizer().param_groups
    decay_of = {id(p): group["weight_decay"] for group in groups for p in group["params"]}
    names = dict(model.named_parameters())
    assert set(decay_of) == {id(p) for p in names.values()}  # every parameter is optimised
    no_decay_keys = ("core_tokens", "core_coordinates", ".step", "norm", "bias")
    no_decay = [n for n in names if any(key in n for key in no_decay_keys)]
    assert any("core_tokens" in n for n in no_decay) and any(n.endswith(".step") for n in no_decay)
    assert all(decay_of[id(names[n])] == 0.0 for n in no_decay)
    linear_weights = [m.weight for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    assert len(linear_weights) > 5 and all(decay_of[id(weight)] == 0.05 for weight in linear_weights)
    assert set(decay_of.values()) == {0.0, 0.05}
    # Trainer's default rule would decay the cores: the override is what keeps them out.
    assert "veca.embeddings.core_tokens.0" in Trainer.get_decay_parameter_names(trainer, model)


def test_sampled_budget_changes_per_step_and_is_constant_within_a_step(tmp_path):
    model = classifier()
    sampler = BudgetSampler([8, 16], weights=None, seed=0)
    args = training_args(tmp_path, max_steps=8, per_device_train_batch_size=3, gradient_accumulation_steps=2)
    trainer_ref = []
    spy = BudgetSpy(model, trainer_ref)
    trainer = VecaTrainer(model=model, args=args, train_dataset=ColourImages(8), budget_sampler=sampler)
    trainer_ref.append(trainer)
    trainer.train()

    budgets_per_step = {}
    for step, training, budget in spy.calls:
        assert training
        budgets_per_step.setdefault(step, []).append(budget)
    assert sorted(budgets_per_step) == list(range(8))
    for step, budgets in budgets_per_step.items():
        assert budgets == [sampler(step)] * 2  # both micro-batches of the step
    assert {budgets[0] for budgets in budgets_per_step.values()} == {8, 16}  # it does change between steps


def test_evaluate_budgets_runs_each_budget(tmp_path):
    model = classifier()
    trainer_ref = []
    spy = BudgetSpy(model, trainer_ref)
    trainer = VecaTrainer(
        model=model, args=training_args(tmp_path), eval_dataset=ColourImages(4), num_core_tokens=8,
        compute_metrics=lambda p: load_metric("accuracy").compute(
            predictions=p.predictions.argmax(-1), references=p.label_ids
        ),
    )  # fmt: skip
    trainer_ref.append(trainer)
    results = evaluate_budgets(trainer, budgets=[16, 8])
    assert list(results) == [16, 8]
    assert 0.0 <= results[16]["eval_C16_accuracy"] <= 1.0 and "eval_C8_loss" in results[8]
    assert [budget for _, _, budget in spy.calls] == [16, 8]  # one 12-image batch per evaluation
    assert trainer.eval_num_core_tokens is None and trainer.evaluation_budget == 8  # restored


def test_evaluate_budgets_with_a_plain_trainer_uses_the_config_default(tmp_path):
    model = classifier()
    seen = []
    model.veca.register_forward_pre_hook(lambda module, args: seen.append(module.config.default_num_core_tokens))
    trainer = Trainer(model=model, args=training_args(tmp_path), eval_dataset=ColourImages(4))
    results = evaluate_budgets(trainer, budgets=[8, 16])
    assert seen == [8, 16] and set(results) == {8, 16}
    assert model.config.default_num_core_tokens is None


def test_invalid_budgets_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="not a valid budget"):
        VecaTrainer(model=classifier(), args=training_args(tmp_path), budget_sampler=BudgetSampler([8, 24], None))
    with pytest.raises(ValueError, match="eval_num_core_tokens"):
        VecaTrainer(model=classifier(), args=training_args(tmp_path), eval_num_core_tokens=12)


# ----------------------------------------------------------------------------------------------------------------
# Metric modules shipped in the package
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_hub(monkeypatch):
    """Any attempt of evaluate to reach the Hub fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("evaluate tried to load a module from the Hub")

    monkeypatch.setattr(evaluate.loading, "HubEvaluationModuleFactory", refuse)


def test_accuracy_metric_loads_offline_and_matches_hand_computation(no_hub):
    assert available_metrics() == ["accuracy", "depth", "mean_iou"]
    accuracy = load_metric("accuracy")
    predictions, references = [0, 2, 1, 1, 0], [0, 1, 1, 1, 2]
    assert accuracy.compute(predictions=predictions, references=references) == {"accuracy": pytest.approx(3 / 5)}
    assert accuracy.compute(predictions=predictions, references=references, normalize=False) == {"accuracy": 3}
    weighted = accuracy.compute(predictions=predictions, references=references, sample_weight=[1, 1, 1, 1, 4])
    assert weighted == {"accuracy": pytest.approx(3 / 8)}  # correct weight 1 + 1 + 1 over total 8
    with pytest.raises(ValueError, match="no metric named"):
        load_metric("bleu")


def test_mean_iou_metric_ignore_index_and_absent_class(no_hub):
    mean_iou = load_metric("mean_iou")
    predictions = [np.array([[0, 0], [1, 2]]), np.array([[2, 2], [1, 0]])]
    references = [np.array([[0, 1], [1, 255]]), np.array([[2, 0], [1, 1]])]  # 255: ignored (its prediction too)
    results = mean_iou.compute(predictions=predictions, references=references, num_labels=4, ignore_index=255)
    # Pixel counts over both images, class by class (intersection / union; intersection / labelled):
    # class 0: 1 / (3 + 2 - 1); class 1: 2 / (2 + 4 - 2); class 2: 1 / (2 + 1 - 1); class 3 is absent from both.
    np.testing.assert_allclose(results["per_category_iou"], [1 / 4, 2 / 4, 1 / 2, np.nan])
    np.testing.assert_allclose(results["per_category_accuracy"], [1 / 2, 2 / 4, 1 / 1, np.nan])
    assert results["mean_iou"] == pytest.approx((1 / 4 + 2 / 4 + 1 / 2) / 3)  # the NaN class is left out
    assert results["mean_accuracy"] == pytest.approx((1 / 2 + 2 / 4 + 1) / 3)
    assert results["overall_accuracy"] == pytest.approx(4 / 7)
    reduced = mean_iou.compute(
        predictions=[np.array([[0, 1]])], references=[np.array([[1, 0]])], num_labels=2, ignore_index=255,
        reduce_labels=True,
    )  # fmt: skip
    # label 1 -> class 0 (predicted right), label 0 -> background, ignored
    np.testing.assert_allclose(reduced["per_category_iou"], [1.0, np.nan])


# ----------------------------------------------------------------------------------------------------------------
# pick_budget
# ----------------------------------------------------------------------------------------------------------------


def test_pick_budget_returns_the_largest_budget_under_a_generous_target():
    model = VecaModel(tiny_config()).train()
    choice = pick_budget(model, 32, latency_target_ms=1e6, warmup=1, repeats=2)
    assert isinstance(choice, BudgetChoice)
    assert choice.num_core_tokens == 16 and sorted(choice.latencies_ms) == [8, 16]
    assert all(latency > 0 for latency in choice.latencies_ms.values())
    assert choice.image_size == (32, 32) and "**chosen**" in choice.table()
    assert model.training  # mode restored


def test_time_budgets_measures_every_budget_and_pick_budget_says_what_it_chose(caplog):
    model = VecaModel(tiny_config())
    latencies = time_budgets(model, 32, budgets=[16, 8], warmup=0, repeats=1)
    assert list(latencies) == [8, 16] and all(ms > 0 for ms in latencies.values())
    with caplog.at_level(logging.INFO, logger="veca_hf.latency"):
        pick_budget(model, 32, latency_target_ms=1e6, warmup=0, repeats=1)
    assert "C=16 is the largest budget within 1e+06 ms per batch of 1 at 32x32 (C=8: " in caplog.text


def test_pick_budget_says_when_no_budget_is_cheaper_than_a_dense_vit(caplog):
    """At a small image the cores outweigh the attention VECA saves: every budget does more work than the dense ViT of
    the same size, and pick_budget says so; at a larger image the smallest budget does less."""
    from transformers import DINOv3ViTModel

    from veca_hf.flops import count_flops, dense_twin_model_flops, veca_model_flops
    from veca_hf.training.distillation import full_attention_student_config

    config = tiny_config()
    model = VecaModel(config)
    dense = DINOv3ViTModel(full_attention_student_config(config)).eval()
    for side in (32, 256):  # the analytic count is what the dense twin really does
        assert dense_twin_model_flops(config, side, side) == count_flops(dense, torch.randn(1, 3, side, side))

    with caplog.at_level(logging.INFO, logger="veca_hf.latency"):
        small = pick_budget(model, 32, latency_target_ms=1e6, warmup=0, repeats=1, dense_model=dense)
    assert all(ratio > 1 for ratio in small.flops_vs_dense.values())
    assert small.flops_vs_dense[8] == veca_model_flops(config, 32, 32, 8) / dense_twin_model_flops(config, 32, 32)
    assert small.dense_latency_ms > 0 and "| dense model |" in small.table()
    assert small.budgets_cheaper_than_dense == [
        b for b, ms in small.latencies_ms.items() if ms < small.dense_latency_ms
    ]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="veca_hf.latency"):
        large = pick_budget(model, 256, latency_target_ms=1e6, warmup=0, repeats=1)
    assert large.dense_latency_ms is None and large.flops_vs_dense[8] < 1 and 8 in large.budgets_cheaper_than_dense
    assert "no budget beats" not in caplog.text
    small.dense_latency_ms = None  # by FLOPs alone, no budget is cheaper at 32 px
    assert small.budgets_cheaper_than_dense == []


def test_pick_budget_warns_when_no_budget_beats_the_dense_flops(caplog):
    with caplog.at_level(logging.WARNING, logger="veca_hf.latency"):
        pick_budget(VecaModel(tiny_config()), 32, latency_target_ms=1e6, warmup=0, repeats=1)
    assert "no budget beats the FLOPs of a dense ViT of the same size" in caplog.text


def test_pick_budget_raises_for_an_impossible_target():
    model = VecaModel(tiny_config())
    with pytest.raises(ValueError, match=r"fastest measured was [0-9.]+ ms"):
        pick_budget(model, (32, 48), latency_target_ms=1e-6, budgets=[8], warmup=0, repeats=1)
