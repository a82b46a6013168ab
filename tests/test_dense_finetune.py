"""Dense fine-tuning end to end: the linear heads (`VecaForSemanticSegmentation`, `VecaForDepthEstimation`), UperNet
and the ViT depth necks on a VECA backbone, `VecaTrainer` with budgets, padded batches of different sizes, the data
checks of `veca_hf.dense`, and the two example scripts. Synthetic data built here: random squares (class 1) and disks
(class 2) on noise (class 0), whose depth is a function of the row (the background recedes upwards) and the shape."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from conftest import tiny_config
from huggingface_hub import ModelCard
from PIL import Image
from transformers import (
    AutoImageProcessor,
    AutoModelForDepthEstimation,
    AutoModelForSemanticSegmentation,
    DepthAnythingForDepthEstimation,
    EvalPrediction,
    TrainingArguments,
    UperNetForSemanticSegmentation,
)

from veca_hf import VecaForDepthEstimation, VecaForSemanticSegmentation, VecaImageProcessorPil, VecaModel
from veca_hf.budgets import BudgetSampler
from veca_hf.dense import (
    DenseCollator,
    DenseTransform,
    DepthMetrics,
    SegmentationMetrics,
    build_depth_model,
    build_segmentation_model,
    check_columns,
    depth_loss_from_outputs,
    load_dense_dataset,
    prepare_splits,
    resolve_id2label,
)
from veca_hf.latency import pick_budget
from veca_hf.metrics import compute_metric
from veca_hf.routing import veca_call
from veca_hf.training.trainer import VecaTrainer, evaluate_budgets


REPO = Path(__file__).resolve().parents[1]
ID2LABEL = {0: "background", 1: "square", 2: "disk"}
SIZES = [(64, 64), (48, 64), (64, 48)]  # (height, width), cycled: every batch mixes sizes
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine two threads run several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def shapes_sample(rng: np.random.Generator, height: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(image (H, W, 3) uint8, labels (H, W) int64, depth (H, W) float32)`: 1-2 shapes on a noise background."""
    image = np.clip(rng.normal(128, 40, (height, width, 3)), 0, 255)
    labels = np.zeros((height, width), np.int64)
    depth = 2.0 + 3.0 * (1 - np.arange(height)[:, None] / height) * np.ones((1, width))  # 5 m at the top, 2 m below
    rows, cols = np.mgrid[:height, :width]
    for _ in range(rng.integers(1, 3)):
        label, size = int(rng.integers(1, 3)), int(rng.integers(14, 28))
        top, left = rng.integers(0, height - size), rng.integers(0, width - size)
        if label == 1:
            mask = (rows >= top) & (rows < top + size) & (cols >= left) & (cols < left + size)
        else:
            mask = (rows - top - size / 2) ** 2 + (cols - left - size / 2) ** 2 < (size / 2) ** 2
        colour = (220, 40, 40) if label == 1 else (40, 40, 220)
        image[mask] = np.clip(np.array(colour) + rng.normal(0, 20, (mask.sum(), 3)), 0, 255)
        labels[mask] = label
        depth[mask] = 1.0 if label == 1 else 1.5
    return image.astype(np.uint8), labels, depth.astype(np.float32)


class Shapes(torch.utils.data.Dataset):
    """`count` normalised samples of the three sizes, `labels` the class map or the depth map."""

    def __init__(self, count: int, seed: int, task: str):
        rng = np.random.default_rng(seed)
        self.items = []
        for index in range(count):
            image, labels, depth = shapes_sample(rng, *SIZES[index % len(SIZES)])
            pixel_values = torch.from_numpy(((image / 255.0 - MEAN) / STD).transpose(2, 0, 1)).float()
            target = torch.from_numpy(labels if task == "segmentation" else depth)
            self.items.append({"pixel_values": pixel_values, "labels": target})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def training_args(tmp_path: Path, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_steps=100,
        logging_steps=50,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        remove_unused_columns=False,
        batch_eval_metrics=True,
        seed=0,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def dense_trainer(model, tmp_path, task: str, train=None, evaluation=None, **kwargs) -> VecaTrainer:
    metrics = SegmentationMetrics(len(ID2LABEL)) if task == "segmentation" else DepthMetrics()
    return VecaTrainer(
        model=model,
        args=training_args(tmp_path, **kwargs.pop("args", {})),
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=DenseCollator(255 if task == "segmentation" else 0.0),
        compute_metrics=metrics,
        preprocess_logits_for_metrics=metrics.preprocess_logits,
        **kwargs,
    )


def majority_mean_iou(dataset: Shapes) -> float:
    """The mean IoU of predicting the most frequent class (background) everywhere."""
    references = [item["labels"].numpy() for item in dataset.items]
    predictions = [np.zeros_like(reference) for reference in references]
    return compute_metric("mean_iou", predictions=predictions, references=references, num_labels=3, ignore_index=255)[
        "mean_iou"
    ]


def mean_predictor_rmse(train: Shapes, evaluation: Shapes) -> float:
    """The RMSE of predicting the mean training depth everywhere."""
    mean = float(torch.cat([item["labels"].flatten() for item in train.items]).mean())
    references = np.concatenate([item["labels"].numpy().ravel() for item in evaluation.items])
    return compute_metric("depth", predictions=np.full_like(references, mean), references=references)["rmse"]


@pytest.fixture(scope="module")
def veca_folder(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("dense") / "veca-tiny"
    VecaModel(tiny_config()).save_pretrained(path)
    VecaImageProcessorPil().save_pretrained(path)
    return path


class ForwardSpy:
    """Records the budget a `VecaModel` ran at (its argument, else its config's default) and whether `pixel_mask` was
    given, for every call (a forward hook: it sees the arguments after every pre-hook, `veca_call`'s included)."""

    def __init__(self, model):
        self.calls = []
        for module in model.modules():
            if isinstance(module, VecaModel):
                module.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output):
        budget = module.resolve_num_core_tokens(kwargs.get("num_core_tokens"))
        self.calls.append((budget, kwargs.get("pixel_mask") is not None))


# ----------------------------------------------------------------------------------------------------------------
# The heads learn, save, reload through the Auto classes and evaluate at two budgets
# ----------------------------------------------------------------------------------------------------------------


def test_linear_segmentation_learns_and_reloads(tmp_path):
    torch.manual_seed(0)
    train, evaluation = Shapes(96, seed=0, task="segmentation"), Shapes(24, seed=1, task="segmentation")
    model = VecaForSemanticSegmentation(tiny_config(num_labels=3, id2label=ID2LABEL))
    sampler = BudgetSampler([8, 16], weights=None, seed=0)
    trainer = dense_trainer(model, tmp_path, "segmentation", train, evaluation, budget_sampler=sampler)
    trainer.train()
    model.save_pretrained(tmp_path / "segmenter")

    reloaded = AutoModelForSemanticSegmentation.from_pretrained(tmp_path / "segmenter")
    assert isinstance(reloaded, VecaForSemanticSegmentation) and reloaded.config.id2label == ID2LABEL
    batch = DenseCollator(255)(evaluation.items[:3])
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(**batch).logits, model.eval()(**batch).logits)

    results = evaluate_budgets(
        dense_trainer(reloaded, tmp_path, "segmentation", evaluation=evaluation), budgets=[8, 16]
    )
    baseline = majority_mean_iou(evaluation)  # 0.28 (measured: 0.705 at C=8, 0.700 at C=16)
    for budget in (8, 16):
        assert results[budget][f"eval_C{budget}_mean_iou"] > baseline + 0.25, (baseline, results)
    assert results[8]["eval_C8_mean_iou"] != results[16]["eval_C16_mean_iou"]  # two budgets, two evaluations


def test_upernet_learns_at_the_trainers_budgets_and_reloads(tmp_path, veca_folder):
    torch.manual_seed(0)
    train, evaluation = Shapes(96, seed=0, task="segmentation"), Shapes(24, seed=1, task="segmentation")
    model = build_segmentation_model(str(veca_folder), "upernet", ID2LABEL, head_hidden_size=32)
    assert isinstance(model, UperNetForSemanticSegmentation)
    spy = ForwardSpy(model)
    sampler = BudgetSampler([8, 16], weights=None, seed=0)
    trainer = dense_trainer(model, tmp_path, "segmentation", train, evaluation, budget_sampler=sampler)
    trainer.train()
    # the budget and pixel_mask reach the VECA although UperNet's forward takes neither
    assert [call[0] for call in spy.calls] == [sampler(step) for step in range(100)]
    assert all(has_mask for _, has_mask in spy.calls)
    model.save_pretrained(tmp_path / "upernet")

    reloaded = AutoModelForSemanticSegmentation.from_pretrained(tmp_path / "upernet")
    assert isinstance(reloaded, UperNetForSemanticSegmentation)
    results = evaluate_budgets(
        dense_trainer(reloaded, tmp_path, "segmentation", evaluation=evaluation), budgets=[8, 16]
    )
    baseline = majority_mean_iou(evaluation)  # 0.28 (measured: 0.696 at C=8 and at C=16)
    for budget in (8, 16):
        assert results[budget][f"eval_C{budget}_mean_iou"] > baseline + 0.2, (baseline, results)
    assert results[8]["eval_C8_loss"] != results[16]["eval_C16_loss"]  # the evaluation budget reached the VECA too


def test_linear_depth_learns_and_reloads(tmp_path):
    torch.manual_seed(0)
    train, evaluation = Shapes(96, seed=0, task="depth"), Shapes(24, seed=1, task="depth")
    model = VecaForDepthEstimation(tiny_config())
    with torch.no_grad():  # as build_depth_model(initial_depth=...): start at the mean depth
        model.head.bias.fill_(float(torch.cat([item["labels"].flatten() for item in train.items]).mean()))
    sampler = BudgetSampler([8, 16], weights=None, seed=0)
    dense_trainer(model, tmp_path, "depth", train, evaluation, budget_sampler=sampler).train()
    model.save_pretrained(tmp_path / "depth")

    reloaded = AutoModelForDepthEstimation.from_pretrained(tmp_path / "depth")
    assert isinstance(reloaded, VecaForDepthEstimation)
    results = evaluate_budgets(dense_trainer(reloaded, tmp_path, "depth", evaluation=evaluation), budgets=[8, 16])
    baseline = mean_predictor_rmse(train, evaluation)  # 1.21 m (measured: 0.61 m at C=8, 0.62 m at C=16)
    for budget in (8, 16):
        assert results[budget][f"eval_C{budget}_rmse"] < 0.7 * baseline, (baseline, results)
        assert 0 < results[budget][f"eval_C{budget}_delta1"] <= 1


def test_transformers_depth_heads_train_with_the_package_loss(tmp_path, veca_folder):
    """DPT and Depth Anything raise on `labels`; `depth_loss_from_outputs` trains them (Depth Anything learns)."""
    train, evaluation = Shapes(48, seed=0, task="depth"), Shapes(12, seed=1, task="depth")
    model = build_depth_model(str(veca_folder), "depth_anything", head_hidden_size=16, max_depth=6)
    assert isinstance(model, DepthAnythingForDepthEstimation)
    spy = ForwardSpy(model)
    trainer = dense_trainer(
        model, tmp_path, "depth", train, evaluation, num_core_tokens=8, compute_loss_func=depth_loss_from_outputs,
        args={"max_steps": 40, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4},
    )  # fmt: skip
    trainer.loss_is_scaled_for_ga = False
    trainer.train()
    assert {call for call in spy.calls} == {(8, True)}
    rmse = trainer.evaluate()["eval_rmse"]
    assert rmse < 0.8 * mean_predictor_rmse(train, evaluation)  # measured: 0.61 against 1.21

    dpt = build_depth_model(str(veca_folder), "dpt", head_hidden_size=8)
    batch = DenseCollator(0.0)(evaluation.items[:3])
    loss = depth_loss_from_outputs(dpt(batch["pixel_values"]), batch["labels"])
    loss.backward()
    assert math.isfinite(loss.item()) and dpt.backbone.veca.embeddings.core_tokens[0].grad is not None


# ----------------------------------------------------------------------------------------------------------------
# A padded batch of different sizes: each image gets the loss and metric of its own forward
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["segmentation", "depth"])
def test_mixed_size_batch_equals_single_images(task):
    torch.manual_seed(0)
    rng = np.random.default_rng(3)
    samples = [shapes_sample(rng, height, width) for height, width in [(64, 48), (48, 80), (32, 32)]]
    processor = VecaImageProcessorPil.for_any_size(48, patch_size=16)
    transform = DenseTransform(processor, task, "image", "map", num_labels=3)
    maps = [labels if task == "segmentation" else depth for _, labels, depth in samples]
    examples = transform({"image": [Image.fromarray(image) for image, _, _ in samples], "map": maps})
    examples = [dict(zip(examples, values, strict=True)) for values in zip(*examples.values(), strict=True)]
    collate = DenseCollator(255 if task == "segmentation" else 0.0)
    batch = collate(examples)
    assert batch["pixel_mask"].float().mean() < 1  # really padded
    if task == "segmentation":
        model = VecaForSemanticSegmentation(tiny_config(num_labels=3)).eval()
        metric, name = SegmentationMetrics(3), "logits"
    else:
        model = VecaForDepthEstimation(tiny_config()).eval()
        metric, name = DepthMetrics(), "predicted_depth"

    with torch.no_grad():
        together = model(**batch, num_core_tokens=8)
        alone = [model(**collate([example]), num_core_tokens=8) for example in examples]
    weighted_loss, weights = 0.0, 0
    for index, (example, single) in enumerate(zip(examples, alone, strict=True)):
        height, width = example["labels"].shape
        own = getattr(together, name)[index, ..., :height, :width]
        torch.testing.assert_close(own, getattr(single, name)[0], rtol=0, atol=1e-5)
        scored = (example["labels"] != 255) if task == "segmentation" else (example["labels"] > 0)
        weighted_loss += float(single.loss) * int(scored.sum())
        weights += int(scored.sum())
    assert float(together.loss) == pytest.approx(weighted_loss / weights, rel=1e-5)  # padding adds nothing

    def keep(outputs, labels, compute_result):
        predictions = metric.preprocess_logits(getattr(outputs, name), labels)
        return metric(EvalPrediction(predictions=predictions, label_ids=labels), compute_result=compute_result)

    batch_metrics = keep(together, batch["labels"], compute_result=True)
    for index, (single, example) in enumerate(zip(alone, examples, strict=True)):  # as batch_eval_metrics calls it
        single_metrics = keep(single, example["labels"][None], compute_result=index == len(examples) - 1)
    assert batch_metrics == pytest.approx(single_metrics, rel=1e-6)


def test_upernet_takes_pixel_mask_through_the_trainer_hook(veca_folder):
    """`veca_call` gives UperNet's VECA the mask: the cores then see only each image's own patches."""
    model = build_segmentation_model(str(veca_folder), "upernet", ID2LABEL, head_hidden_size=16).eval()
    pixel_values = torch.randn(2, 3, 64, 64)
    pixel_mask = torch.ones(2, 64, 64, dtype=torch.long)
    pixel_mask[1, 32:] = 0
    with torch.no_grad(), veca_call(model, {"pixel_values": pixel_values, "pixel_mask": pixel_mask}, 8) as inputs:
        assert set(inputs) == {"pixel_values"}  # UperNet's forward takes neither the budget nor the mask
        padded = model.backbone(**inputs).feature_maps[-1]
    with torch.no_grad(), veca_call(model, {"pixel_values": pixel_values[1:, :, :32]}, 8) as inputs:
        alone = model.backbone(**inputs).feature_maps[-1]
    torch.testing.assert_close(padded[1:, :, :2], alone, rtol=0, atol=1e-5)
    assert pick_budget(model, 32, latency_target_ms=1e6, warmup=0, repeats=1).num_core_tokens == 16


# ----------------------------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the sample or the column
# ----------------------------------------------------------------------------------------------------------------


def test_bad_samples_raise_value_errors_naming_them():
    processor = VecaImageProcessorPil.for_any_size(32, patch_size=16)
    image = Image.new("RGB", (48, 32))
    segmentation = DenseTransform(processor, "segmentation", "image", "label", num_labels=3, split="validation")
    good = np.zeros((32, 48), np.uint8)

    with pytest.raises(ValueError, match=r"sample 7 of the 'validation' split \(column 'label'\) is 32x40"):
        segmentation({"image": [image, image], "label": [good, good[:, :40]], "__sample_index__": [6, 7]})
    bad = good.copy()
    bad[0, 0], bad[1, 1] = 3, 7
    with pytest.raises(ValueError, match=r"sample 1 .* holds labels \[3, 7\] outside \[0, 3\)"):
        segmentation({"image": [image, image], "label": [good, bad]})
    labels = good.copy()
    labels[0, 0] = 255  # the ignore index is allowed
    assert segmentation({"image": [image], "label": [labels]})["labels"][0][0, 0] == 255
    with pytest.raises(ValueError, match="has 3 channels"):
        segmentation({"image": [image], "label": [Image.new("RGB", (48, 32))]})

    depth = DenseTransform(processor, "depth", "image", "depth", depth_scale=1000, split="train")
    with pytest.raises(
        ValueError, match=r"depth map of sample 0 of the 'train' split \(column 'depth'\) has no valid"
    ):
        depth({"image": [image], "depth": [np.zeros((32, 48), np.float32)]})
    with pytest.raises(ValueError, match="negative depths"):
        depth({"image": [image], "depth": [np.full((32, 48), -1.0, np.float32)]})
    png = Image.fromarray(np.full((32, 48), 2500, np.uint16))  # a 16-bit PNG in millimetres
    assert depth({"image": [image], "depth": [png]})["labels"][0].unique().tolist() == [2.5]

    table = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"image": [1], "annotation": [2]})})
    with pytest.raises(ValueError, match=r"Column 'label' \(--label_column_name\) not found in the 'train' split"):
        check_columns(table, {"--image_column_name": "image", "--label_column_name": "label"})
    with pytest.raises(ValueError, match="--do_eval needs a 'validation' split"):
        prepare_splits(table, do_train=True, do_eval=True, train_val_split=0.0)


def test_channels_first_float_arrays_are_images():
    """Hub copies exported from NumPy store images as `(3, H, W)` floats in [0, 1] and depths as `(1, H, W)`."""
    processor = VecaImageProcessorPil.for_any_size(32, patch_size=16)
    rgb = np.random.default_rng(0).integers(0, 256, (32, 48, 3)).astype(np.uint8)
    depth = DenseTransform(processor, "depth", "image", "depth")
    depths = np.full((1, 32, 48), 2.0, np.float32)
    from_uint8 = depth({"image": [Image.fromarray(rgb)], "depth": [depths]})
    from_floats = depth({"image": [(rgb / 255.0).transpose(2, 0, 1).tolist()], "depth": [depths.tolist()]})
    torch.testing.assert_close(from_floats["pixel_values"][0], from_uint8["pixel_values"][0], rtol=0, atol=0)
    assert from_floats["labels"][0].unique().tolist() == [2.0]
    with pytest.raises(ValueError, match=r"image of sample 0 .* floats in \[0, 255\]; .* must be in \[0, 1\]"):
        depth({"image": [rgb.astype(np.float32)], "depth": [depths]})


def test_splits_from_parquet_files_or_urls(tmp_path):
    data = write_parquet_dataset(tmp_path / "data", {"train": 3, "validation": 2}, depth_as_png=True)
    for train_file in (str(data / "train.parquet"), f"file://{data}/tr*.parquet"):  # a path, an fsspec URL glob
        dataset = load_dense_dataset(train_file=train_file, validation_file=str(data / "validation.parquet"))
        assert {split: len(rows) for split, rows in dataset.items()} == {"train": 3, "validation": 2}
    assert list(load_dense_dataset(train_file=str(data / "train.parquet"))) == ["train"]
    with pytest.raises(ValueError, match="either --dataset_name .* or --train_file/--validation_file"):
        load_dense_dataset(str(data), train_file=str(data / "train.parquet"))
    with pytest.raises(ValueError, match="not both and not neither"):
        load_dense_dataset()


def test_id2label_from_a_file_or_from_the_data(tmp_path):
    maps = [np.array([[0, 1], [1, 4]], np.uint8), np.array([[2, 255], [0, 0]], np.uint8)]
    train = datasets.Dataset.from_dict({"label": [Image.fromarray(m) for m in maps]})
    assert resolve_id2label(None, None, train, "label") == {i: str(i) for i in range(5)}
    assert resolve_id2label(None, None, train, "label", reduce_labels=True) == {i: str(i) for i in range(4)}
    (tmp_path / "id2label.json").write_text(json.dumps({"0": "wall", "1": "floor"}))
    assert resolve_id2label(None, str(tmp_path), train, "label") == {0: "wall", 1: "floor"}


# ----------------------------------------------------------------------------------------------------------------
# trust_remote_code: the dense heads load from the folder's own code
# ----------------------------------------------------------------------------------------------------------------

REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["veca_hf"] = None  # only the folder's own code can be used
    import torch
    from transformers import AutoModelForDepthEstimation, AutoModelForSemanticSegmentation

    folder, pixel_path = sys.argv[1], sys.argv[2]
    pixel_values = torch.load(pixel_path)
    segmenter = AutoModelForSemanticSegmentation.from_pretrained(folder, trust_remote_code=True).eval()
    depth = AutoModelForDepthEstimation.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.save({"logits": segmenter(pixel_values, num_core_tokens=8).logits}, pixel_path + ".out")
    print("CLASSES", type(segmenter).__module__, type(segmenter).__name__, type(depth).__name__)
    """
)


@pytest.mark.processes
def test_dense_heads_load_with_trust_remote_code(tmp_path):
    model = VecaForSemanticSegmentation(tiny_config(num_labels=3)).eval()
    model.save_pretrained(tmp_path / "folder")
    config = json.loads((tmp_path / "folder" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForSemanticSegmentation"] == "modeling_veca_dense.VecaForSemanticSegmentation"
    assert config["auto_map"]["AutoModelForDepthEstimation"] == "modeling_veca_dense.VecaForDepthEstimation"
    assert {"modeling_veca_dense.py", "modeling_veca.py", "positions_veca.py"} <= set(os.listdir(tmp_path / "folder"))
    pixel_values = torch.randn(1, 3, 64, 48)
    torch.save(pixel_values, tmp_path / "pixels.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(tmp_path / "folder"), str(tmp_path / "pixels.pt")],
        env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("CLASSES"))
    assert line.split()[1].startswith("transformers_modules.") and line.split()[2:] == [
        "VecaForSemanticSegmentation",
        "VecaForDepthEstimation",
    ]
    with torch.no_grad():
        expected = model(pixel_values, num_core_tokens=8).logits
    torch.testing.assert_close(torch.load(tmp_path / "pixels.pt.out")["logits"], expected, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# The example scripts, end to end on tiny local Parquet data
# ----------------------------------------------------------------------------------------------------------------


def write_parquet_dataset(root: Path, counts: dict[str, int], depth_as_png: bool) -> Path:
    """`root/{split}.parquet`: `image`, `label` (mode L) and `depth` (a 16-bit PNG in mm, or float lists) columns."""
    root.mkdir(parents=True)
    for offset, (split, count) in enumerate(counts.items()):
        rng = np.random.default_rng(offset)
        rows = {"image": [], "label": [], "depth": []}
        for index in range(count):
            image, labels, depth = shapes_sample(rng, *SIZES[index % len(SIZES)])
            rows["image"].append(Image.fromarray(image))
            rows["label"].append(Image.fromarray(labels.astype(np.uint8)))
            rows["depth"].append(Image.fromarray((depth * 1000).astype(np.uint16)) if depth_as_png else depth.tolist())
        depth_feature = datasets.Image() if depth_as_png else datasets.List(datasets.List(datasets.Value("float32")))
        features = datasets.Features({"image": datasets.Image(), "label": datasets.Image(), "depth": depth_feature})
        datasets.Dataset.from_dict(rows, features=features).to_parquet(root / f"{split}.parquet")
    return root


def run_script(name: str, argv: list[str], monkeypatch) -> None:
    """Runs `examples/<name>.py` in this process (a subprocess would spend most of its time importing torch)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    script.main()


COMMON = [
    "--do_train", "--do_eval", "--max_steps", "3", "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "4", "--learning_rate", "1e-3", "--save_strategy", "no", "--use_cpu",
    "--report_to", "none", "--seed", "0", "--shortest_edge", "48", "--sample_budgets", "--eval_budgets", "8,16",
    "--dataloader_num_workers", "0", "--disable_tqdm", "true",
]  # fmt: skip


@pytest.fixture
def script_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VECA_HF_TUNE_MALLOC", "0")  # the scripts run in this process: leave its malloc alone
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def test_segmentation_script_linear_and_upernet(tmp_path, veca_folder, script_env, monkeypatch):
    data = write_parquet_dataset(tmp_path / "data", {"train": 8, "validation": 4}, depth_as_png=False)
    (data / "id2label.json").write_text(json.dumps({str(k): v for k, v in ID2LABEL.items()}))
    runs = (("linear", ["--num_core_tokens", "8", "--longest_edge", "64"]), ("upernet", ["--head_hidden_size", "16"]))
    for head, extra in runs:
        output = tmp_path / head
        argv = ["--model_name_or_path", str(veca_folder), "--head", head, "--dataset_name", str(data)]
        run_script("finetune_segmentation", [*argv, "--output_dir", str(output), *COMMON, *extra], monkeypatch)

        results = json.loads((output / "all_results.json").read_text())
        for budget in (8, 16):
            assert 0 <= results[f"eval_C{budget}_mean_iou"] <= 1 and math.isfinite(results[f"eval_C{budget}_loss"])
        model = AutoModelForSemanticSegmentation.from_pretrained(output).eval()
        assert type(model) is {"linear": VecaForSemanticSegmentation, "upernet": UperNetForSemanticSegmentation}[head]
        assert model.config.id2label == ID2LABEL
        processor = AutoImageProcessor.from_pretrained(output)
        inputs = processor([Image.new("RGB", (60, 40)), Image.new("RGB", (40, 70))], return_tensors="pt")
        assert inputs["pixel_values"].shape[0] == 2 and "pixel_mask" in inputs  # the any-size processor was saved
        card = ModelCard.load(output / "README.md")
        assert card.data.pipeline_tag == "image-segmentation" and "mean_iou" in card.text
    assert VecaForSemanticSegmentation.from_pretrained(tmp_path / "linear").config.default_num_core_tokens == 8


def test_depth_script_linear_and_depth_anything(tmp_path, veca_folder, script_env, monkeypatch):
    png = write_parquet_dataset(tmp_path / "png", {"train": 8, "validation": 4}, depth_as_png=True)
    floats = write_parquet_dataset(tmp_path / "floats", {"train": 12}, depth_as_png=False)  # validation held out
    runs = [
        ("linear", ["--train_file", f"{png}/train.parquet", "--validation_file", f"{png}/validation.parquet"]),
        ("depth_anything", ["--dataset_name", str(floats)]),
    ]
    options = {
        "linear": ["--depth_scale", "1000"],
        "depth_anything": ["--head_hidden_size", "16", "--max_depth", "6", "--freeze_backbone"],
    }
    for head, data in runs:
        output, extra = tmp_path / head, options[head]
        argv = ["--model_name_or_path", str(veca_folder), "--head", head, *data]
        run_script("finetune_depth", [*argv, "--output_dir", str(output), *COMMON, *extra], monkeypatch)

        results = json.loads((output / "all_results.json").read_text())
        for budget in (8, 16):
            assert 0 < results[f"eval_C{budget}_rmse"] < 10 and 0 <= results[f"eval_C{budget}_delta1"] <= 1
            assert f"eval_C{budget}_abs_rel" in results
        model = AutoModelForDepthEstimation.from_pretrained(output)
        assert (
            type(model) is {"linear": VecaForDepthEstimation, "depth_anything": DepthAnythingForDepthEstimation}[head]
        )
        assert ModelCard.load(output / "README.md").data.pipeline_tag == "depth-estimation"
    # the new linear head started at the mean training depth (about 3 m), not at 0
    assert 1.0 < VecaForDepthEstimation.from_pretrained(tmp_path / "linear").head.bias.item() < 5.0
