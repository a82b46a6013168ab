"""The demo app (`examples/app.py`): it never shows a random network, writes a ready Space (and refuses to write over
a folder it did not write), answers over loopback through `gradio_client` for two budgets (FLOPs grow with the
budget), refuses a too-large upload before decoding it, cleans its cache, and works in a real headless Chromium:
upload a photo, show, move the budget slider, no error on the page, a screenshot; a text file is refused by name."""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageDraw
import pytest
import torch
from conftest import tiny_config
from test_dial import png_header_only

from veca_hf import VecaModel


ROOT = Path(__file__).parent.parent
APP = ROOT / "examples" / "app.py"


def load_app():
    spec = importlib.util.spec_from_file_location("veca_dial_app", APP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def photo(path: Path, size=(320, 240)) -> Path:
    """A photo-like picture: a sky gradient, a sun and a house."""
    width, height = size
    sky = np.linspace([90, 140, 230], [230, 240, 250], height).astype(np.uint8)[:, None].repeat(width, axis=1)
    image = PIL.Image.fromarray(sky)
    draw = PIL.ImageDraw.Draw(image)
    draw.rectangle((0, height * 2 // 3, width, height), fill=(60, 140, 60))
    draw.ellipse((width - 90, 20, width - 30, 80), fill=(250, 210, 60))
    draw.rectangle((60, height // 2, 150, height * 2 // 3 + 20), fill=(170, 60, 50))
    draw.polygon([(50, height // 2), (105, height // 3), (160, height // 2)], fill=(90, 40, 30))
    image.save(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("app") / "tiny"
    VecaModel(tiny_config()).save_pretrained(folder)  # patch 16, budgets 8 and 16, 2 blocks
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """The app launched as a user launches it, on a free loopback port; its URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("app_log") / "app.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(APP), "--model_name_or_path", str(model_dir), "--server_port", str(port)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 180
        while "Running on local URL" not in log.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the app did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_without_a_model_the_app_names_the_command_to_run(monkeypatch, tmp_path):
    app = load_app()
    monkeypatch.setattr(app, "MAIN_JOB_STUDENT", tmp_path / "none")
    with pytest.raises(SystemExit, match=r"Run `bash run.sh`.*--model_name_or_path"):
        app.resolve_model(None)
    trained = tmp_path / "student"
    VecaModel(tiny_config()).save_pretrained(trained)
    monkeypatch.setattr(app, "MAIN_JOB_STUDENT", trained)
    assert app.resolve_model(None) == str(trained)  # the main job's student
    assert app.resolve_model("org/veca") == "org/veca"


def test_write_space_makes_a_ready_space(tmp_path):
    app = load_app()
    space = app.write_space(str(tmp_path / "space"), "org/veca-b16", "facebook/dinov3-vitb16-pretrain-lvd1689m")
    readme = (space / "README.md").read_text()
    assert readme.startswith("---\n") and "\nsdk: gradio\n" in readme and "\napp_file: app.py\n" in readme
    requirements = (space / "requirements.txt").read_text().split()
    assert {"gradio>=6.0", "torch>=2.6", "transformers>=5.24"} <= set(requirements)
    assert all(">=" in line or line.isidentifier() for line in requirements)  # lower bounds, never pins
    assert (space / "app.py").read_text() == APP.read_text()
    assert (space / "veca_hf" / "demo" / "dial.py").is_file() and not list(space.rglob("__pycache__"))
    settings = json.loads((space / app.SPACE_SETTINGS).read_text())
    assert settings == {
        "model_name_or_path": "org/veca-b16",
        "teacher_name_or_path": "facebook/dinov3-vitb16-pretrain-lvd1689m",
    }
    # the Space's own app finds its model without flags (its settings file sits beside it)
    spec = importlib.util.spec_from_file_location("space_app", space / "app.py")
    space_app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(space_app)
    assert space_app.resolve_model(None) == "org/veca-b16"


def tree(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_write_space_refuses_a_folder_it_did_not_write(tmp_path):
    app = load_app()
    checkout = tmp_path / "checkout"  # `--write_space src` and `--write_space .` of an editable install
    (checkout / "src" / "veca_hf").mkdir(parents=True)
    (checkout / "src" / "veca_hf" / "__init__.py").write_text("# the package\n")
    (checkout / "README.md").write_text("# the repository\n")
    before = tree(checkout)
    for folder in (checkout / "src", checkout, checkout / "README.md"):
        argv = ["--write_space", str(folder), "--model_name_or_path", "org/veca-b16"]
        message = (
            rf"{re.escape(str(folder))} is neither an empty folder nor a Space this app wrote.*new or empty folder"
        )
        with pytest.raises(SystemExit, match=message):
            app.main(argv)
    assert tree(checkout) == before  # nothing written, nothing deleted

    space = app.write_space(str(tmp_path / "space"), "org/veca-b16", None)  # a new folder
    (space / "notes.md").write_text("kept\n")
    app.write_space(str(space), "org/veca-l16", "facebook/dinov3-vitl16-pretrain-lvd1689m")  # its own Space again
    assert json.loads((space / app.SPACE_SETTINGS).read_text())["model_name_or_path"] == "org/veca-l16"
    assert (space / "notes.md").read_text() == "kept\n" and (space / "veca_hf" / "demo" / "dial.py").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (app.write_space(str(empty), "org/veca-b16", None) / app.SPACE_SETTINGS).is_file()


@pytest.mark.processes
def test_a_space_rewritten_by_its_own_app_keeps_its_package(tmp_path):
    space = load_app().write_space(str(tmp_path / "space"), "org/veca-b16", None)
    command = [sys.executable, str(space / "app.py"), "--write_space", str(space), "--model_name_or_path", "org/b"]
    check = "import veca_hf, sys; print(veca_hf.__file__)"
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((space / "dial_space.json").read_text())["model_name_or_path"] == "org/b"
    imported = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=space, timeout=300)
    assert imported.stdout.strip() == str(space / "veca_hf" / "__init__.py")  # the Space's package is whole
    assert (space / "veca_hf" / "demo" / "dial.py").is_file()


def test_the_page_hands_over_uploads_undecoded_and_cleans_its_cache(tmp_path, monkeypatch):
    import gradio as gr
    import PIL.ImageFile
    from gradio.data_classes import FileData

    app = load_app()
    demo = app.build_demo(VecaModel(tiny_config()).eval(), None, [])
    assert demo.delete_cache == app.DELETE_CACHE and all(app.DELETE_CACHE)
    (upload,) = [block for block in demo.blocks.values() if isinstance(block, gr.Image) and block.label == "image"]
    huge = png_header_only(tmp_path / "huge.png", 12_000, 12_000)

    def no_decode(image):
        raise AssertionError("Gradio decoded the upload")

    monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", no_decode)
    with pytest.warns(PIL.Image.DecompressionBombWarning):  # PIL reads the header, warns, decodes nothing
        assert upload.preprocess(FileData(path=str(huge), orig_name="huge.png")) == str(huge)
    bomb = png_header_only(
        tmp_path / "bomb.png", 20_000, 20_000
    )  # past PIL's own limit: refused on reading its header
    with pytest.raises(PIL.Image.DecompressionBombError):
        upload.preprocess(FileData(path=str(bomb), orig_name="bomb.png"))


@pytest.mark.processes
def test_the_app_answers_over_loopback_for_two_budgets(served, tmp_path):
    from gradio_client import Client, handle_file

    client = Client(served, verbose=False)
    picture = handle_file(str(photo(tmp_path / "house.png")))
    answers = {}
    for budget in (8, 16):
        outputs = client.predict(picture, budget, 224, 2, 3, 40, 200, api_name="/show")
        patches, similarity, cores, attention, cost, _, _, summary, numbers = outputs
        for path in (patches, similarity, cores, attention):
            assert PIL.Image.open(path).size == (304, 224)  # 320 x 240 at short side 224, multiples of 16
        assert PIL.Image.open(cost).size[0] > 100
        assert f"C = {budget}" in summary and numbers["budget"] == budget
        assert numbers["clicked_patch"] == [12, 2]  # (x, y) = (40, 200) on the 304 x 224 picture (14 x 19 patches)
        answers[budget] = numbers
    assert answers[8]["attention_gflops"] < answers[16]["attention_gflops"] < answers[16]["dense_attention_gflops"]
    assert answers[8]["dense_attention_gflops"] == answers[16]["dense_attention_gflops"]

    from gradio_client.exceptions import AppError

    huge = handle_file(str(png_header_only(tmp_path / "huge.png", 12_000, 12_000)))  # 144 megapixels, a few KB
    with pytest.raises(AppError, match=r"12000 x 12000 pixels \(144 megapixels\), more than the limit of 50"):
        client.predict(huge, 8, 224, 2, 3, -1, -1, api_name="/show")


def chromium() -> str:
    """Debian's Chromium (`run.sh` installs it when missing); the browser test fails, never skips, without it."""
    path = os.environ.get("VECA_HF_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "No Chromium: install Debian's `chromium` (`bash run.sh test` does, as root) or set VECA_HF_CHROMIUM."
        )
    return path


@pytest.mark.processes
def test_a_real_browser_uploads_a_photo_and_turns_the_dial(served, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    errors = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(served)
            page.set_input_files("input[type=file]", str(photo(tmp_path / "house.png")))
            page.get_by_role("button", name="Show").click()
            expect(page.get_by_text("C = 16 at 304 x 224 px")).to_be_visible(timeout=60_000)
            # the budget slider to 8 (its number box, as a keyboard user sets it), then release: the pictures redraw
            budget_box = page.get_by_label("number input for budget C (active cores)")
            budget_box.fill("8")
            budget_box.press("Enter")
            page.get_by_role("button", name="Show").click()
            expect(page.get_by_text("C = 8 at 304 x 224 px")).to_be_visible(timeout=60_000)
            pictures = page.locator("img[src*='/gradio_api/file=']")
            expect(pictures.first).to_be_visible()
            assert pictures.count() >= 5  # patches, similarity, cores, attention, cost
            assert page.locator(".toast-body.error").count() == 0 and not page.get_by_text("Error").count()
            screenshot = Path(os.environ.get("VECA_HF_DEMO_SCREENSHOT", tmp_path / "demo.png"))
            page.screenshot(path=str(screenshot), full_page=True)
            assert PIL.Image.open(screenshot).size[0] >= 1400

            # a file that is not an image: refused by name; Show without an image asks for one
            (tmp_path / "notes.txt").write_text("not a picture")
            other = browser.new_page()
            other.goto(served)
            other.set_input_files("input[type=file]", str(tmp_path / "notes.txt"))
            expect(other.get_by_text("Invalid file type: notes.txt")).to_be_visible(timeout=30_000)
            other.get_by_role("button", name="Show").click()
            expect(other.get_by_text("Upload an image (JPEG, PNG or WebP)")).to_be_visible(timeout=30_000)
        finally:
            browser.close()
    assert errors == []
