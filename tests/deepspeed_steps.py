"""DeepSpeed ZeRO-2/3 training steps of a tiny VecaModel on CPU, then a full save and reload (run by
test_deepspeed.py).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/deepspeed_steps.py --stage 3 --output_dir OUT

Three steps at budgets 8, 16 and 32 (a different number of active core chunks each time), the model built under
`deepspeed.zero.Init` for ZeRO-3. Rank 0 then saves the gathered weights with `save_pretrained`, reloads them (plainly,
and for ZeRO-3 also with `from_pretrained` under ZeRO-3) and writes what it compared to `OUT/result.json`.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import deepspeed
import torch
from transformers.integrations import HfDeepSpeedConfig


sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_config, tiny_dinov3_config  # noqa: E402
from transformers import DINOv3ViTModel  # noqa: E402

from veca_hf import VecaModel  # noqa: E402
from veca_hf.training.distillation import init_patch_embeddings_from_teacher  # noqa: E402


BUDGETS = (8, 16, 32)


def full_state_dict(module: torch.nn.Module, zero3: bool) -> dict[str, torch.Tensor]:
    """Every weight whole, on every rank (ZeRO-3 holds a slice of each parameter per rank)."""
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None, enabled=zero3):
        return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, choices=(2, 3), required=True)
    parser.add_argument("--output_dir", type=Path, required=True)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        # NOTE: torch_adam avoids compiling DeepSpeed's CPU Adam op (minutes on a fresh machine).
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 1000,
    }
    config = tiny_config(core_bank_size=32)
    torch.manual_seed(0)
    if args.stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = VecaModel(config)
        assert all(p.numel() == 0 for p in model.parameters()), "ZeRO-3 did not partition the parameters"
    else:
        model = VecaModel(config)
    # the paper's start: the teacher's patch convolution copied in (under ZeRO-3 into partitioned parameters)
    teacher = DINOv3ViTModel(tiny_dinov3_config())
    init_patch_embeddings_from_teacher(model, teacher, "yes")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    engine.train()
    initial = full_state_dict(engine.module, args.stage == 3)
    teacher_patch = teacher.embeddings.patch_embeddings
    patch_copied = torch.equal(initial["embeddings.patch_embeddings.weight"], teacher_patch.weight) and torch.equal(
        initial["embeddings.patch_embeddings.bias"], teacher_patch.bias
    )

    generator = torch.Generator().manual_seed(rank)
    projection = torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(1))
    losses = []
    for budget in BUDGETS:
        pixel_values = torch.randn(2, 3, 64, 48, generator=generator)
        outputs = engine(pixel_values, num_core_tokens=budget)
        # NOTE: a projection, not a sum: LayerNorm outputs sum to a constant.
        loss = (outputs.last_hidden_state @ projection).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    engine.eval()
    probe = torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        trained_output = engine(probe, num_core_tokens=16).last_hidden_state
    state_dict = full_state_dict(engine.module, args.stage == 3)
    save_dir = args.output_dir / "saved"
    if rank == 0:
        engine.module.save_pretrained(save_dir, state_dict=dict(state_dict))  # NOTE: it empties the dict it gets
    torch.distributed.barrier()

    result = {"world_size": world_size, "losses": losses, "patch_embedding_copied_from_teacher": patch_copied}
    if args.stage == 3:
        # from_pretrained under ZeRO-3 (transformers builds under zero.Init when it knows the DeepSpeed config)
        hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841  (kept alive: transformers holds a weak reference)
        sharded = VecaModel.from_pretrained(save_dir)
        result["zero3_reload_partitioned"] = all(p.numel() == 0 for p in sharded.parameters())
        reloaded = full_state_dict(sharded, zero3=True)
        result["zero3_reload_equal"] = all(torch.equal(reloaded[k], v) for k, v in state_dict.items())
        del hf_ds_config
    if rank == 0:
        plain = VecaModel.from_pretrained(save_dir).eval()
        result["reload_keys_equal"] = set(plain.state_dict()) == set(state_dict)
        result["reload_weights_equal"] = all(torch.equal(plain.state_dict()[k], v) for k, v in state_dict.items())
        with torch.no_grad():
            reloaded_output = plain(probe, num_core_tokens=16).last_hidden_state
        result["reload_max_abs_diff"] = (reloaded_output - trained_output).abs().max().item()
        moved = {name for name, value in state_dict.items() if not torch.equal(value, initial[name])}
        # every chunk was active in the budget-32 step, so every parameter moved
        result["parameters_not_moved"] = sorted(set(state_dict) - moved)
        coordinates = torch.cat([state_dict[f"embeddings.core_coordinates.{i}"] for i in range(4)]).tanh()
        result["core_coordinates_finite_in_range"] = bool(coordinates.isfinite().all() and coordinates.abs().max() < 1)
        (args.output_dir / "result.json").write_text(json.dumps(result, indent=2))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
