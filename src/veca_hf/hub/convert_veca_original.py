# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Convert a checkpoint of the VECA research code (arXiv 2605.12491, see docs/conversion.md) into a Hugging Face
folder.

    python -m veca_hf.hub.convert_veca_original --checkpoint student.pth --output_dir veca-b16 [--push_to_hub]

The size is inferred from the tensors (and cross-checked against the checkpoint's `"config"` when present). The
folder holds `model.safetensors`, `config.json`, the image processor, the modeling code for `trust_remote_code`
loading, and a model card (`README.md`). `--push_to_hub` uploads the folder to the Hub (repository `--hub_model_id`,
by default the output folder's name in your namespace).
"""

import argparse
import pickle
import re
from pathlib import Path

import torch

from ..model.configuration_veca import VecaConfig
from ..model.image_processing_pil_veca import VecaImageProcessorPil
from ..model.modeling_veca import VecaModel
from .cards import create_hub_repo, preset_teacher, push_to_hub, resolve_hub_model_id, write_model_card


# Reference key (after prefix stripping) -> this package's key. `{n}` stands for a layer or chunk index.
KEY_MAPPING: list[tuple[str, str]] = [
    (r"patch_embed\.proj\.(weight|bias)", r"embeddings.patch_embeddings.\1"),
    (r"query_token_chunks\.(\d+)", r"embeddings.core_tokens.\1"),
    (r"qcoord_chunks\.(\d+)", r"embeddings.core_coordinates.\1"),
    (r"pos_linears\.(\d+)\.(weight|bias)", r"encoder.core_coordinate_heads.\1.proj.\2"),
    (r"blocks\.(\d+)\.norm_attn\.(weight|bias)", r"encoder.layer.\1.norm1.\2"),
    (r"blocks\.(\d+)\.attn\.(q|k|v)_proj\.(weight|bias)", r"encoder.layer.\1.attention.\2_proj.\3"),
    (r"blocks\.(\d+)\.attn\.out_proj\.(weight|bias)", r"encoder.layer.\1.attention.o_proj.\2"),
    (r"blocks\.(\d+)\.norm_ffn\.(weight|bias)", r"encoder.layer.\1.norm2.\2"),
    (r"blocks\.(\d+)\.fc1\.(weight|bias)", r"encoder.layer.\1.mlp.gate_up_proj.\2"),
    (r"blocks\.(\d+)\.fc2\.(weight|bias)", r"encoder.layer.\1.mlp.down_proj.\2"),
    (r"final_norm\.(weight|bias)", r"norm.\1"),
]
# Distillation-only projection to the teacher's width: not part of the backbone.
DROPPED_KEYS = re.compile(r"output_proj\.(weight|bias)")
PREFIXES = ("module.", "student.", "_orig_mod.")


def load_reference_checkpoint(path: str | Path, allow_unsafe_pickle: bool = False) -> tuple[dict, dict]:
    """Reads a reference checkpoint and returns `(state_dict, config_dict)` with key prefixes stripped.

    Pickles are loaded with `weights_only=True`; a full unpickle (which can run arbitrary code) happens only with
    `allow_unsafe_pickle=True`. `.safetensors` files are read directly.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"Checkpoint {str(path)!r} does not exist or is not a file.")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            checkpoint = load_file(str(path))
        else:
            try:
                checkpoint = torch.load(path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as error:
                if not allow_unsafe_pickle:
                    raise ValueError(
                        f"{str(path)!r} holds Python objects beyond plain tensors and cannot be loaded safely "
                        f"({error}). If you trust its source, rerun with --allow-unsafe-pickle."
                    ) from error
                checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except ValueError:
        raise
    # safetensors' SafetensorError, torch's RuntimeError / EOFError for a cut zip or pickle
    except Exception as error:
        raise ValueError(
            f"{str(path)!r} ({path.stat().st_size} bytes) cannot be read as a {path.suffix} checkpoint: it is "
            f"truncated or not a checkpoint ({type(error).__name__}: {error}). Download or copy it again."
        ) from error
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{str(path)!r} holds a {type(checkpoint).__name__}, expected a dict of tensors.")

    config = checkpoint.get("config") if isinstance(checkpoint.get("config"), dict) else {}
    state_dict = checkpoint["student"] if "student" in checkpoint else checkpoint
    if not isinstance(state_dict, dict):
        raise ValueError(f"The 'student' entry of {str(path)!r} is a {type(state_dict).__name__}, not a state dict.")

    cleaned = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue  # "config", "step", optimiser scalars... when the dict is the state dict itself
        while key.startswith(PREFIXES):
            key = key[len(next(p for p in PREFIXES if key.startswith(p))) :]
        cleaned[key] = value
    if not cleaned:
        raise ValueError(f"{str(path)!r} contains no tensors.")
    return cleaned, config


def infer_config(state_dict: dict[str, torch.Tensor], checkpoint_config: dict | None = None) -> VecaConfig:
    """Builds the `VecaConfig` of a reference state dict; the stored `"config"` must agree with the tensors."""
    checkpoint_config = checkpoint_config or {}
    required = ["patch_embed.proj.weight", "query_token_chunks.0", "blocks.0.fc2.weight", "final_norm.weight"]
    missing = [key for key in required if key not in state_dict]
    if missing:
        raise ValueError(
            f"Not a VECA reference checkpoint: missing {missing}. Keys start with {sorted(state_dict)[:5]}."
        )

    hidden_size, num_channels, patch_size, _ = state_dict["patch_embed.proj.weight"].shape
    num_layers = 1 + max(int(m.group(1)) for k in state_dict if (m := re.match(r"blocks\.(\d+)\.", k)))
    num_chunks = 1 + max(int(m.group(1)) for k in state_dict if (m := re.match(r"query_token_chunks\.(\d+)$", k)))
    chunk_size = state_dict["query_token_chunks.0"].shape[-2]
    intermediate_size = state_dict["blocks.0.fc2.weight"].shape[1]
    # NOTE: the head count is not visible in the tensors; every released size uses 64-wide heads.
    num_heads = checkpoint_config.get("num_heads", hidden_size // 64)

    inferred = {
        "hidden_dim": hidden_size,
        "num_layers": num_layers,
        "num_query_tokens": num_chunks * chunk_size,
        "nested_chunk_size": chunk_size,
        "patch_size": patch_size,
        "in_channels": num_channels,
    }
    stored = dict(checkpoint_config)
    if "matryoshka_chunk_size" in stored:
        stored.setdefault("nested_chunk_size", stored["matryoshka_chunk_size"])
    if "mlp_ratio" in stored and int(hidden_size * stored["mlp_ratio"]) != intermediate_size:
        raise ValueError(
            f"The checkpoint config says mlp_ratio={stored['mlp_ratio']} (hidden "
            f"{int(hidden_size * stored['mlp_ratio'])}) "
            f"but fc2 has {intermediate_size} inputs."
        )
    conflicts = {k: (stored[k], v) for k, v in inferred.items() if k in stored and stored[k] != v}
    if conflicts:
        raise ValueError(f"The checkpoint's config disagrees with its tensors (config, tensors): {conflicts}.")

    return VecaConfig(
        hidden_size=int(hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=int(num_heads),
        intermediate_size=int(intermediate_size),
        patch_size=int(patch_size),
        num_channels=int(num_channels),
        core_bank_size=num_chunks * chunk_size,
        core_chunk_size=int(chunk_size),
        rope_zero_frequency_ratio=float(stored.get("rope_p_zero_freqs", 0.125)),
        pos_embed_shift=stored.get("rope_shift_coords", 0.08),
        pos_embed_jitter=stored.get("rope_jitter_coords"),
        pos_embed_rescale=stored.get("rope_rescale_coords", 2.0),
    )


def interleaved_to_half_split(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorders q/k output channels from RoPE's interleaved pairs to HF's half split, per head.

    Reference channel pair `(2m, 2m + 1)` becomes channels `(m, m + Hd/2)`, so `rotate_half` rotates what the
    reference rotated and every q.k dot product is unchanged.
    """
    head_dim = weight.shape[0] // num_heads
    order = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    return weight.reshape(num_heads, head_dim, *weight.shape[1:])[:, order].reshape(weight.shape)


def convert_state_dict(state_dict: dict[str, torch.Tensor], config: VecaConfig) -> dict[str, torch.Tensor]:
    """Maps reference keys and layouts to `VecaModel`'s; raises `ValueError` on any key it does not understand."""
    converted, unknown = {}, []
    for key, value in state_dict.items():
        if DROPPED_KEYS.fullmatch(key):
            continue
        if key == "pos_alpha":
            for index, step in enumerate(value.reshape(-1)):
                converted[f"encoder.core_coordinate_heads.{index}.step"] = step.reshape(1).clone()
            continue
        for pattern, replacement in KEY_MAPPING:
            if re.fullmatch(pattern, key):
                new_key = re.sub(pattern, replacement, key)
                break
        else:
            unknown.append(key)
            continue
        if new_key.startswith("embeddings.core_"):
            value = value.reshape(value.shape[-2:])  # (1, chunk, X) -> (chunk, X)
        if re.search(r"attention\.(q|k)_proj", new_key):
            value = interleaved_to_half_split(value, config.num_attention_heads)
        converted[new_key] = value.contiguous()
    if unknown:
        raise ValueError(f"Unrecognised keys in the reference checkpoint (not converted): {unknown}.")
    return fuse_qkv(converted)


def fuse_qkv(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacks each layer's `q_proj`, `k_proj`, `v_proj` rows into the fused `qkv_proj` (in that order)."""
    fused = {}
    for key, value in state_dict.items():
        match = re.fullmatch(r"(encoder\.layer\.\d+\.attention\.)q_proj\.(weight|bias)", key)
        if match:
            prefix, kind = match.groups()
            parts = [f"{prefix}{name}_proj.{kind}" for name in ("q", "k", "v")]
            missing = [part for part in parts if part not in state_dict]
            if missing:
                raise ValueError(f"Incomplete attention projections in the reference checkpoint: missing {missing}.")
            fused[f"{prefix}qkv_proj.{kind}"] = torch.cat([state_dict[part] for part in parts])
        elif not re.search(r"attention\.(q|k|v)_proj\.", key):
            fused[key] = value
    return fused


def convert_checkpoint(
    checkpoint: str | Path,
    output_dir: str | Path | None = None,
    allow_unsafe_pickle: bool = False,
    model_card_kwargs: dict | None = None,
) -> VecaModel:
    """Converts a reference checkpoint into a `VecaModel`, saved (with its image processor) to `output_dir` if given.

    The saved folder gets a model card from `veca_hf.hub.cards.write_model_card`, called with `model_card_kwargs`
    (e.g. `{"datasets": [...], "measure_latency": False}`). Its `base_model` defaults to the DINOv3 teacher of the
    preset whose size the checkpoint has (`None` if it matches none).
    """
    state_dict, checkpoint_config = load_reference_checkpoint(checkpoint, allow_unsafe_pickle=allow_unsafe_pickle)
    config = infer_config(state_dict, checkpoint_config)
    model = VecaModel(config)
    converted = convert_state_dict(state_dict, config)
    expected = set(model.state_dict())
    missing, extra = sorted(expected - set(converted)), sorted(set(converted) - expected)
    if missing or extra:
        raise ValueError(f"The converted checkpoint does not fit VecaModel: missing {missing}, unexpected {extra}.")
    for key, value in converted.items():
        target_shape = model.state_dict()[key].shape
        if value.shape != target_shape:
            raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != model shape {tuple(target_shape)}.")
    model.load_state_dict(converted, strict=True)
    model.eval()
    if output_dir is not None:
        model.save_pretrained(output_dir)
        VecaImageProcessorPil().save_pretrained(output_dir)  # no torchvision needed; saved as VecaImageProcessor
        card_kwargs = {
            "base_model": preset_teacher(config),
            "description": f"Converted from the reference checkpoint `{Path(checkpoint).name}` with "
            "`veca_hf.hub.convert_veca_original`; outputs equal the research code's (see docs/conversion.md).",
            **(model_card_kwargs or {}),
        }
        write_model_card(output_dir, model=model, **card_kwargs)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="reference checkpoint (.pth/.pt pickle or .safetensors)")
    parser.add_argument(
        "--output_dir", "--output-dir", required=True, help="folder to write the Hugging Face model into"
    )
    parser.add_argument(
        "--allow_unsafe_pickle",
        "--allow-unsafe-pickle",
        action="store_true",
        help="fall back to a full unpickle when the file holds more than tensors (runs code from the file)",
    )
    card = parser.add_argument_group("model card (README.md)")
    card.add_argument(
        "--base_model", "--base-model", default=None,
        help="the teacher's Hub id (default: the DINOv3 teacher of the matching preset size; 'none' for no teacher)",
    )  # fmt: skip
    card.add_argument("--dataset", action="append", default=None, help="training data (Hub id); repeat for several")
    card.add_argument(
        "--license", default=None,
        help="license identifier for the card (default: the base model's, the DINOv3 License for a DINOv3 teacher)",
    )  # fmt: skip
    card.add_argument(
        "--no_latency", "--no-latency", action="store_true",
        help="do not time the budgets on this machine for the card (FLOPs are still listed)",
    )  # fmt: skip
    hub = parser.add_argument_group("Hugging Face Hub")
    hub.add_argument("--push_to_hub", "--push-to-hub", action="store_true", help="upload the folder to the Hub")
    hub.add_argument(
        "--hub_model_id", "--hub-model-id", default=None,
        help="repository to push to, 'user/name' (default: the output folder's name in your namespace)",
    )  # fmt: skip
    hub.add_argument("--hub_token", "--hub-token", default=None, help="write token (default: cached login / HF_TOKEN)")
    hub.add_argument("--hub_private_repo", "--hub-private-repo", action="store_true", help="create the repo private")
    args = parser.parse_args(argv)
    try:
        # Checked before converting, so that a wrong flag fails in a second, not after the conversion.
        repo_id = resolve_hub_model_id(args.output_dir, args.push_to_hub, args.hub_model_id, args.hub_token)
        card_kwargs = {"datasets": args.dataset, "license": args.license, "measure_latency": not args.no_latency}
        if repo_id is not None:
            repo_id = card_kwargs["model_id"] = create_hub_repo(
                repo_id, token=args.hub_token, private=args.hub_private_repo or None
            )
        if args.base_model is not None:
            card_kwargs["base_model"] = None if args.base_model.lower() == "none" else args.base_model
        model = convert_checkpoint(
            args.checkpoint,
            args.output_dir,
            allow_unsafe_pickle=args.allow_unsafe_pickle,
            model_card_kwargs=card_kwargs,
        )
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    config = model.config
    num_parameters = sum(p.numel() for p in model.parameters())
    print(
        f"Converted {args.checkpoint} -> {args.output_dir}: D={config.hidden_size}, L={config.num_hidden_layers}, "
        f"heads={config.num_attention_heads}, bank={config.core_bank_size}, {num_parameters / 1e6:.2f}M parameters."
    )
    if repo_id is not None:
        push_to_hub(args.output_dir, repo_id, token=args.hub_token)
        print(f"Pushed {args.output_dir} to https://huggingface.co/{repo_id}")


if __name__ == "__main__":
    main()
