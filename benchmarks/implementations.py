#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Two implementations of the same computation: do they agree, and which is faster? Each command checks the outputs
(max abs difference) before timing both sides in interleaved rounds (latency = median; the paired ratio = the median
over rounds of the ratio within a round). Three commands:

- `research`: `VecaModel` against the paper's research code (`--research_code`, a clone of
  https://github.com/alansong1322/VECA: its `veca/model.py`, built with the size's settings, eval mode, without the
  pretrained patch-embedding download), the same weights through `veca_hf.hub.convert_veca_original`. `--mode
  train` times one training step of each instead (train mode, forward under `--dtype`'s autocast, the mean square of
  the outputs as the loss, backward, AdamW): each side's train-time position augmentations run in its step.
- `kernels`: VECA's two attention calls per block (the cores' `C` queries over all `C + N` tokens, the patches' `N`
  queries over the `C` cores) at the size's heads and head dim, as `sdpa` (`F.scaled_dot_product_attention`, the
  model's path) and `matmul` (`softmax(q k^T * scale, fp32) v`); `--backward` times forward + backward.
- `revision`: the model of a git revision (`--before`) against the working tree's, same weights, DINOv3 of the same
  size alongside as the reference. The revision's `src/veca_hf/model/` is copied out of git into a temporary
  package and imported next to the working tree's (the model folder imports only torch, transformers and itself).

    python benchmarks/implementations.py research --research_code PATH/TO/VECA --size veca-b16 \
        --resolutions 512,1024 --budget 64 --repeats 5 --threads 2
    python benchmarks/implementations.py kernels --size veca-b16 --resolutions 512,1024 --budgets 8,64 \
        --dtypes fp32,bf16 --threads 2 --output_dir benchmarks/results/b16_attention_kernels_cpu
    python benchmarks/implementations.py revision --before 6ed9887 --resolutions 512,1024 --budgets 8,64 --repeats 7

Outputs in `--output_dir`: `results.json` and `results.md`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import numpy as np
import torch
import torch.nn.functional as F
from common import DTYPES, fmt, paired_median
from torch import nn

from veca_hf import VecaModel


MODEL_FOLDER = "src/veca_hf/model"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, resolutions: list[int], repeats: int) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        common.add_model_arguments(sub, resolutions)
        sub.add_argument("--repeats", type=int, default=repeats, help="Interleaved timed rounds.")
        return sub

    sub = command("research", [512, 1024], 5)
    sub.add_argument("--research_code", required=True, help="A clone of the research code: the baseline.")
    sub.add_argument("--budget", type=int, default=64, help="VECA budget C.")
    sub.add_argument("--batch_size", type=int, default=1)
    sub.add_argument("--warmup", type=int, default=1, help="Untimed calls per model and resolution.")
    sub.add_argument("--mode", default="forward", choices=["forward", "train"], help="Inference calls or steps.")
    sub.add_argument("--dtype", default="fp32", choices=["fp32", "bf16_autocast"], help="Both models' compute.")
    sub.add_argument("--num_hidden_layers", type=int, default=None, help="Depth (default: the preset's).")
    sub.add_argument("--output_dir", default=None)
    sub = command("kernels", [512, 1024], 5)
    sub.add_argument("--budgets", type=common.int_list, default=[8, 64], help="Budgets C.")
    sub.add_argument("--dtypes", type=common.comma_list(DTYPES), default=list(DTYPES), help="Comma-separated.")
    sub.add_argument("--batch_size", type=int, default=1)
    sub.add_argument("--calls", type=int, default=10, help="Timed calls per form and round (their median).")
    sub.add_argument("--backward", action="store_true", help="Time forward + backward instead of forward.")
    sub.add_argument("--output_dir", default="benchmarks/results/attention_kernels")
    sub = command("revision", [512, 1024], 7)
    sub.add_argument("--before", required=True, help="A git revision (commit, tag, branch) to compare against.")
    sub.add_argument("--budgets", type=common.int_list, default=[8, 64])
    sub.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="Weights and inputs cast to it.")
    sub.add_argument("--no_dinov3", action="store_true", help="Leave out the DINOv3 reference.")
    sub.add_argument("--warmup", type=int, default=1)
    sub.add_argument("--output_dir", required=True)
    args = parser.parse_args(argv)
    if args.repeats < 1 or getattr(args, "warmup", 0) < 0 or getattr(args, "calls", 1) < 1:
        parser.error("--repeats and --calls must be >= 1, --warmup >= 0")
    if args.command == "research" and args.output_dir is None:
        suffix = ("_train" if args.mode == "train" else "") + ("_tiny" if args.tiny else "")
        args.output_dir = common.default_output_dir(
            f"{args.size}_research_code_{args.device}_{args.dtype}{suffix}", False
        )
    return args


# --- research ------------------------------------------------------------------------------------------------------


def load_research_code(path: str) -> type[nn.Module]:
    """The `VECA` class of a clone of the research code, read from its `veca/model.py` (its package `__init__` pulls
    in training code that timing does not need)."""
    model_file = Path(path) / "veca" / "model.py"
    if not model_file.is_file():
        raise ValueError(f"--research_code {path!r} has no veca/model.py: pass the folder of a clone of "
                         "https://github.com/alansong1322/VECA.")  # fmt: skip
    # NOTE: the module imports timm only to download pretrained patch weights, which `build_research_pair` turns
    # off; without timm installed, an empty module stands in for the import.
    placeholder = importlib.util.find_spec("timm") is None and "timm" not in sys.modules
    if placeholder:
        sys.modules["timm"] = types.ModuleType("timm")
    try:
        spec = importlib.util.spec_from_file_location("veca_research_code_model", model_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if placeholder:
            del sys.modules["timm"]
    return module.VECA


def build_research_pair(args) -> tuple[nn.Module, VecaModel]:
    """The research code's model for the size (seeded, eval mode, with non-trivial biases, norms and coordinate heads
    so that every part matters) and the `VecaModel` converted from its weights."""
    from veca_hf.hub.convert_veca_original import convert_state_dict, infer_config

    veca_config, _ = common.model_configs(args.size, args.tiny, [8], args.num_hidden_layers)
    settings = types.SimpleNamespace(  # the research code's config fields, at its defaults but the size
        num_query_tokens=veca_config.core_bank_size, nested_chunk_size=veca_config.core_chunk_size,
        patch_size=veca_config.patch_size, in_channels=3, hidden_dim=veca_config.hidden_size,
        num_heads=veca_config.num_attention_heads, num_layers=veca_config.num_hidden_layers,
        mlp_ratio=(veca_config.intermediate_size + 0.5) / veca_config.hidden_size,  # int(D * ratio) == I
        dropout=0.0, patch_embed_use_ln=False, init_patch_from_dinov3=False, dinov3_timm_name="",
        rope_shift_coords=0.08, rope_jitter_coords=None, rope_rescale_coords=2.0, rope_p_zero_freqs=0.125,
        rope_zero_freqs_from="low", fps_pool_size=1000, fps_coord_range=0.95, distill_output_dim=None,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    research = load_research_code(args.research_code)(settings).eval()
    with torch.no_grad():
        for name, parameter in research.named_parameters():
            if name.endswith("bias") or "norm" in name or "pos_linears" in name:
                parameter.add_(0.02 * torch.randn_like(parameter))
    state_dict = research.state_dict()
    config = infer_config(state_dict, {"num_heads": veca_config.num_attention_heads})
    model = VecaModel(config).eval()
    model.load_state_dict(convert_state_dict(state_dict, config))
    return research, model


def run_research(args, device) -> tuple[dict, list[str]]:
    research, model = (module.to(device) for module in build_research_pair(args))
    forwards = {
        "VECA": lambda pixels: model(pixels, num_core_tokens=args.budget).last_hidden_state,
        "research code": lambda pixels: research(pixels, args.budget),
    }
    modules = {"VECA": model, "research code": research}
    autocast = common.autocast(device, args.dtype == "bf16_autocast")

    def call(name, pixels):
        if args.mode == "forward":

            def forward():
                with torch.inference_mode(), autocast:
                    forwards[name](pixels)

            return forward
        optimizer = torch.optim.AdamW(modules[name].parameters(), lr=1e-5)

        def step():
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                outputs = forwards[name](pixels)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            sum(output.float().square().mean() for output in outputs).backward()
            optimizer.step()

        return step

    points = []
    generator = torch.Generator().manual_seed(args.seed)
    for resolution in args.resolutions:
        pixels = torch.randn(args.batch_size, 3, resolution, resolution, generator=generator).to(device)
        with torch.inference_mode():  # fp32, eval mode, before any step changes the weights
            veca, baseline = (forward(pixels) for forward in forwards.values())
            if isinstance(baseline, tuple):  # the research code returns core 1 and the patches: (B, D), (B, N, D)
                veca = torch.cat((veca[:, :1], veca[:, args.budget :]), dim=1)
                baseline = torch.cat((baseline[0][:, None], baseline[1]), dim=1)
            difference = (veca - baseline).abs().max().item()
        for module in modules.values():
            module.train(args.mode == "train")
        calls = {name: call(name, pixels) for name in forwards}
        samples = common.interleaved(calls, args.repeats, device, args.warmup)
        for module in modules.values():
            module.eval()
        veca, baseline = samples["VECA"], samples["research code"]
        point = {
            "resolution": resolution, "num_patches": (resolution // model.config.patch_size) ** 2,
            "budget": args.budget, "batch_size": args.batch_size, "mode": args.mode, "dtype": args.dtype,
            "baseline": "research code", "max_abs_difference": difference, "seconds": samples,
            "median_seconds": {name: statistics.median(values) for name, values in samples.items()},
            "ratio": statistics.median(veca) / statistics.median(baseline),
            "paired_ratio": paired_median(veca, baseline),
        }  # fmt: skip
        points.append(point)
        print(f"{resolution} px ({args.mode}, {args.dtype}): VECA {point['median_seconds']['VECA']:.3f} s, research "
              f"code {point['median_seconds']['research code']:.3f} s, ratio {point['ratio']:.3f} (paired "
              f"{point['paired_ratio']:.3f}), max abs difference {difference:.1e}", flush=True)  # fmt: skip
    what = "training step" if args.mode == "train" else "forward"
    title = (f"VECA against the research code: {args.size}{' (tiny)' if args.tiny else ''}, "
             f"{model.config.num_hidden_layers} blocks, {args.device}, {args.dtype}, {what}, batch "
             f"{args.batch_size}, C = {args.budget}")  # fmt: skip
    lines = [
        f"- {args.warmup} warm-up call(s), {args.repeats} interleaved rounds; ratio = VECA / research code"
        + ("; a step: forward, mean-square loss of the outputs, backward, AdamW" if args.mode == "train" else ""),
        "",
        *common.table(["res", "N", "VECA s", "research code s", "ratio (paired)", "max abs difference"], [
            [p["resolution"], p["num_patches"], f"{p['median_seconds']['VECA']:.3f}",
             f"{p['median_seconds']['research code']:.3f}", f"{p['ratio']:.3f} ({p['paired_ratio']:.3f})",
             f"{p['max_abs_difference']:.1e}"] for p in points]),
    ]  # fmt: skip
    return {"points": points}, [title, lines]


# --- kernels -------------------------------------------------------------------------------------------------------


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(query, key, value, scale=scale)  # (B, H, Q, Hd)


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # (B, H, Q, K)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)  # (B, H, Q, Hd)


FORMS = {"sdpa": sdpa_attention, "matmul": matmul_attention}


def run_kernels(args, device) -> tuple[dict, list[str]]:
    veca_config, _ = common.model_configs(args.size, args.tiny, args.budgets)
    heads, head_dim = veca_config.num_attention_heads, veca_config.hidden_size // veca_config.num_attention_heads
    scale = head_dim**-0.5
    generator = torch.Generator(device=device).manual_seed(args.seed)

    def median_of_calls(form, inputs: tuple[torch.Tensor, ...]):
        """A call: the median seconds of `--calls` calls of one form (forward, or forward + backward)."""

        def call() -> None:
            if args.backward:
                form(*[t.detach().requires_grad_() for t in inputs], scale).sum().backward()
            else:
                with torch.inference_mode():
                    form(*inputs, scale)

        call()  # untimed: first-call allocations
        return lambda: statistics.median(common.time_call(call, device) for _ in range(args.calls))

    points = []
    for dtype_name in args.dtypes:
        for resolution in args.resolutions:
            num_patches = (resolution // veca_config.patch_size) ** 2
            for budget in args.budgets:
                # token-major memory, as the model's q/k/v (views of one (B, T, 3, H, Hd) projection)
                shape = (args.batch_size, budget + num_patches, heads, head_dim)
                query, key, value = (
                    torch.randn(shape, generator=generator, device=device).to(DTYPES[dtype_name]).transpose(1, 2)
                    for _ in range(3)
                )  # (B, H, T, Hd) each
                calls = {  # (queries, keys, values) of each of the block's two calls
                    "cores": (query[:, :, :budget], key, value),
                    "patches": (query[:, :, budget:], key[:, :, :budget], value[:, :, :budget]),
                }
                for call_name, inputs in calls.items():
                    reference = sdpa_attention(*(t.float() for t in inputs), scale)
                    errors = {name: (form(*inputs, scale).float() - reference).abs().max().item()
                              for name, form in FORMS.items()}  # fmt: skip
                    timers = {name: median_of_calls(form, inputs) for name, form in FORMS.items()}
                    seconds = {name: [] for name in FORMS}
                    for round_index in range(args.repeats):
                        for name in FORMS if round_index % 2 == 0 else reversed(FORMS):
                            seconds[name].append(timers[name]())
                    point = {
                        "dtype": dtype_name, "resolution": resolution, "num_patches": num_patches, "budget": budget,
                        "call": call_name, "queries": inputs[0].shape[-2], "keys": inputs[1].shape[-2],
                        "seconds": seconds,
                        "median_seconds": {name: statistics.median(values) for name, values in seconds.items()},
                        "paired_ratio": paired_median(seconds["matmul"], seconds["sdpa"]),
                        "max_abs_error_to_fp32_sdpa": errors,
                    }  # fmt: skip
                    points.append(point)
                    print(f"{dtype_name} {resolution} px C={budget} {call_name}: SDPA "
                          f"{1e3 * point['median_seconds']['sdpa']:.2f} ms, matmul "
                          f"{1e3 * point['median_seconds']['matmul']:.2f} ms, paired ratio "
                          f"{point['paired_ratio']:.3f}", flush=True)  # fmt: skip
    what = "forward + backward" if args.backward else "forward"
    rows = []
    for p in points:
        median, errors = p["median_seconds"], p["max_abs_error_to_fp32_sdpa"]
        rows.append([p["dtype"], p["resolution"], p["num_patches"], p["budget"], p["call"],
                     f"{p['queries']} x {p['keys']}", f"{1e3 * median['sdpa']:.2f}", f"{1e3 * median['matmul']:.2f}",
                     f"{median['matmul'] / median['sdpa']:.3f} ({p['paired_ratio']:.3f})",
                     f"{errors['sdpa']:.1e} / {errors['matmul']:.1e}"])  # fmt: skip
    lines = [
        f"- batch {args.batch_size}, {heads} heads of {head_dim}; {args.repeats} interleaved rounds of {args.calls} "
        "calls per form; ms = median; ratio = matmul / SDPA (paired: median over rounds; < 1: matmul faster); "
        "error = max abs difference to SDPA in fp32",
        "",
        *common.table(["dtype", "res", "N", "C", "call", "queries x keys", "SDPA ms", "matmul ms", "ratio (paired)",
                       "error SDPA / matmul"], rows),
    ]  # fmt: skip
    title = f"VECA's attention calls, SDPA against matmul + softmax: {args.size}, {args.device}, {what}"
    return {"heads": heads, "head_dim": head_dim, "points": points}, [title, lines]


# --- revision ------------------------------------------------------------------------------------------------------


def import_revision(revision: str, into: Path):
    """`modeling_veca` of `revision`, imported as the package `veca_model_<sha>` from a copy in `into`."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    sha = subprocess.check_output(["git", "rev-parse", "--short", revision], cwd=root, text=True).strip()
    package = into / f"veca_model_{sha}"
    package.mkdir()
    names = subprocess.check_output(["git", "ls-tree", "--name-only", f"{sha}:{MODEL_FOLDER}"], cwd=root, text=True)
    for name in names.split():
        if name.endswith(".py"):
            source = subprocess.check_output(["git", "show", f"{sha}:{MODEL_FOLDER}/{name}"], cwd=root)
            (package / name).write_bytes(source)
    sys.path.insert(0, str(into))
    return importlib.import_module(f"{package.name}.modeling_veca"), sha


def run_revision(args, device) -> tuple[dict, list[str]]:
    from transformers import DINOv3ViTModel

    from veca_hf.evaluation.statistics import paired_bootstrap_interval
    from veca_hf.model import modeling_veca as after_module

    dtype = DTYPES[args.dtype]
    veca_config, dinov3_config = common.model_configs(args.size, args.tiny, args.budgets)
    with tempfile.TemporaryDirectory() as folder:
        before_module, before_sha = import_revision(args.before, Path(folder))
        torch.manual_seed(args.seed)
        after = after_module.VecaModel(after_module.VecaConfig(**veca_config.to_dict()))
        before = before_module.VecaModel(before_module.VecaConfig(**veca_config.to_dict()))
        before.load_state_dict(after.state_dict())  # strict: the weights' layout must not have changed
        models = {"before": before, "after": after} | (
            {} if args.no_dinov3 else {"dinov3": DINOv3ViTModel(dinov3_config)}
        )
        for model in models.values():
            model.to(device, dtype).eval()
        points = []
        for resolution in args.resolutions:
            generator = torch.Generator().manual_seed(args.seed)
            x = torch.randn(1, 3, resolution, resolution, generator=generator).to(device, dtype)
            calls = {(side, budget): lambda m=models[side], b=budget, x=x: m(x, num_core_tokens=b)
                     for budget in args.budgets for side in ("before", "after")}  # fmt: skip
            if "dinov3" in models:
                calls[("dinov3", None)] = lambda m=models["dinov3"], x=x: m(x)
            with torch.inference_mode():
                differences = {budget: (calls[("after", budget)]().last_hidden_state
                                        - calls[("before", budget)]().last_hidden_state).abs().max().item()
                               for budget in args.budgets}  # fmt: skip
                times = common.interleaved(calls, args.repeats, device, args.warmup)
            for budget in args.budgets:
                before_s, after_s = times[("before", budget)], times[("after", budget)]
                log_ratios = np.log(after_s) - np.log(before_s)
                point = {
                    "resolution": resolution, "budget": budget, "before_ms": 1e3 * statistics.median(before_s),
                    "after_ms": 1e3 * statistics.median(after_s),
                    "after_over_before_paired": paired_median(after_s, before_s),
                    "after_over_before_rounds": [a / b for a, b in zip(after_s, before_s, strict=True)],
                    # the geometric mean of the rounds' ratios and its 95% bootstrap interval (rounds resampled)
                    "after_over_before_geometric_mean": float(np.exp(np.mean(log_ratios))),
                    "after_over_before_interval": paired_bootstrap_interval(np.exp, log_ratios),
                    "max_abs_output_difference": differences[budget],
                }  # fmt: skip
                if "dinov3" in models:
                    dinov3 = times[("dinov3", None)]
                    point["dinov3_ms"] = 1e3 * statistics.median(dinov3)
                    point["before_over_dinov3_paired"] = paired_median(before_s, dinov3)
                    point["after_over_dinov3_paired"] = paired_median(after_s, dinov3)
                points.append(point)
                print(point, flush=True)
    rows = []
    for p in points:
        low, high = p["after_over_before_interval"]
        rows.append([p["resolution"], p["budget"], len(p["after_over_before_rounds"]), f"{p['before_ms']:.1f}",
                     f"{p['after_ms']:.1f}", f"{p['after_over_before_paired']:.3f}",
                     f"{p['after_over_before_geometric_mean']:.3f} [{low:.3f}, {high:.3f}]",
                     f"{p['max_abs_output_difference']:.2e}", fmt(p.get("before_over_dinov3_paired")),
                     fmt(p.get("after_over_dinov3_paired"))])  # fmt: skip
    columns = ["res", "C", "rounds", "before ms", "after ms", "after / before: paired median", "geometric mean "
               "[95% interval]", "max abs output diff", "before / DINOv3", "after / DINOv3"]  # fmt: skip
    lines = ["- batch 1; latency = median of the timed rounds", "", *common.table(columns, rows)]
    title = f"Model code: {before_sha} vs the working tree, {args.dtype}"
    return {"before": before_sha, "after": "working tree", "dtype": args.dtype, "points": points}, [title, lines]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    machine = common.start(args)
    run = {"research": run_research, "kernels": run_kernels, "revision": run_revision}[args.command]
    measured, (title, lines) = run(args, torch.device(args.device))
    machine["loadavg_end"] = common.loadavg()
    result = {"command": common.command_line(argv), "args": vars(args), "machine": machine, **measured}
    text = "\n".join([f"# {title}", "", f"- command: `{result['command']}`", common.machine_line(machine), *lines])
    text += "\n"
    common.write_results(args.output_dir, result, text)
    print(text)
    return result


if __name__ == "__main__":
    main()
