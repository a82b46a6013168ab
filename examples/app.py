#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""The budget dial as a web page: turn VECA's number of cores and watch its features, its cores and its cost.

    pip install -e ".[app]"
    python examples/app.py                                   # the student `bash run.sh` saves
    python examples/app.py --model_name_or_path FOLDER_OR_HUB_ID [--teacher_name_or_path FOLDER_OR_HUB_ID]
    python examples/app.py --model_name_or_path HUB_ID --write_space space/    # a ready Hugging Face Space

Serves on 127.0.0.1 (`--server_name 0.0.0.0` to share). Every picture comes from `veca_hf.demo.dial.dial`;
this file only lays them out. Uploads and pictures stay in one temporary folder, pruned as they age (`DELETE_CACHE`).
"""

import argparse
import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB_STUDENT = ROOT / "outputs" / "demo" / "veca-student"  # examples/configs/demo_cpu.yaml's output_dir
MAIN_JOB_PHOTOS = ROOT / "outputs" / "demo" / "photos"
SPACE_SETTINGS = "dial_space.json"  # a Space's model ids, written by --write_space beside its app.py
MAX_SIDE = 1024  # larger uploads are resized (with a note): bounds memory and time on a shared Space
DELETE_CACHE = (600, 3600)  # every 10 minutes, delete the uploads and pictures older than an hour
SPACE_REQUIREMENTS = [
    "torch>=2.6",
    "transformers>=5.24",
    "huggingface_hub>=1.31",
    "safetensors>=0.4",
    "numpy",
    "pillow",
    "matplotlib>=3.7",
    "gradio>=6.0",
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", help=f"A VECA folder or Hub id (default: {MAIN_JOB_STUDENT}).")
    parser.add_argument("--teacher_name_or_path", help="A DINOv2 / DINOv3 folder or Hub id, shown beside VECA.")
    parser.add_argument("--server_name", default="127.0.0.1", help="Where to listen (default: this machine only).")
    parser.add_argument("--server_port", type=int, default=7860)
    parser.add_argument("--concurrency", type=int, default=1, help="Requests computed at once (others queue).")
    parser.add_argument("--queue_size", type=int, default=16, help="Requests allowed to wait.")
    parser.add_argument("--write_space", metavar="DIR", help="Write a Hugging Face Space for the model id, then exit.")
    return parser.parse_args(argv)


def resolve_model(model_name_or_path: str | None) -> str:
    """The model to show: the one given, a Space's own, or the student the main job saved. Never a random one."""
    if model_name_or_path:
        return model_name_or_path
    settings = Path(__file__).with_name(SPACE_SETTINGS)
    if settings.is_file():
        return json.loads(settings.read_text())["model_name_or_path"]
    if (MAIN_JOB_STUDENT / "config.json").is_file():
        return str(MAIN_JOB_STUDENT)
    raise SystemExit(
        f"No model: none given and no trained student at {MAIN_JOB_STUDENT}. Run `bash run.sh` (the main job "
        "distils one), or pass --model_name_or_path FOLDER_OR_HUB_ID."
    )


def wrote_space(folder: Path) -> bool:
    """Whether `folder` is a Space this app wrote: it holds the settings file, with a model id in it."""
    try:
        return "model_name_or_path" in json.loads((folder / SPACE_SETTINGS).read_text())
    except (OSError, ValueError, TypeError):
        return False


def write_space(directory: str, model_name_or_path: str, teacher_name_or_path: str | None) -> Path:
    """A folder that is a Hugging Face Space: this app, the `veca_hf` package beside it, requirements, front matter.
    Only a new or empty folder, or a Space this app wrote before, is written: the Space replaces `README.md`, `app.py`
    and `veca_hf/` in it."""
    import gradio

    import veca_hf

    if not model_name_or_path:
        raise SystemExit("--write_space needs --model_name_or_path: the Hub id the Space will show.")
    space = Path(directory)
    if space.exists() and not (space.is_dir() and (wrote_space(space) or not any(space.iterdir()))):
        raise SystemExit(
            f"--write_space {directory}: {space.resolve()} is neither an empty folder nor a Space this app wrote (no "
            f"{SPACE_SETTINGS} with a model id in it); writing there would replace its README.md, app.py and "
            "veca_hf/. Pass a new or empty folder."
        )
    space.mkdir(parents=True, exist_ok=True)
    app, package, package_copy = space / "app.py", Path(veca_hf.__file__).parent, space / "veca_hf"
    # a Space rewritten by its own app (`python space/app.py --write_space space`) runs from these very files
    if not (app.exists() and app.samefile(__file__)):
        shutil.copyfile(__file__, app)
    if not (package_copy.exists() and package_copy.samefile(package)):
        shutil.rmtree(package_copy, ignore_errors=True)
        shutil.copytree(package, package_copy, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    settings = {"model_name_or_path": model_name_or_path, "teacher_name_or_path": teacher_name_or_path}
    (space / SPACE_SETTINGS).write_text(json.dumps(settings, indent=1) + "\n")
    (space / "requirements.txt").write_text("\n".join(SPACE_REQUIREMENTS) + "\n")
    (space / "README.md").write_text(
        "---\n"
        "title: VECA budget dial\n"
        "colorFrom: blue\n"
        "colorTo: green\n"
        "sdk: gradio\n"
        f"sdk_version: {gradio.__version__}\n"
        "app_file: app.py\n"
        "pinned: false\n"
        "---\n\n"
        f"Turn the budget of [{model_name_or_path}](https://huggingface.co/{model_name_or_path}), a VECA vision "
        "transformer (arXiv 2605.12491), and watch its patch features, where its cores sit and what attention "
        "costs against a dense ViT.\n"
    )
    return space


def build_demo(model, teacher, example_photos: list[str]):
    import gradio as gr

    from veca_hf.demo.dial import dial

    config = model.config
    patch = config.patch_size
    resolutions = sorted({patch * round(side / patch) for side in (224, 448, 672, 896, 1024) if side <= MAX_SIDE})

    def show(image, budget, resolution, block, core, click_x, click_y):
        if image is None:
            raise gr.Error("Upload an image (JPEG, PNG or WebP) or pick an example first.")
        budget, block, core = int(budget), int(block), int(core)
        notes = []
        if core >= budget:
            notes.append(f"Core {core} is not active at C = {budget}: showing core {budget - 1}.")
            core = budget - 1
        click = None if click_x is None or click_y is None or min(click_x, click_y) < 0 else (click_x, click_y)
        try:
            out = dial(model, image, budget, int(resolution), block - 1, core, click, teacher, max_side=MAX_SIDE)
        except ValueError as error:
            raise gr.Error(str(error)) from None
        numbers = {
            "budget": budget,
            "resolution": int(resolution),
            "seconds": round(out.seconds, 4),
            "attention_gflops": out.attention_flops / 1e9,
            "dense_attention_gflops": out.dense_attention_flops / 1e9,
            "clicked_patch": list(out.clicked_patch),
            "policy_budget": out.policy_budget,
        }
        text = (
            f"**C = {budget}** at {image_size(out)}: forward {out.seconds * 1e3:.0f} ms; attention "
            f"{out.attention_flops / 1e9:.2f} GFLOPs against {out.dense_attention_flops / 1e9:.2f} for a dense ViT "
            f"of the same size ({out.attention_flops / out.dense_attention_flops:.2f}x)."
        )
        if out.policy_budget is not None:
            text += f"\n\nThe model's budget policy picks **C = {out.policy_budget}** for this image."
        text += "".join(f"\n\n{note}" for note in [*out.notes, *notes])
        return (out.patches, out.similarity, out.cores, out.core_attention, out.cost, out.teacher_patches,
                out.teacher_similarity, text, numbers)  # fmt: skip

    def image_size(out) -> str:
        width, height = out.patches.size
        return f"{width} x {height} px"

    def clicked(evt: gr.SelectData):
        return evt.index[0], evt.index[1]

    with gr.Blocks(title="VECA budget dial", delete_cache=DELETE_CACHE) as demo:
        gr.Markdown(
            "# VECA: the budget dial\nPatches never attend to each other: they talk through `C` learned cores, so "
            "attention costs `2NC + C^2` instead of `N^2`. Pick `C` and see what it changes. Click a patch on the "
            "feature picture for its similarity map."
        )
        with gr.Row():
            with gr.Column(scale=1):
                # a path, not pixels: Gradio then only reads the header, and `dial` refuses a too-large image
                # before decoding it (image_mode=None, or Gradio converts, so decodes, every non-RGB upload)
                image = gr.Image(type="filepath", label="image", sources=["upload"], image_mode=None)
                if example_photos:
                    gr.Examples(example_photos, inputs=image)
                budget = gr.Slider(config.core_chunk_size, config.core_bank_size, value=config.core_bank_size,
                                   step=config.core_chunk_size, label="budget C (active cores)")  # fmt: skip
                resolution = gr.Dropdown(resolutions, value=resolutions[0], label="resolution (short side, px)")
                block = gr.Slider(1, config.num_hidden_layers, value=config.num_hidden_layers, step=1, label="block")
                core = gr.Slider(0, config.core_bank_size - 1, value=0, step=1, label="core")
                with gr.Row():  # set by a click on the feature picture; -1: the image's centre
                    click_x = gr.Number(label="clicked x (px)", value=-1)
                    click_y = gr.Number(label="clicked y (px)", value=-1)
                run = gr.Button("Show", variant="primary")
            with gr.Column(scale=2):
                summary = gr.Markdown()
                with gr.Row():
                    patches = gr.Image(label="patch features (PCA, one basis for every C)", interactive=False)
                    similarity = gr.Image(label="cosine to the clicked patch", interactive=False)
                with gr.Row():
                    cores = gr.Image(label="cores over the image in this block", interactive=False)
                    attention = gr.Image(label="this core's attention over the patches", interactive=False)
                with gr.Row(visible=teacher is not None):
                    teacher_patches = gr.Image(label="teacher: patch features (PCA)", interactive=False)
                    teacher_similarity = gr.Image(label="teacher: cosine to the clicked patch", interactive=False)
                cost = gr.Image(label="attention cost against resolution", interactive=False)
                numbers = gr.JSON(label="numbers")
        inputs = [image, budget, resolution, block, core, click_x, click_y]
        outputs = [patches, similarity, cores, attention, cost, teacher_patches, teacher_similarity, summary, numbers]
        run.click(show, inputs, outputs, api_name="show")
        budget.release(show, inputs, outputs, api_name=False)
        patches.select(clicked, None, [click_x, click_y], api_name=False).then(show, inputs, outputs, api_name=False)
    return demo


def example_photos(temp_dir: Path) -> list[str]:
    """A few real photos: those the main job wrote, else those in the `demo` extra's wheels, else none."""
    photos = sorted(MAIN_JOB_PHOTOS.glob("*.jpg")) + sorted(MAIN_JOB_PHOTOS.glob("*.png"))
    if not photos:
        try:
            from veca_hf.demo import offline_photos

            folder = offline_photos(temp_dir / "photos")
            photos = sorted(path for path in folder.rglob("*") if path.suffix.lower() in (".jpg", ".png"))
        except (ImportError, RuntimeError, ValueError):
            photos = []
    return [str(path) for path in photos[:4]]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.write_space:
        print(f"Wrote a Space to {write_space(args.write_space, args.model_name_or_path, args.teacher_name_or_path)}")
        return
    temp_dir = Path(tempfile.mkdtemp(prefix="veca-dial-"))
    os.environ["GRADIO_TEMP_DIR"] = str(temp_dir)  # uploads and pictures: nowhere else
    atexit.register(shutil.rmtree, temp_dir, ignore_errors=True)
    import gradio as gr
    import torch
    from transformers import AutoModel

    import veca_hf  # noqa: F401  (registers VECA with the Auto classes)

    model_name_or_path = resolve_model(args.model_name_or_path)
    teacher_name_or_path = args.teacher_name_or_path
    settings = Path(__file__).with_name(SPACE_SETTINGS)
    if teacher_name_or_path is None and not args.model_name_or_path and settings.is_file():
        teacher_name_or_path = json.loads(settings.read_text()).get("teacher_name_or_path")
    torch.set_grad_enabled(False)
    model = AutoModel.from_pretrained(model_name_or_path).eval()
    if getattr(model.config, "model_type", None) != "veca":
        raise SystemExit(f"{model_name_or_path} is a {model.config.model_type} model, not VECA.")
    teacher = AutoModel.from_pretrained(teacher_name_or_path).eval() if teacher_name_or_path else None
    demo = build_demo(model, teacher, example_photos(temp_dir))
    demo.queue(default_concurrency_limit=args.concurrency, max_size=args.queue_size)
    demo.launch(
        server_name=args.server_name,
        server_port=args.server_port,
        max_file_size="20mb",
        allowed_paths=[str(temp_dir)],
        theme=gr.themes.Default(),
    )


if __name__ == "__main__":
    main()
