# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Real photos for the demo, from PyPI wheels: [`offline_photos`] copies the colour photographs bundled in the
scikit-image and scikit-learn wheels into an image folder (`datasets`' "imagefolder" builder can read it).

Needs scikit-image and / or scikit-learn (the `demo` extra: `pip install veca_hf[demo]`); nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from transformers.utils import logging


logger = logging.get_logger(__name__)

# colour photographs bundled in the scikit-image wheel (the files behind `skimage.data.<name>()`):
# (output name, file in skimage.data.data_dir)
_SKIMAGE_PHOTOS = (
    ("astronaut", "astronaut.png"),
    ("chelsea", "chelsea.png"),
    ("coffee", "coffee.png"),
    ("hubble_deep_field", "hubble_deep_field.jpg"),
    ("immunohistochemistry", "ihc.png"),
    ("retina", "retina.jpg"),
    ("rocket", "rocket.jpg"),
    ("motorcycle_left", "motorcycle_left.png"),  # skimage.data.stereo_motorcycle()[0]
    ("motorcycle_right", "motorcycle_right.png"),  # skimage.data.stereo_motorcycle()[1]
)


def _photo_files() -> tuple[list[tuple[str, Path]], list[str]]:
    """(output stem, bundled file) for each colour photo in the installed wheels, and the pip packages missing.

    Nothing is downloaded: only files present in the installed packages are listed.
    """
    files: list[tuple[str, Path]] = []
    missing: list[str] = []
    try:
        import skimage.data as skdata  # lazy module: cheap
    except ImportError:
        missing.append("scikit-image")
    else:
        data_dir = Path(getattr(skdata, "data_dir", None) or os.path.dirname(skdata.__file__))
        for stem, filename in _SKIMAGE_PHOTOS:
            if (data_dir / filename).is_file():
                files.append((f"skimage_{stem}", data_dir / filename))
    # sklearn.datasets.load_sample_images() reads sklearn/datasets/images/*.jpg; importing sklearn takes seconds,
    # so the files are looked up without importing it (and through the function if they are not where expected)
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        missing.append("scikit-learn")
    else:
        locations = list(spec.submodule_search_locations or [])
        jpgs = sorted(p for loc in locations for p in (Path(loc) / "datasets" / "images").glob("*.jpg"))
        if not jpgs:
            try:
                from sklearn.datasets import load_sample_images

                jpgs = [Path(f) for f in load_sample_images().filenames]
            except Exception as error:
                logger.warning(f"sklearn.datasets.load_sample_images() failed, skipping it: {error}")
        files.extend((f"sklearn_{path.stem}", path) for path in jpgs)
    return files, missing


def _short_side(path: Path) -> int | None:
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            return min(image.size)
    except Exception:
        return None


def offline_photos(output_dir: str | Path, min_side: int = 256) -> Path:
    """Copy the real colour photos bundled in the scikit-image and scikit-learn wheels into `output_dir`.

    Sources (only files present in the installed wheels; nothing is downloaded): `skimage.data`'s astronaut,
    chelsea, coffee, hubble_deep_field, immunohistochemistry, retina, rocket and the stereo motorcycle pair, and the
    two images of `sklearn.datasets.load_sample_images()` (china, flower). The original PNG/JPEG files are copied
    byte for byte as `skimage_<name>.<ext>` / `sklearn_<name>.jpg` (RGB files; any other mode is converted to an RGB
    PNG). Photos whose short side is below `min_side` are skipped. The folder holds only image files, so
    `datasets.load_dataset("imagefolder", data_dir=output_dir)` reads it as one unlabelled split. Idempotent: files
    already there are kept.

    Returns:
        `output_dir` as a `Path`.

    Raises:
        ImportError: if neither scikit-image nor scikit-learn is installed.
        RuntimeError: if fewer than 4 photos were obtained.
    """
    from PIL import Image

    files, missing = _photo_files()
    if len(missing) == 2:
        raise ImportError(
            "offline_photos needs scikit-image or scikit-learn, in the `demo` extra: `pip install veca_hf[demo]`."
        )
    output_dir = Path(output_dir).expanduser()
    output_dir.mkdir(parents=True, exist_ok=True)
    written, skipped = [], [f"{name} (not installed)" for name in missing]
    for stem, source in files:
        candidates = (output_dir / f"{stem}{source.suffix.lower()}", output_dir / f"{stem}.png")
        existing = [p for p in candidates if p.is_file()]
        if existing and _short_side(existing[0]) is not None:
            path = existing[0]
        else:
            try:
                with Image.open(source) as image:
                    image.load()
                    if image.mode == "RGB":
                        path = output_dir / f"{stem}{source.suffix.lower()}"
                        tmp = path.with_name(f".{path.name}.tmp")
                        shutil.copyfile(source, tmp)
                    elif image.mode in ("RGBA", "P", "CMYK", "YCbCr", "LAB", "HSV"):
                        path = output_dir / f"{stem}.png"
                        tmp = path.with_name(f".{path.name}.tmp")
                        image.convert("RGB").save(tmp, format="PNG")
                    else:
                        raise ValueError(f"not a colour image (mode {image.mode})")
            except Exception as error:  # unreadable file, grey image, ...
                skipped.append(f"{stem} ({type(error).__name__}: {error})")
                continue
            os.replace(tmp, path)
        side = _short_side(path)
        if side is None or side < min_side:
            skipped.append(f"{stem} (short side {side} < {min_side})")
            path.unlink(missing_ok=True)
            continue
        written.append(path)
    if skipped:
        logger.info(f"offline_photos skipped: {'; '.join(skipped)}")
    if len(written) < 4:
        raise RuntimeError(
            f"offline_photos obtained only {len(written)} photos with a short side >= {min_side} px "
            f"(need at least 4); skipped: {'; '.join(skipped) or 'none'}"
        )
    return output_dir
