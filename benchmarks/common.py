# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What the benchmark scripts share, imported as a module (`import common`: a script's own folder is first on
`sys.path`) before anything else: offline Hub defaults, `veca_hf` from a source checkout, the common arguments, the
models compared (VECA and DINOv3 of the same width and depth, the students of a training step), the machine record,
timing, paired ratios and the GEMM reference."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

try:  # running from a source checkout without `pip install -e .`
    import veca_hf  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402 - after the environment above


RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIB = 2**20
# MLP width of the DINOv3 release that each VECA size is distilled from (DINOv3-S/16, -B/16, -L/16: 4 x hidden).
DINOV3_INTERMEDIATE = {"veca-s16": 1536, "veca-b16": 3072, "veca-l16": 4096}
# `--tiny`: the same architecture at width 64, depth 2, 2 heads (smoke tests).
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=170)
TINY_DINOV3_INTERMEDIATE = 256


# --- command line and results --------------------------------------------------------------------------------------


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


def comma_list(choices) -> Callable[[str], list[str]]:
    """argparse type: a non-empty comma-separated list of names among `choices`."""

    def parse(text: str) -> list[str]:
        values = [value for value in text.replace(" ", "").split(",") if value]
        if not values or not set(values) <= set(choices):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list among {sorted(choices)}")
        return values

    return parse


def add_model_arguments(parser: argparse.ArgumentParser, resolutions: list[int]) -> argparse.ArgumentParser:
    """The arguments every model benchmark takes: `--size`, `--tiny`, `--resolutions` (default `resolutions`),
    `--device`, `--threads`, `--seed` and `--cpu_allocator` (apply it with `apply_cpu_allocator`)."""
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


def start(args: argparse.Namespace, bf16_probe_size: int = 0) -> dict[str, Any]:
    """Threads and allocator of `args` applied; the machine record (`machine_info`) with `cpu_allocator`."""
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = apply_cpu_allocator(args)
    machine = machine_info(args.device, bf16_probe_size)
    machine["cpu_allocator"] = allocator
    return machine


def command_line(argv: list[str] | None) -> str:
    """The command a results file records: `python SCRIPT ARGS`, with `argv` when `main(argv)` was called directly,
    without credentials (`veca_hf.arguments.redact_secrets`)."""
    from veca_hf.arguments import redact_secrets

    return shlex.join(redact_secrets(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]))


def default_output_dir(name: str, tiny: bool) -> str:
    return str(RESULTS / (name + ("_tiny" if tiny else "")))


def write_results(output_dir: Path | str, result: dict, markdown: str | None = None) -> None:
    """`output_dir/results.json` (what JSON cannot hold as a string), and `results.md` when given."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    if markdown is not None:
        (output_dir / "results.md").write_text(markdown)


def table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


# --- the models ----------------------------------------------------------------------------------------------------


def model_configs(
    size: str, tiny: bool = False, budgets=(), num_hidden_layers: int | None = None, attn_implementation="sdpa"
):
    """VECA config of the preset (or `--tiny`) and a DINOv3 config of the same width, depth and heads, with the MLP
    of the DINOv3 release the preset is distilled from (plain GELU), 4 registers, patch 16."""
    from transformers import DINOv3ViTConfig

    from veca_hf import VecaConfig

    overrides = dict(TINY) if tiny else {}
    if num_hidden_layers is not None:
        overrides["num_hidden_layers"] = num_hidden_layers
    veca_config = VecaConfig.from_preset(size, **overrides)
    for budget in budgets:
        veca_config.check_budget(budget, name="--budgets")
    dinov3_config = DINOv3ViTConfig(
        hidden_size=veca_config.hidden_size,
        num_hidden_layers=veca_config.num_hidden_layers,
        num_attention_heads=veca_config.num_attention_heads,
        intermediate_size=TINY_DINOV3_INTERMEDIATE if tiny else DINOV3_INTERMEDIATE[size],
        patch_size=veca_config.patch_size,
        num_register_tokens=4,
        image_size=224,
    )
    for config in (veca_config, dinov3_config):
        config._attn_implementation = attn_implementation
    return veca_config, dinov3_config


def student_with_loss(veca_config, dense: bool, teacher_width: int | None = None, attn_implementation=None):
    """A student of one training step, in train mode: VECA, or (`dense`) the dense student of
    `full_attention_student_config(veca_config)` (`DINOv3ViTModel` with VECA's width, depth and SwiGLU MLP, one CLS, no
    registers), inside `StudentWithLoss` with `DistillationLoss` towards targets of `teacher_width`."""
    from transformers import DINOv3ViTModel

    from veca_hf import VecaModel
    from veca_hf.training.distillation import DistillationLoss, StudentWithLoss, full_attention_student_config

    if dense:
        config = full_attention_student_config(veca_config)
        if attn_implementation:
            config._attn_implementation = attn_implementation
        student = DINOv3ViTModel(config)
    else:
        student = VecaModel(veca_config)
    width = veca_config.hidden_size
    return StudentWithLoss(student, DistillationLoss(width, teacher_width or width)).train()


def adamw(module: torch.nn.Module, learning_rate: float) -> torch.optim.AdamW:
    """AdamW over the project's parameter groups (weight decay 0.05, none on norms and biases)."""
    from veca_hf.training.optimization import get_parameter_groups

    return torch.optim.AdamW(get_parameter_groups(module, 0.05), lr=learning_rate)


def train_step(module, pixel_values, budget, cls, patches, optimizer=None, context=contextlib.nullcontext):
    """One step of a `student_with_loss`: forward under `context()`, backward, the optimiser's step if any."""
    with context():
        loss = module(pixel_values, budget, cls, patches)["loss"]
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    module.zero_grad(set_to_none=True)
    return loss


def autocast(device: torch.device | str, enabled: bool):
    """`torch.autocast(device, bf16)` when `enabled`, else a no-op context."""
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def param_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


# --- the machine ---------------------------------------------------------------------------------------------------


def loadavg() -> list[float] | None:
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def _transparent_hugepage_mode() -> str | None:
    """The kernel's THP mode (the bracketed word of `.../transparent_hugepage/enabled`), or `None` off Linux."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def minor_page_faults() -> int | None:
    """Minor page faults of this process so far (`None` where `resource` is unavailable, e.g. Windows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _call_or_none(owner, name: str):
    try:
        return getattr(owner, name)()
    except Exception:  # noqa: BLE001 - informational only; private helpers move between torch releases
        return None


def machine_info(device: str, bf16_probe_size: int = 0) -> dict[str, Any]:
    """Versions, CPU (model, kind, flags), threads, load, THP; on CPU its bf16 support, with the fp32 and bf16
    `torch.mm` of side `bf16_probe_size` timed unless it is 0 (`veca_hf.cpu.hardware.cpu_bf16_support`)."""
    import transformers

    from veca_hf.cpu.hardware import cpu_bf16_support, cpu_kind, cpu_model

    info = {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_kind": cpu_kind(),  # amx / avx512_bf16 / no native bf16
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "device": device,
        "device_name": cpu_model(),
        "loadavg_start": loadavg(),
        "cpu_capability": _call_or_none(torch.backends.cpu, "get_cpu_capability"),
        "cpu_avx512_bf16": _call_or_none(torch.cpu, "_is_avx512_bf16_supported"),
        "cpu_amx_tile": _call_or_none(torch.cpu, "_is_amx_tile_supported"),
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "transparent_hugepage": _transparent_hugepage_mode(),
    }
    if device == "cpu":
        info["bf16"] = cpu_bf16_support(bf16_probe_size or None)
    if device == "cuda":
        info["device_name"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
        info["cudnn_version"] = torch.backends.cudnn.version()
    return info


def machine_line(machine: dict) -> str:
    """One line of a results page: the CPU, versions, threads, load average, allocator."""
    allocator = machine.get("cpu_allocator")
    tuned = allocator.get("tuned") if isinstance(allocator, dict) else allocator == "tuned"
    return (
        f"- machine: {machine['cpu_model']} ({machine['cpu_kind']}); torch {machine['torch_version']}, transformers "
        f"{machine['transformers_version']}; {machine['torch_num_threads']} threads; load average start "
        f"{machine['loadavg_start']}, end {machine.get('loadavg_end')}; glibc malloc settings "
        f"{'veca_hf' if tuned else 'default'}"
    )


# --- timing --------------------------------------------------------------------------------------------------------


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Wall-clock seconds of one call, synchronised on CUDA."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def interleaved(calls: dict[Any, Callable[[], Any]], rounds: int, device, warmup: int = 0) -> dict[Any, list[float]]:
    """Seconds per call and round: `warmup` untimed rounds, then `rounds` rounds that each time every call once, in
    an order rotated by one every round (no call always follows the same one)."""
    order, samples = list(calls), {key: [] for key in calls}
    for index in range(warmup + rounds):
        shift = index % len(order)
        for key in order[shift:] + order[:shift]:
            seconds = time_call(calls[key], device)
            if index >= warmup:
                samples[key].append(seconds)
    return samples


def make_gemm(size: int, dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], Any], int]:
    """The GEMM reference: `torch.mm` of two `(size, size)` matrices, and its FLOPs."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    return (lambda: torch.mm(a, b)), 2 * size**3


def measure_gemm(size: int, dtype: torch.dtype, device: torch.device, repeats: int) -> list[float]:
    """Achieved FLOP/s samples of the GEMM reference (after one untimed call)."""
    gemm, flops = make_gemm(size, dtype, device)
    with torch.inference_mode():
        gemm()
        return [flops / time_call(gemm, device) for _ in range(repeats)]


def _round_ratios(numerators: list, denominators: list) -> list[float]:
    """`numerators[i] / denominators[i]` per round, skipping rounds where either call failed."""
    return [a / b for a, b in zip(numerators, denominators, strict=False) if a is not None and b is not None]


def paired_median(numerators: list, denominators: list) -> float | None:
    """Median over the rounds of `numerators[i] / denominators[i]`, skipping rounds where either call failed."""
    ratios = _round_ratios(numerators, denominators)
    return statistics.median(ratios) if ratios else None


def rounds_within(numerators: list, denominators: list, limit: float) -> str:
    """How many rounds' ratios are at most `limit`, as "k/n": the paired median's support, round by round."""
    ratios = _round_ratios(numerators, denominators)
    return f"{sum(r <= limit for r in ratios)}/{len(ratios)}"


def fmt(value, spec=".3f", none="-") -> str:
    return none if value is None else format(value, spec)
