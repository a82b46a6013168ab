# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""`VecaModel` against the paper's research code, or a transcription of its efficient forward, with the same weights.

The baseline is the research code itself when `--research_code` names a clone of it
(https://github.com/alansong1322/VECA: its `veca/model.py`, built with the size's settings, eval mode, without the
pretrained patch-embedding download). Without a clone, it is `ResearchFormVeca` below, a lean transcription of the
paper's efficient forward (arXiv 2605.12491) in the released checkpoints' layout (docs/conversion.md): separate
`q`/`k`/`v` linears, RoPE on interleaved channel pairs recomputed in every block (the cores move), two SDPA calls per
block (cores over all tokens, patches over the cores), SwiGLU as `fc1`, split, `silu(u) * g`, `fc2`. Either way the
weights go through `veca_hf.hub.convert_veca_original` into a `VecaModel`, so both compute the same function; the
script checks that (max abs difference of the outputs) before timing.

    python benchmarks/research_form.py --size veca-b16 --resolutions 512,1024 --budget 64 --repeats 5 --threads 2 \
        [--research_code PATH/TO/VECA]

`--mode train` times one training step of each instead (both in train mode, forward under `--dtype`'s autocast, the
mean square of the outputs as the loss, backward, AdamW): the research code's own train-time position augmentations
run in its step, VECA's in VECA's.

Timing as in `scaling.py`: interleaved rounds (the order alternates), latency = median, and the paired ratio = the
median over rounds of VECA's time over the baseline's in that round. Outputs in `--output_dir` (default
`benchmarks/results/<size>_research_{code,form}_<device>_<dtype>[_train]`): `results.json`, `results.md`.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import types
from pathlib import Path

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import scaling
import scaling_measure
import torch
import torch.nn.functional as F
from torch import nn

from veca_hf import VecaModel
from veca_hf.hub.convert_veca_original import convert_state_dict, infer_config


class _Block(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.norm_attn = nn.LayerNorm(hidden_size, eps=1e-5)
        self.attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.attn, name, nn.Linear(hidden_size, hidden_size))
        self.norm_ffn = nn.LayerNorm(hidden_size, eps=1e-5)
        self.fc1 = nn.Linear(hidden_size, 2 * intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)


class ResearchFormVeca(nn.Module):
    """VECA in the reference checkpoints' parameter layout, eval mode, with the paper's two-call attention."""

    def __init__(self, hidden_size, num_heads, num_layers, intermediate_size, num_cores=64, chunk=8, patch_size=16):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, hidden_size, patch_size, stride=patch_size)
        chunks = num_cores // chunk
        self.query_token_chunks = nn.ParameterList(
            [nn.Parameter(torch.randn(1, chunk, hidden_size) / math.sqrt(hidden_size)) for _ in range(chunks)]
        )
        self.qcoord_chunks = nn.ParameterList([nn.Parameter(torch.rand(1, chunk, 2) - 0.5) for _ in range(chunks)])
        self.pos_linears = nn.ModuleList([nn.Linear(hidden_size, 2) for _ in range(num_layers - 1)])
        self.pos_alpha = nn.Parameter(torch.full((num_layers - 1,), 0.01))
        self.blocks = nn.ModuleList([_Block(hidden_size, intermediate_size) for _ in range(num_layers)])
        self.final_norm = nn.LayerNorm(hidden_size, eps=1e-5)
        frequencies = self.head_dim // 4
        periods = 100.0 ** (2.0 * torch.arange(frequencies, dtype=torch.float32) / (self.head_dim / 2))
        inverse = 1.0 / periods
        inverse[frequencies - round(0.125 * frequencies) :] = 0.0  # the last eighth is not rotated
        self.register_buffer("inverse_periods", inverse, persistent=False)

    def rope_tables(self, coordinates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of `(B, T, 2)` coordinates: `(B, 1, T, Hd/2)`, x angles then y angles."""
        angles = 2 * math.pi * coordinates[..., None] * self.inverse_periods  # (B, T, 2, Hd/4)
        angles = angles.flatten(-2)[:, None]
        return angles.cos(), angles.sin()

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on interleaved channel pairs `(2m, 2m + 1)` of `(B, H, T, Hd)`."""
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)

    def attention(self, block: _Block, hidden: torch.Tensor, cos, sin, num_cores: int) -> torch.Tensor:
        batch, tokens, width = hidden.shape
        heads = [
            proj(hidden).view(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj)
        ]
        q, k, v = self.rotate(heads[0], cos, sin), self.rotate(heads[1], cos, sin), heads[2]
        cores = F.scaled_dot_product_attention(q[:, :, :num_cores], k, v)  # cores over all tokens
        patches = F.scaled_dot_product_attention(q[:, :, num_cores:], k[:, :, :num_cores], v[:, :, :num_cores])
        out = torch.cat((cores, patches), dim=2).transpose(1, 2).reshape(batch, tokens, width)
        return block.attn.out_proj(out)

    def forward(self, pixel_values: torch.Tensor, num_cores: int) -> torch.Tensor:
        patches = self.patch_embed.proj(pixel_values)  # (B, D, Hp, Wp)
        batch, _, grid_h, grid_w = patches.shape
        cores = torch.cat(list(self.query_token_chunks), dim=1)[:, :num_cores].expand(batch, -1, -1)
        rho = torch.cat(list(self.qcoord_chunks), dim=1)[:, :num_cores].expand(batch, -1, -1)
        x = torch.cat((cores, patches.flatten(2).transpose(1, 2)), dim=1)  # (B, C + N, D)
        ys, xs = torch.meshgrid(
            (torch.arange(grid_h) + 0.5) / grid_h * 2 - 1, (torch.arange(grid_w) + 0.5) / grid_w * 2 - 1, indexing="ij"
        )
        patch_coordinates = torch.stack((xs, ys), -1).reshape(1, -1, 2).to(x).expand(batch, -1, -1)
        for index, block in enumerate(self.blocks):
            if index > 0:
                rho = rho + self.pos_alpha[index - 1] * self.pos_linears[index - 1](x[:, :num_cores])
            cos, sin = self.rope_tables(torch.cat((torch.tanh(rho), patch_coordinates), dim=1))
            x = x + self.attention(block, block.norm_attn(x), cos, sin, num_cores)
            u, g = block.fc1(block.norm_ffn(x)).chunk(2, dim=-1)
            x = x + block.fc2(F.silu(u) * g)
        return self.final_norm(x)


def build_pair(
    size: str, tiny: bool, seed: int, num_hidden_layers: int | None = None
) -> tuple[ResearchFormVeca, VecaModel]:
    """A seeded research-form model and the `VecaModel` converted from its weights."""
    veca_config, _ = scaling.preset_configs(size, tiny, [8], num_hidden_layers)
    torch.manual_seed(seed)
    research = ResearchFormVeca(
        veca_config.hidden_size,
        veca_config.num_attention_heads,
        veca_config.num_hidden_layers,
        veca_config.intermediate_size,
        veca_config.core_bank_size,
        veca_config.core_chunk_size,
        veca_config.patch_size,
    ).eval()
    return research, _converted(research, veca_config)


def load_research_code(path: str) -> type[nn.Module]:
    """The `VECA` class of a clone of the research code, read from its `veca/model.py` (its package `__init__` pulls
    in training code that timing does not need)."""
    model_file = Path(path) / "veca" / "model.py"
    if not model_file.is_file():
        raise ValueError(
            f"--research_code {path!r} has no veca/model.py: pass the folder of a clone of "
            "https://github.com/alansong1322/VECA."
        )
    # NOTE: the module imports timm only to download pretrained patch weights, which `build_research_code_pair`
    # turns off; without timm installed, an empty module stands in for the import.
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


def build_research_code_pair(
    size: str, tiny: bool, seed: int, path: str, num_hidden_layers: int | None = None
) -> tuple[nn.Module, VecaModel]:
    """The research code's model for the size (seeded, eval mode) and the `VecaModel` converted from its weights."""
    veca_config, _ = scaling.preset_configs(size, tiny, [8], num_hidden_layers)
    research_settings = types.SimpleNamespace(  # the research code's config fields, at its defaults but the size
        num_query_tokens=veca_config.core_bank_size,
        nested_chunk_size=veca_config.core_chunk_size,
        patch_size=veca_config.patch_size,
        in_channels=3,
        hidden_dim=veca_config.hidden_size,
        num_heads=veca_config.num_attention_heads,
        num_layers=veca_config.num_hidden_layers,
        mlp_ratio=(veca_config.intermediate_size + 0.5) / veca_config.hidden_size,  # int(D * ratio) == I
        dropout=0.0,
        patch_embed_use_ln=False,
        init_patch_from_dinov3=False,  # no download; the weights are random either way
        dinov3_timm_name="",
        rope_shift_coords=0.08,
        rope_jitter_coords=None,
        rope_rescale_coords=2.0,
        rope_p_zero_freqs=0.125,
        rope_zero_freqs_from="low",
        fps_pool_size=1000,
        fps_coord_range=0.95,
        distill_output_dim=None,
    )
    torch.manual_seed(seed)
    research = load_research_code(path)(research_settings).eval()
    return research, _converted(research, veca_config)


def _converted(research: nn.Module, veca_config) -> VecaModel:
    """`research` with non-trivial biases, norms and coordinate heads (so that every part matters), and the
    `VecaModel` converted from its weights."""
    with torch.no_grad():
        for name, parameter in research.named_parameters():
            if name.endswith("bias") or "norm" in name or "pos_linears" in name:
                parameter.add_(0.02 * torch.randn_like(parameter))
    state_dict = research.state_dict()
    config = infer_config(state_dict, {"num_heads": veca_config.num_attention_heads})
    model = VecaModel(config).eval()
    model.load_state_dict(convert_state_dict(state_dict, config))
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(__doc__.split("\n\n")[0], resolutions=[512, 1024])
    parser.add_argument("--budget", type=int, default=64, help="VECA budget C.")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1, help="Untimed calls per model and resolution.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed rounds.")
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--research_code", default=None, help="A clone of the research code: the baseline.")
    parser.add_argument(
        "--mode", default="forward", choices=["forward", "train"], help="Inference calls, or training steps."
    )
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16_autocast"], help="Both models' compute.")
    parser.add_argument("--num_hidden_layers", type=int, default=None, help="Depth (default: the preset's).")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if args.output_dir is None:
        baseline = "code" if args.research_code else "form"
        suffix = ("_train" if args.mode == "train" else "") + ("_tiny" if args.tiny else "")
        name = f"{args.size}_research_{baseline}_{args.device}_{args.dtype}{suffix}"
        args.output_dir = str(Path(__file__).resolve().parent / "results" / name)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = common.apply_cpu_allocator(args)
    machine = scaling_measure.machine_info(argparse.Namespace(device=args.device, bf16_probe_size=0))
    machine["cpu_allocator"] = allocator
    device = torch.device(args.device)
    if args.research_code:
        baseline_name = "research code"
        research, model = build_research_code_pair(
            args.size, args.tiny, args.seed, args.research_code, args.num_hidden_layers
        )
    else:
        baseline_name = "research form"
        research, model = build_pair(args.size, args.tiny, args.seed, args.num_hidden_layers)
    research, model = research.to(device), model.to(device)
    forwards = {
        "VECA": lambda pixels: model(pixels, num_core_tokens=args.budget).last_hidden_state,
        baseline_name: lambda pixels: research(pixels, args.budget),
    }
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=args.dtype == "bf16_autocast")

    def difference(pixels: torch.Tensor) -> float:
        """Max abs difference of the normed outputs; the research code returns core 1 and the patches only."""
        veca, research_outputs = forwards["VECA"](pixels), forwards[baseline_name](pixels)
        if isinstance(research_outputs, tuple):  # (B, D), (B, N, D)
            veca = torch.cat((veca[:, :1], veca[:, args.budget :]), dim=1)
            research_outputs = torch.cat((research_outputs[0][:, None], research_outputs[1]), dim=1)
        return (veca - research_outputs).abs().max().item()

    def training_step(module: nn.Module, forward):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5)

        def step(pixels: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                outputs = forward(pixels)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            sum(output.float().square().mean() for output in outputs).backward()
            optimizer.step()

        return step

    def inference_call(forward):
        def call(pixels: torch.Tensor) -> None:
            with torch.inference_mode(), autocast:
                forward(pixels)

        return call

    modules = {"VECA": model, baseline_name: research}
    points = []
    generator = torch.Generator().manual_seed(args.seed)
    for resolution in args.resolutions:
        pixels = torch.randn(args.batch_size, 3, resolution, resolution, generator=generator).to(device)
        with torch.inference_mode():
            max_abs_difference = difference(pixels)  # fp32, eval mode, before any step changes the weights
        if args.mode == "train":
            calls = {name: training_step(modules[name].train(), forward) for name, forward in forwards.items()}
        else:
            calls = {name: inference_call(forward) for name, forward in forwards.items()}
        for name in calls:
            for _ in range(args.warmup):
                calls[name](pixels)
        samples = {name: [] for name in calls}
        for round_index in range(args.repeats):
            order = list(calls) if round_index % 2 == 0 else list(reversed(calls))
            for name in order:
                samples[name].append(scaling.time_call(lambda call=calls[name], x=pixels: call(x), device))
        for module in modules.values():
            module.eval()
        veca, baseline = samples["VECA"], samples[baseline_name]
        point = {
            "resolution": resolution,
            "num_patches": (resolution // model.config.patch_size) ** 2,
            "budget": args.budget,
            "batch_size": args.batch_size,
            "mode": args.mode,
            "dtype": args.dtype,
            "baseline": baseline_name,
            "max_abs_difference": max_abs_difference,
            "seconds": samples,
            "median_seconds": {name: statistics.median(values) for name, values in samples.items()},
            "ratio": statistics.median(veca) / statistics.median(baseline),
            "paired_ratio": statistics.median(a / b for a, b in zip(veca, baseline, strict=True)),
        }
        points.append(point)
        print(
            f"{resolution} px ({args.mode}, {args.dtype}): VECA {point['median_seconds']['VECA']:.3f} s, "
            f"{baseline_name} {point['median_seconds'][baseline_name]:.3f} s, ratio {point['ratio']:.3f} (paired "
            f"{point['paired_ratio']:.3f}), max abs difference {max_abs_difference:.1e}",
            flush=True,
        )
    machine["loadavg_end"] = scaling_measure.loadavg()
    result = {
        "command": common.command_line(argv),
        "args": vars(args),
        "machine": machine,
        "points": points,
    }
    what = "training step" if args.mode == "train" else "forward"
    lines = [
        f"# VECA against the {baseline_name}: {args.size}{' (tiny)' if args.tiny else ''}, "
        f"{model.config.num_hidden_layers} blocks, {args.device}, {args.dtype}, {what}, batch {args.batch_size}, "
        f"C = {args.budget}",
        "",
        f"- command: `{result['command']}`",
        f"- machine: {machine['cpu_model']}; torch {machine['torch_version']}; {machine['torch_num_threads']} "
        f"threads; load average start {machine['loadavg_start']}, end {machine['loadavg_end']}; glibc malloc "
        f"settings {'veca_hf' if allocator['tuned'] else 'default'}",
        f"- {args.warmup} warm-up call(s), {args.repeats} interleaved rounds; ratio = VECA / {baseline_name}"
        + ("; a step: forward, mean-square loss of the outputs, backward, AdamW" if args.mode == "train" else ""),
        "",
        f"| res | N | VECA s | {baseline_name} s | ratio (paired) | max abs difference |",
        "|---|---|---|---|---|---|",
    ] + [
        f"| {p['resolution']} | {p['num_patches']} | {p['median_seconds']['VECA']:.3f} | "
        f"{p['median_seconds'][baseline_name]:.3f} | {p['ratio']:.3f} ({p['paired_ratio']:.3f}) | "
        f"{p['max_abs_difference']:.1e} |"
        for p in points
    ]
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    common.write_results(output_dir, result, "\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
