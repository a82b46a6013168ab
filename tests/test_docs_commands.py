"""The commands in README.md and docs/*.md run, as written, on a tiny model and generated images.

Every command of a `bash` block, and every `python ... --flag` command written inline, is either run here
(placeholders such as `<veca folder>` and `<imgs>` filled with generated stand-ins, and, only where the written
values would take minutes on 2 cores, a few flags appended that override them) or listed in `NOT_RUN` with the reason
(the Hub, a GPU, minutes of work, a server). A command added to the docs without either fails
`test_every_docs_command_is_run_or_has_a_reason`. Scripts with `main(argv)` run in this process; the others (and the
console script) in a subprocess.
"""

import importlib
import importlib.util
import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, random_pil_images, tiny_config, tiny_dinov3_config
from PIL import Image
from test_depth import depth_png, scene
from transformers import DINOv3ViTModel

from veca_hf import VecaImageProcessor, VecaModel


ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# What a placeholder of the docs stands for here (paths inside the workspace).
PLACEHOLDERS = {
    "<veca folder>": "veca-tiny",
    "<dinov3 or dinov2 folder>": "dinov3-tiny",
    "<dinov3 folder>": "dinov3-tiny",
    "<imgs>": "imgs",
    "<image + depth data>": "scenes",
    "<folder, shards or Hub id>": "imgs",
    "<folder>": "veca-tiny",
    "VECA_DIR": "veca-tiny",
    "TEACHER_DIR": "dinov3-tiny",
    "PHOTO": "photo.jpg",
}

# Run: (doc, command id) -> flags appended to the command as written (argparse keeps the last value of a flag).
RUN = {
    ("README.md", "examples/finetune_classification.py #1"): ["--max_steps", "2"],
    ("README.md", "examples/linear_probe.py #1"): ["--classification_steps", "5"],
    ("README.md", "examples/linear_probe.py #2"): ["--depth_steps", "5"],
    ("README.md", "examples/visualize_cores.py #1"): [],
    ("README.md", "examples/visualize_features.py #1"): ["--resolutions", "64,128", "--projection", "pca"],
    ("README.md", "examples/extract_features.py #1"): [],
    ("README.md", "veca_hf.hub.convert_veca_original #1"): [],
    ("README.md", "veca_hf.hub.convert_veca_original #2"): [],
    ("README.md", "veca_hf.hub.export_onnx #1"): [],
    ("docs/conversion.md", "veca_hf.hub.convert_veca_original #1"): [],
    ("docs/conversion.md", "veca-convert #1"): [],
    ("docs/usage.md", "veca_hf.hub.export_onnx #1"): [],
    ("docs/budget_picker.md", "examples/finetune_classification.py #1"): ["--max_steps", "2"],
    ("docs/evaluation.md", "examples/linear_probe.py #3"): ["--depth_steps", "5", "--resolutions", "64"],
    ("docs/evaluation.md", "examples/visualize_cores.py #1"): [],
    ("docs/performance.md", "benchmarks/scaling.py #1"): [],  # --help
    ("docs/training.md", "examples/distill.py #16"): [],  # --help
    ("docs/pictures.md", "examples/visualize_features.py #1"): ["--resolutions", "64,128", "--projection", "pca"],
    ("docs/pictures.md", "examples/visualize_cores.py #1"): ["--resolution", "128", "--projection", "pca"],
}

# Not run: (doc, command id, or the program for all its commands in that doc) -> why.
NOT_RUN = {
    ("README.md", "bash"): "minutes: `run.sh` sets up a virtual environment, then distils or runs the whole suite",
    ("README.md", "pip"): "the network: installs packages (and the last line then starts the demo's server)",
    ("README.md", "examples/distill.py #1"): "the Hub: the gated DINOv3 teacher (tests/test_distill_script.py "
    "runs the script on a tiny teacher)",
    ("docs/usage.md", "pip"): "the network: installs packages",
    ("docs/performance.md", "benchmarks/implementations.py #1"): "minutes: VECA-B/16 twice and DINOv3-B at 512 and "
    "1024 px (tests/test_benchmark_implementations.py runs it on tiny models)",
    ("docs/usage.md", "examples/extract_features.py #1"): "the network: remote webdataset shards over HTTPS",
    ("docs/usage.md", "examples/extract_features.py #2"): "several machines; its flags are the command above's",
    ("docs/conversion.md", "veca-convert #2"): "the Hub: pushes to my-org/veca-b16",
    ("docs/demo.md", "pip"): "the network: installs packages",
    ("docs/demo.md", "examples/app.py"): "a server that runs until stopped; --write_space with a Hub id and the Hub "
    "teacher (tests/test_app.py writes a Space from a local folder)",
    ("docs/demo.md", "python -"): "minutes and GiBs: VECA-B/16 at 1024 px, measuring peak memory",
    ("docs/dense_tasks.md", "examples/finetune_segmentation.py #1"): "a synopsis: `linear|upernet` and "
    "`<hub id | folder | file.parquet>` list alternatives; the runnable commands follow in the docs",
    ("docs/dense_tasks.md", "examples/finetune_depth.py #1"): "a synopsis, as above",
    ("docs/dense_tasks.md", "examples/finetune_segmentation.py"): "minutes: 100 Trainer steps each on the docs' "
    "generated `data` (tests/test_dense_finetune.py trains every head)",
    ("docs/dense_tasks.md", "examples/finetune_depth.py"): "minutes: 100 Trainer steps each, as above",
    ("docs/dense_tasks.md", "VECA="): "part of the paper-protocol recipe (the Hub and a GPU)",
    ("docs/dense_tasks.md", "PROBE="): "part of the paper-protocol recipe (the Hub and a GPU)",
    ("docs/dense_tasks.md", "ADE="): "the Hub: ADE20K",
    ("docs/dense_tasks.md", "VOC="): "the Hub: PASCAL VOC",
    ("docs/dense_tasks.md", "NYU="): "the Hub: NYUv2",
    ("docs/dense_tasks.md", "hf"): "the Hub: downloads label files",
    ("docs/evaluation.md", "examples/linear_probe.py #1"): "hours and data sets: ImageNet-1k on a GPU",
    ("docs/evaluation.md", "examples/linear_probe.py #2"): "hours and data sets: Pascal Context on a GPU",
    ("docs/evaluation.md", "examples/linear_probe.py #4"): "the Hub: an NYUv2 copy, on a GPU",
    ("docs/evaluation.md", "examples/linear_probe.py #5"): "minutes: 300 segmentation steps on 400 Fashion-MNIST and "
    "VOC images per model, budget and resolution, after the block's earlier steps",
    ("docs/training.md", "pip"): "the network: installs packages",
    ("docs/training.md", "benchmarks/throughput.py"): "minutes: 10,000 steps",
    ("docs/training.md", "["): "a line of a job script: it reads the exit status of the launch before it",
    ("docs/results.md", "studies/cpu_distillation/arms.py"): "hours: the CPU distillation study",
    ("docs/budget_picker.md", "studies/budget_policy/study.py"): "minutes and real data: a distilled student, "
    "Fashion-MNIST and photos (tests/test_budget_policy_study.py runs it on a tiny model and generated images)",
    ("docs/training.md", "bash"): "minutes: the README's main job",
    ("docs/performance.md", "veca_hf.hub.export_onnx #1"): "a sketch: its flags are elided",
    ("docs/performance.md", "benchmarks/numerics.py"): "minutes: the int8 speed and accuracy check on your photos",
    ("docs/training.md", "examples/distill.py"): "the Hub, a GPU, or minutes: DINOv3 teachers, several GPUs, the "
    "demo recipe's 20 steps on its downloaded data (tests/test_distill_script.py runs the script)",
}


def _program(words: list[str]) -> str:
    """What a command runs: a script path, a `-m` module, its first word (`pip`, `bash`), or `NAME=` (a variable)."""
    if len(words) == 1 and re.match(r"\w+=", words[0]):
        return words[0].split("=", 1)[0] + "="
    while re.match(r"\w+=", words[0]):  # `PYTHONPATH=src python ...`
        words = words[1:]
    if words[0] in ("python", "accelerate"):
        if "-m" in words:
            return words[words.index("-m") + 1]
        scripts = [word for word in words if word.endswith(".py")]
        if scripts:
            return scripts[0]
    return words[0]


def doc_commands() -> dict[tuple[str, str], str]:
    """Every command of every `bash` block of the docs, by (doc, `<program> #<n>`), n counting from 1 per doc."""
    commands = {}
    for path in DOCS:
        doc = str(path.relative_to(ROOT))
        seen = Counter()
        text = path.read_text()
        blocks = re.findall(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
        # Commands written inline in the text count too (`python -m veca_hf.hub.export_onnx --model_name_or_path ...`).
        blocks += [span.replace("\n", " ") for span in re.findall(r"`(python [^`]*--[^`]*)`", text)]
        for block in blocks:
            if "<<'PY'" in block:  # a here-document: one command, whatever it holds
                lines = [block.split("\n", 1)[0]]
            else:
                lines = block.replace("\\\n", " ").splitlines()
            for line in lines:
                words = shlex.split(_fill(line), comments=True)
                if not words:
                    continue
                program = "python -" if "<<'PY'" in line else _program(words)
                seen[program] += 1
                commands[(doc, f"{program} #{seen[program]}")] = _fill(line)
    return commands


def _fill(line: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        line = re.sub(rf"(?<![\w/]){re.escape(placeholder)}(?![\w/])", value, line)
    return line


def _reason(doc: str, command_id: str) -> str | None:
    program = command_id.rsplit(" #", 1)[0]
    return NOT_RUN.get((doc, command_id)) or NOT_RUN.get((doc, program))


def test_every_docs_command_is_run_or_has_a_reason():
    commands = doc_commands()
    unclassified = [key for key in commands if key not in RUN and _reason(*key) is None]
    assert not unclassified, (
        f"Add these docs commands to RUN (with overrides) or NOT_RUN (with a reason): {unclassified}"
    )
    both = [key for key in RUN if key in NOT_RUN]
    assert not both, f"Both run and not run: {both}"
    stale = [key for key in RUN if key not in commands]
    stale += [key for key in NOT_RUN if not any(doc == key[0] and key[1] in (command_id, command_id.rsplit(" #", 1)[0])
                                                 for doc, command_id in commands)]  # fmt: skip
    assert not stale, f"No longer in the docs: {stale}"
    # The README's own commands, at least, run.
    for program in ("finetune_classification", "linear_probe", "visualize_cores", "visualize_features",
                    "extract_features", "convert_veca_original", "export_onnx"):  # fmt: skip
        assert any(doc == "README.md" and program in command_id for doc, command_id in RUN), program


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A folder holding what the docs' commands name: a tiny VECA (a bank of 64 cores, so the docs' budgets up to
    64 are valid) and DINOv3, class folders of images, depth scenes, a photo and a reference checkpoint."""
    root = tmp_path_factory.mktemp("docs")
    torch.manual_seed(0)
    for folder in ("veca-tiny", "outputs/veca-b16"):
        VecaModel(tiny_config(core_bank_size=64, core_chunk_size=8)).save_pretrained(root / folder)
        VecaImageProcessor().save_pretrained(root / folder)
    DINOv3ViTModel(tiny_dinov3_config()).save_pretrained(root / "dinov3-tiny")
    VecaImageProcessor().save_pretrained(root / "dinov3-tiny")  # the same 256 px ImageNet preprocessing
    for name, seed in (("cat", 0), ("dog", 1)):
        (root / "imgs" / name).mkdir(parents=True)
        for index, image in enumerate(random_pil_images(4, seed=seed)):
            image.save(root / "imgs" / name / f"{index}.png")
    for folder in ("scenes/images", "scenes/depth"):
        (root / folder).mkdir(parents=True)
    for index in range(8):
        image, depth = scene(np.random.default_rng([3, index]))
        Image.fromarray(image).save(root / "scenes" / "images" / f"{index}.jpg")
        depth_png(depth).save(root / "scenes" / "depth" / f"{index}.png")
    random_pil_images(1, size=(160, 128), seed=5)[0].save(root / "photo.jpg")
    shutil.copy(FIXTURES / "tiny_reference.pth", root / "student.pth")
    for folder in ("examples", "benchmarks"):  # the commands name the scripts from the repository's root
        (root / folder).symlink_to(ROOT / folder)
    (root / "docs" / "figures").mkdir(parents=True)
    for split in ("train", "validation"):  # docs/budget_picker.md's folders
        shutil.copytree(root / "imgs", root / "colours" / split)
    return root


def _in_process_main(words: list[str]):
    """The `main(argv)` of the example script or package module a command runs, with its arguments; `(None, None)`
    for anything else (a script without `argv`, a benchmark, a console script): that runs in a subprocess."""
    if words[:2] == ["accelerate", "launch"]:  # one process: the script as `python` runs it
        words = ["python", *words[2:]]
    main = None
    if words[0] == "python" and words[1] == "-m" and words[2].startswith("veca_hf."):
        main, argv = importlib.import_module(words[2]).main, words[3:]
    elif words[0] == "python" and words[1].startswith("examples/"):
        spec = importlib.util.spec_from_file_location(Path(words[1]).stem, ROOT / words[1])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        main, argv = module.main, words[2:]
    if main is None or "argv" not in inspect.signature(main).parameters:
        return None, None
    return main, argv


@pytest.mark.processes
@pytest.mark.parametrize("key", sorted(RUN), ids=lambda key: f"{key[0]}:{key[1]}")
def test_docs_command_runs_as_written(key, workspace, monkeypatch):
    command = doc_commands()[key]
    words = shlex.split(command, comments=True) + RUN[key]
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("HOME", str(workspace / "home"))  # the default caches (linear_probe's features) stay here
    main, argv = _in_process_main(words)
    if main is not None:
        main(argv)
        return
    program = [sys.executable, *words[1:]] if words[0] == "python" else words
    if words[0] == "veca-convert":  # the console script that `pip install` writes, beside this Python
        program = [str(Path(sys.executable).parent / words[0]), *words[1:]]
        assert Path(program[0]).exists(), f"{words[0]} is not installed beside {sys.executable}: pip install -e ."
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(program, capture_output=True, text=True, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
