# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Which kernel should compute VECA's two attention calls on this machine: SDPA, or two matmuls and a softmax?

`VecaModel` computes each block's attention as two `scaled_dot_product_attention` calls: the cores' (`C` queries
over all `C + N` tokens) and the patches' (`N` queries over the `C` cores). With `C` small, the patches' call is a
tall, thin product for which a flash kernel may be the wrong tool. This script times both calls at the size's
heads and head dim, batch `--batch_size`, per dtype, resolution and budget, in two forms:

- `sdpa`: `F.scaled_dot_product_attention` (the model's path);
- `matmul`: `softmax(q k^T * scale, fp32) v` as two `torch.matmul` and a softmax in fp32 (the formula of the model's
  `output_attentions` branch).

Timing: `--rounds` interleaved rounds (the order alternates); in each, the median of `--calls` calls per form; the
paired ratio is the median over the rounds of matmul / SDPA. `--backward` times forward + backward instead (as in
a training step). Outputs in `--output_dir`: `results.json` and `results.md` (a table; ratio < 1: matmul faster).

    python benchmarks/attention_kernels.py --size veca-b16 --resolutions 512,1024 --budgets 8,64 --dtypes fp32,bf16 \
        --threads 2 --output_dir benchmarks/results/b16_attention_kernels_cpu
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import scaling
import scaling_measure
import torch
import torch.nn.functional as F


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(query, key, value, scale=scale)  # (B, H, Q, Hd)


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # (B, H, Q, K)
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)  # (B, H, Q, Hd)


FORMS = {"sdpa": sdpa_attention, "matmul": matmul_attention}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(__doc__.split("\n\n")[0], resolutions=[512, 1024])
    parser.add_argument("--budgets", type=common.int_list, default=[8, 64], help="Budgets C.")
    parser.add_argument("--dtypes", default="fp32,bf16", help=f"Comma-separated, among {sorted(DTYPES)}.")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="Interleaved rounds.")
    parser.add_argument("--calls", type=int, default=10, help="Timed calls per form and round (their median).")
    parser.add_argument("--backward", action="store_true", help="Time forward + backward instead of forward.")
    parser.add_argument("--output_dir", type=Path, default=Path("benchmarks/results/attention_kernels"))
    args = parser.parse_args(argv)
    args.dtypes = [name for name in args.dtypes.replace(" ", "").split(",") if name]
    unknown = [name for name in args.dtypes if name not in DTYPES]
    if unknown or not args.dtypes:
        parser.error(f"--dtypes {','.join(args.dtypes)!r}: expected a comma-separated list among {sorted(DTYPES)}")
    if args.rounds < 1 or args.calls < 1:
        parser.error(f"--rounds {args.rounds} and --calls {args.calls} must be at least 1")
    return args


def _time_form(form, inputs: tuple[torch.Tensor, ...], scale: float, calls: int, backward: bool, device) -> float:
    """Median seconds of `calls` calls of one form (forward, or forward + backward of the output's sum)."""

    def call() -> None:
        if backward:
            leaves = [t.detach().requires_grad_() for t in inputs]
            form(*leaves, scale).sum().backward()
        else:
            with torch.inference_mode():
                form(*inputs, scale)

    call()  # untimed: first-call allocations
    return statistics.median(scaling_measure.time_call(call, device) for _ in range(calls))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = scaling_measure.machine_info(argparse.Namespace(device=args.device, bf16_probe_size=0))
    machine["cpu_allocator"] = common.apply_cpu_allocator(args)
    device = torch.device(args.device)
    veca_config, _ = scaling.preset_configs(args.size, args.tiny, args.budgets)
    heads, head_dim = veca_config.num_attention_heads, veca_config.hidden_size // veca_config.num_attention_heads
    scale = head_dim**-0.5
    generator = torch.Generator(device=device).manual_seed(args.seed)
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
                    errors = {
                        name: (form(*inputs, scale).float() - reference).abs().max().item()
                        for name, form in FORMS.items()
                    }
                    seconds = {name: [] for name in FORMS}
                    for round_index in range(args.rounds):
                        order = list(FORMS) if round_index % 2 == 0 else list(reversed(FORMS))
                        for name in order:
                            seconds[name].append(
                                _time_form(FORMS[name], inputs, scale, args.calls, args.backward, device)
                            )
                    point = {
                        "dtype": dtype_name,
                        "resolution": resolution,
                        "num_patches": num_patches,
                        "budget": budget,
                        "call": call_name,
                        "queries": inputs[0].shape[-2],
                        "keys": inputs[1].shape[-2],
                        "seconds": seconds,
                        "median_seconds": {name: statistics.median(values) for name, values in seconds.items()},
                        "paired_ratio": scaling_measure.paired_median(seconds["matmul"], seconds["sdpa"]),
                        "max_abs_error_to_fp32_sdpa": errors,
                    }
                    points.append(point)
                    print(
                        f"{dtype_name} {resolution} px C={budget} {call_name}: SDPA "
                        f"{1e3 * point['median_seconds']['sdpa']:.2f} ms, matmul "
                        f"{1e3 * point['median_seconds']['matmul']:.2f} ms, paired ratio {point['paired_ratio']:.3f}",
                        flush=True,
                    )
    machine["loadavg_end"] = scaling_measure.loadavg()
    result = {
        "command": common.command_line(argv),
        "args": vars(args),
        "machine": machine,
        "heads": heads,
        "head_dim": head_dim,
        "points": points,
    }
    what = "forward + backward" if args.backward else "forward"
    lines = [
        f"# VECA's attention calls, SDPA against matmul + softmax: {args.size}, {args.device}, {what}",
        "",
        f"- command: `{result['command']}`",
        f"- machine: {machine['cpu_model']} ({machine['cpu_kind']}); torch {machine['torch_version']}; "
        f"{torch.get_num_threads()} threads; batch {args.batch_size}, {heads} heads of {head_dim}",
        f"- {args.rounds} interleaved rounds of {args.calls} calls per form; ms = median; ratio = matmul / SDPA "
        "(paired: median over rounds; < 1: matmul faster); error = max abs difference to SDPA in fp32",
        "",
        "| dtype | res | N | C | call | queries x keys | SDPA ms | matmul ms | ratio (paired) | error SDPA / matmul |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        median, errors = p["median_seconds"], p["max_abs_error_to_fp32_sdpa"]
        lines.append(
            f"| {p['dtype']} | {p['resolution']} | {p['num_patches']} | {p['budget']} | {p['call']} | "
            f"{p['queries']} x {p['keys']} | {1e3 * median['sdpa']:.2f} | {1e3 * median['matmul']:.2f} | "
            f"{median['matmul'] / median['sdpa']:.3f} ({p['paired_ratio']:.3f}) | "
            f"{errors['sdpa']:.1e} / {errors['matmul']:.1e} |"
        )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    common.write_results(args.output_dir, result, "\n".join(lines) + "\n")
    print(f"wrote {args.output_dir}")
    return result


if __name__ == "__main__":
    main()
