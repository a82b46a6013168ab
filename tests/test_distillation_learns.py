"""Guard: a short run of examples/distill.py makes a tiny student follow its teacher on images it never saw.

The training loss going down is not enough (a student can fit the targets' mean, or the training images); here the
measure is independent of the training code: the frozen student's and teacher's features on held-out images,
extracted with `veca_hf.evaluation.extract_features`, compared after subtracting each model's mean feature, so that
only the image-to-image variation counts. The same run with a zero learning rate is the student at initialisation; a
broken step (no update, a detached loss, targets taken from the wrong tokens) stays near it.

Following the teacher is not yet usefulness; the last test checks the direction on a labelled probe: where the
teacher's features carry a label and a random network's hardly do, the distilled student's must carry it too.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config, tiny_dinov3_config
from PIL import Image
from transformers import AutoModel, DINOv3ViTModel

from veca_hf import evaluation


ROOT = Path(__file__).parent.parent
RESOLUTION = 64  # 4 x 4 patches of 16 px
MARGIN = 0.5  # what the trained student's centred cosines must gain over initialisation (seen: ~0.95)


def shapes_image(rng: np.random.Generator, size: int = 80) -> np.ndarray:
    """A smooth background and a few coloured rectangles: content the teacher's features vary with."""
    y, x = np.mgrid[0:size, 0:size] / size
    base = rng.uniform(0, 255, 3) + rng.uniform(-80, 80, 3) * (x[..., None] * rng.uniform(-1, 1)
                                                               + y[..., None] * rng.uniform(-1, 1))  # fmt: skip
    image = np.clip(base, 0, 255)
    for _ in range(rng.integers(2, 5)):
        x0, y0 = rng.integers(0, size - 16, 2)
        w, h = rng.integers(12, size // 2, 2)
        image[y0 : y0 + h, x0 : x0 + w] = rng.uniform(0, 255, 3)
    return image.astype(np.uint8)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("learns")
    torch.manual_seed(0)
    DINOv3ViTModel(tiny_dinov3_config()).save_pretrained(root / "teacher")  # random but fixed weights
    tiny_config().save_pretrained(root / "student")  # width 64 = the teacher's: features compare directly
    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    for index in range(256):
        Image.fromarray(shapes_image(rng)).save(root / "images" / f"{index:03d}.png")
    heldout = [shapes_image(rng) for _ in range(48)]  # never streamed
    return root, heldout


def distill(
    workspace: Path, output_dir: Path, learning_rate: float, steps: int, monkeypatch, optimizer="adamw"
) -> Path:
    spec = importlib.util.spec_from_file_location("distill_guard", ROOT / "examples" / "distill.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    values = dict(
        teacher_name_or_path=workspace / "teacher", student_config=workspace / "student",
        dataset_name=workspace / "images", output_dir=output_dir, resolution=RESOLUTION, validation_size=8,
        per_device_train_batch_size=16, per_device_eval_batch_size=8, max_train_steps=steps, warmup_steps=4,
        learning_rate=learning_rate, min_learning_rate=learning_rate / 10, budgets="8,16", budget_weights="1,1",
        checkpointing_steps=0, validation_steps=1000, dataloader_num_workers=0, shuffle_buffer_size=64, seed=0,
        model_card_latency=False, optimizer=optimizer,
        # NOTE: the tiny random teacher's patch features are mostly its patch embedding: a copied one would make the
        # student at initialisation already match them, and the guard measures what training adds.
        init_patch_embeddings_from_teacher="no",
    )  # fmt: skip
    argv = [item for key, value in values.items() for item in (f"--{key}", str(value))]
    monkeypatch.setattr(sys, "argv", ["distill.py", *argv])
    script.main()
    return output_dir


def retrieval_accuracy(student: torch.Tensor, teacher: torch.Tensor) -> float:
    """How often a student feature's most similar teacher feature (centred cosine) is the one at its own index."""
    student = F.normalize(student - student.mean(-2, keepdim=True), dim=-1)
    teacher = F.normalize(teacher - teacher.mean(-2, keepdim=True), dim=-1)
    best = (student @ teacher.transpose(-1, -2)).argmax(-1)  # (..., n)
    return float((best == torch.arange(best.shape[-1])).float().mean())


@torch.no_grad()
def heldout_similarity(student_dir: Path, teacher_dir: Path, images: list[np.ndarray]) -> dict[str, float]:
    """Per student budget, on held-out images: the centred cosine of the global features (core 1 vs CLS) and of the
    patch features, and two retrievals: the teacher image whose CLS is nearest to the student's global feature
    (among the held-out images), and the teacher patch nearest to each student patch (among the same image's)."""
    pixel_values = torch.stack([evaluation.preprocess_image(Image.fromarray(a), RESOLUTION) for a in images])
    teacher = AutoModel.from_pretrained(teacher_dir).eval()
    student = AutoModel.from_pretrained(student_dir).eval()
    teacher_global, teacher_patches = evaluation.extract_features(teacher, pixel_values)  # (N, D), (N, Hp, Wp, D)
    scores = {}
    for budget in (8, 16):
        student_global, student_patches = evaluation.extract_features(student, pixel_values, budget)
        cosines = evaluation.global_feature_cosine(student_global, teacher_global)
        scores[f"global C={budget}"] = cosines["centred_cosine"]
        s, t = student_patches.flatten(0, 2), teacher_patches.flatten(0, 2)  # (N * Hp * Wp, D)
        scores[f"patches C={budget}"] = float(F.cosine_similarity(s - s.mean(0), t - t.mean(0), dim=-1).mean())
        scores[f"image retrieval C={budget}"] = retrieval_accuracy(student_global, teacher_global)
        scores[f"patch retrieval C={budget}"] = retrieval_accuracy(student_patches.flatten(1, 2),
                                                                   teacher_patches.flatten(1, 2))  # fmt: skip
    return scores


def learned(trained: dict[str, float], initial: dict[str, float]) -> bool:
    """The guard. Seen on 2 CPU cores: initialisation ~0 cosine, 0 / 0.06 retrieval; trained 0.98 / 0.95 cosine,
    0.8 / 0.6 retrieval; trained on targets off by one patch token 0.97 / 0.87 cosine but 0.3 patch retrieval."""
    cosines_gain = all(trained[n] - initial[n] > MARGIN for n in trained if "retrieval" not in n)
    images_found = all(trained[n] >= 0.5 for n in trained if n.startswith("image retrieval"))
    patches_found = all(trained[n] >= 0.45 for n in trained if n.startswith("patch retrieval"))
    return cosines_gain and images_found and patches_found


@pytest.fixture(scope="module")
def initial_similarity(workspace, tmp_path_factory):
    """lr = 0: the student at initialisation (same seed, same construction), through the same script."""
    root, heldout = workspace
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        frozen = distill(root, tmp_path_factory.mktemp("frozen"), 0.0, 2, monkeypatch)
    return heldout_similarity(frozen, root / "teacher", heldout)


@pytest.mark.parametrize("optimizer", ["adamw", "normuon"])
def test_distillation_brings_heldout_features_towards_the_teacher(
    workspace, initial_similarity, optimizer, tmp_path, monkeypatch
):
    root, heldout = workspace
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trained_dir = distill(root, tmp_path / "trained", 3e-3, 40, monkeypatch, optimizer=optimizer)
    trained, initial = heldout_similarity(trained_dir, root / "teacher", heldout), initial_similarity
    assert learned(trained, initial), {name: (initial[name], trained[name]) for name in trained}
    assert not learned(initial, initial)  # a run that did not move fails the guard


# The direction of learning: a short distillation must make the student's features more useful than its own
# initialisation where the teacher's are. The teacher here is the tiny random DINOv3 with one thing added by hand: its
# patch embedding is strongly sensitive to red minus green, so its features separate images by the colour of a square
# that the label is about, while the scene around it (grey-blue backgrounds and distractors, red = green everywhere
# else) dominates a random network's features. A k-NN probe (DINO's evaluation) reads each feature space's notion of
# similarity directly: the teacher's finds the label, the random student's mostly finds the background.
COLOUR_CONTRAST = 15  # grey levels the square's red and green move apart (seen: random 0.6-0.7, teacher 1.0)


def labelled_scene(rng: np.random.Generator, label: int, size: int = 72) -> np.ndarray:
    """A grey-blue scene (red = green) with a 28-px square that is slightly red (label 1) or slightly green (0)."""
    y, x = np.mgrid[0:size, 0:size] / size

    def ramp() -> np.ndarray:
        return rng.uniform(30, 225) + rng.uniform(-50, 50) * (x * rng.uniform(-1, 1) + y * rng.uniform(-1, 1))

    grey, blue = ramp(), ramp()
    image = np.stack([grey, grey, blue], axis=-1)
    for _ in range(rng.integers(1, 4)):
        x0, y0 = rng.integers(0, size - 12, 2)
        w, h = rng.integers(10, 36, 2)
        grey_level, blue_level = rng.uniform(0, 255, 2)
        image[y0 : y0 + h, x0 : x0 + w] = (grey_level, grey_level, blue_level)
    x0, y0 = rng.integers(0, size - 28, 2)
    shift = COLOUR_CONTRAST if label else -COLOUR_CONTRAST
    image[y0 : y0 + 28, x0 : x0 + 28, 0] += shift
    image[y0 : y0 + 28, x0 : x0 + 28, 1] -= shift
    return np.clip(image, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def colour_workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("direction")
    torch.manual_seed(0)
    teacher = DINOv3ViTModel(tiny_dinov3_config())
    with torch.no_grad():
        weight = teacher.embeddings.patch_embeddings.weight  # (D, 3, 16, 16)
        red_minus_green = torch.zeros(weight.shape[1:])
        red_minus_green[0], red_minus_green[1] = 1.0, -1.0
        direction = torch.randn(weight.shape[0])  # (D,)
        gain = 20 / (direction.norm() * red_minus_green.norm())
        weight.add_(gain * direction[:, None, None, None] * red_minus_green)
    teacher.save_pretrained(root / "teacher")
    tiny_config().save_pretrained(root / "student")
    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    for index in range(256):  # unlabelled, as distillation data is
        Image.fromarray(labelled_scene(rng, int(rng.integers(0, 2)))).save(root / "images" / f"{index:03d}.png")
    labels = rng.integers(0, 2, 200)  # held out: 100 references, 100 to classify
    pixel_values = torch.stack([evaluation.preprocess_image(Image.fromarray(labelled_scene(rng, int(label))),
                                                            RESOLUTION) for label in labels])  # fmt: skip
    return root, pixel_values, torch.as_tensor(labels)


@torch.no_grad()
def knn_accuracies(model_dir: Path, pixel_values: torch.Tensor, labels: torch.Tensor, budgets) -> dict[str, float]:
    """20-NN accuracy on the second half of the images with the first half as references, per budget and feature
    (global; mean of the patches), features centred on the references' mean."""
    from veca_hf.evaluation.knn import knn_classify

    model, half = AutoModel.from_pretrained(model_dir).eval(), len(labels) // 2
    accuracies = {}
    for budget in budgets:
        global_features, patches = evaluation.extract_features(model, pixel_values, budget)
        for name, features in (("global", global_features), ("patches", patches.mean(dim=(1, 2)))):
            features = features - features[:half].mean(0)
            predicted = knn_classify(features[:half], labels[:half], features[half:], num_classes=2, k=20)
            accuracies[f"{name} C={budget}"] = float((predicted == labels[half:]).float().mean())
    return accuracies


def test_distillation_makes_features_more_useful_than_the_initialisation(colour_workspace, tmp_path, monkeypatch):
    root, pixel_values, labels = colour_workspace
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    teacher = knn_accuracies(root / "teacher", pixel_values, labels, budgets=[None])
    assert min(teacher.values()) >= 0.95, teacher  # the task is one the teacher's features solve
    initial = knn_accuracies(distill(root, tmp_path / "initial", 0.0, 2, monkeypatch), pixel_values, labels, (8, 16))
    assert max(initial.values()) <= 0.85, initial  # ... and a random student's do not
    trained = knn_accuracies(distill(root, tmp_path / "trained", 3e-3, 40, monkeypatch), pixel_values, labels, (8, 16))
    gains = {name: trained[name] - initial[name] for name in trained}
    assert min(gains.values()) >= 0.15, {name: (initial[name], trained[name]) for name in trained}
