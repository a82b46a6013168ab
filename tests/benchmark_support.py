"""Running and importing the scripts of `benchmarks/` in the tests."""

import os
import statistics
import subprocess
import sys
from pathlib import Path

import warm_python


ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def run_script(name: str, *args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python benchmarks/<name> ARGS` from the repository's root; fails the test on a non-zero exit."""
    completed = warm_python.run([sys.executable, str(BENCHMARKS / name), *args], cwd=ROOT, env=env or ENV,
                                capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed


def import_benchmark(name: str):
    """A script of `benchmarks/` as a module (its folder on `sys.path` while it imports `common`)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def paired(numerators, denominators) -> float:
    """The median over rounds of the ratio within a round."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))
