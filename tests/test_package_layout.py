"""docs/architecture.md's package layout stays true: every module is named there, the files marked `[travels]` are
exactly those a saved folder carries, the model imports nothing above it, and the low modules load neither `Trainer`
nor the distillation code."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_config

from veca_hf import VecaImageProcessor, VecaModel


ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "src" / "veca_hf"


def layout_block() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return re.search(r"## Package layout\n\n```\n(.*?)```", text, re.S)[1]


def named_in_layout() -> set[str]:
    """The paths the layout names, relative to src/veca_hf/: a subpackage at two spaces, its files at four below it."""
    named, package = set(), ""
    for line in layout_block().splitlines()[1:]:  # after "src/veca_hf/"; each line: names, then what they hold
        depth = (len(line) - len(line.lstrip())) // 2
        names = re.split(r"\s{2,}", line.strip())[0].split(", ")
        if depth == 1:
            package = names[0] if names[0].endswith("/") else ""
            named |= set(names)
        else:
            named |= {package + name for name in names}
    return named


def test_every_module_and_subpackage_is_named_in_the_layout():
    named = named_in_layout()
    # a subpackage whose files the layout lists has each of them named; the others are named as a whole
    listed = {name.split("/")[0] + "/" for name in named if "/" in name.rstrip("/")}
    present = {path.name for path in PACKAGE.glob("*.py")}
    present |= {f"{path.name}/" for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    present |= {f"{package}{path.name}" for package in listed for path in (PACKAGE / package).glob("*.py")}
    present -= {f"{package}__init__.py" for package in listed}
    assert present <= named, f"missing from docs/architecture.md: {sorted(present - named)}"
    assert named <= present, f"named but absent: {sorted(named - present)}"


def test_the_files_marked_travels_are_those_a_saved_folder_carries(tmp_path):
    travels = set(re.findall(r"(\w+\.py) .*\[travels\]", layout_block()))
    VecaModel(tiny_config()).save_pretrained(tmp_path)
    VecaImageProcessor().save_pretrained(tmp_path)
    assert {path.name for path in tmp_path.glob("*.py")} == travels


def test_the_model_imports_nothing_of_the_package_above_it():
    """`model/` is the ground floor: its files import each other, torch and transformers, never the rest of veca_hf."""
    for path in (PACKAGE / "model").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{path.name} imports from above model/: {'.' * node.level}{node.module}"
                assert node.level == 1 or not (node.module or "").startswith("veca_hf"), f"{path.name}: {node.module}"


@pytest.mark.processes
def test_the_hub_and_the_budget_modules_load_no_trainer_and_no_distillation():
    check = (
        "import sys, veca_hf.hub.convert_veca_original, veca_hf.hub.cards, veca_hf.hub.export_onnx, "
        "veca_hf.budgets, veca_hf.routing, veca_hf.latency; "
        "print(sorted(m for m in sys.modules if m in ('veca_hf.training.trainer', 'veca_hf.training.distillation', "
        "'transformers.trainer')))"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
