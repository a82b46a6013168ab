"""Guard: a short run of examples/distill.py makes a tiny student follow its teacher on images it never saw.

The training loss going down is not enough (a student can fit the targets' mean, or the training images); here the
measure is independent of the training code: the frozen student's and teacher's features on held-out images,
extracted with `veca_hf.evaluation.extract_features`, compared after subtracting each model's mean feature, so that
only the image-to-image variation counts. The same run with a zero learning rate is the student at initialisation; a
broken step (no update, a detached loss, targets taken from the wrong tokens) stays near it.
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
