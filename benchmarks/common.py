# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What the benchmark scripts share: offline Hub defaults, `veca_hf` from a source checkout, and list arguments.

Every script imports it before torch and veca_hf (`import common`: a script's own folder is first on `sys.path`).
It imports only the standard library and `veca_hf`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

try:  # running from a source checkout without `pip install -e .`
    import veca_hf  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def int_list_or_empty(text: str) -> list[int]:
    """argparse type: a comma-separated list of positive integers; `''` is the empty list."""
    values = [int(v) for v in text.replace(" ", "").split(",") if v]
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def int_list(text: str) -> list[int]:
    """argparse type: a non-empty comma-separated list of positive integers."""
    values = int_list_or_empty(text)
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def argument_parser(description: str, resolutions: list[int]) -> argparse.ArgumentParser:
    """A parser with the arguments every model benchmark takes: `--size`, `--tiny`, `--resolutions` (default
    `resolutions`), `--device`, `--threads`, `--seed` and `--cpu_allocator` (apply it with `apply_cpu_allocator`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument(
        "--size", default="veca-b16", choices=["veca-s16", "veca-b16", "veca-l16"], help="VECA preset."
    )
    parser.add_argument("--tiny", action="store_true", help="Shrink width/depth to 64/2 (smoke tests only).")
    parser.add_argument("--resolutions", type=int_list, default=resolutions, help="Square sides, px.")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu_allocator",
        default="tuned",
        choices=["tuned", "default"],
        help="tuned: apply veca_hf.cpu.allocator.tune_cpu_allocator() at the start, so that every model of the run, "
        "DINOv3 included, runs under the same glibc malloc settings; default: glibc's own (VECA_HF_TUNE_MALLOC=0). "
        "Recorded in the results (machine.cpu_allocator).",
    )
    return parser


def apply_cpu_allocator(args: argparse.Namespace) -> dict:
    """Apply `--cpu_allocator` before any model runs; returns `cpu_allocator_state()` for the results."""
    import veca_hf.cpu.allocator

    if args.cpu_allocator == "default":
        os.environ["VECA_HF_TUNE_MALLOC"] = "0"
    else:
        os.environ.pop("VECA_HF_TUNE_MALLOC", None)
        veca_hf.cpu.allocator.tune_cpu_allocator()
    return veca_hf.cpu.allocator.cpu_allocator_state()


def command_line(argv: list[str] | None) -> str:
    """The command a results file records: `python SCRIPT ARGS`, with `argv` when `main(argv)` was called directly,
    without credentials (`veca_hf.arguments.redact_secrets`)."""
    from veca_hf.arguments import redact_secrets

    return shlex.join(redact_secrets(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]))


def write_results(output_dir: Path, result: dict, markdown: str | None = None) -> None:
    """`output_dir/results.json` (what JSON cannot hold as a string), and `results.md` when given."""
    (output_dir / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    if markdown is not None:
        (output_dir / "results.md").write_text(markdown)
