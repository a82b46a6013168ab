"""Driver for tests/test_deepspeed.py (run under torchrun): a tiny model under Accelerate + DeepSpeed ZeRO-2/3 on the
CPU takes a step, is checkpointed with `veca_hf.training.checkpointing.save_checkpoint` and restored with
`load_checkpoint` (every torch.load forced to weights_only=True); then a code-running pickle planted in the optimiser
state file (manifest rewritten) is refused by name and never runs. Writes `result.json`."""

import argparse
import json
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

from veca_hf.training.checkpointing import UnsafeCheckpointError, load_checkpoint, save_checkpoint, write_manifest


class RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    output_dir = Path(args.output_dir)
    plugin = DeepSpeedPlugin(zero_stage=args.stage, gradient_accumulation_steps=1, gradient_clipping=1.0,
                             zero3_init_flag=args.stage == 3)  # fmt: skip
    plugin.deepspeed_config.update(zero_force_ds_cpu_optimizer=False, train_micro_batch_size_per_gpu=2,
                                   train_batch_size=2 * int(os.environ["WORLD_SIZE"]))  # fmt: skip
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)

    def step():
        loss = model(torch.randn(2, 8).bfloat16()).float().square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    step()
    path = save_checkpoint(accelerator, output_dir, 1, training_state={"step": 1, "num_processes": 1},
                           process_state={"batches": 1})  # fmt: skip
    saved = [p.detach().float().clone() for p in model.parameters()]
    step()
    changed = any(not torch.equal(a, p.detach().float()) for a, p in zip(saved, model.parameters(), strict=True))
    load_checkpoint(accelerator, path)
    restored = all(torch.equal(a, p.detach().float()) for a, p in zip(saved, model.parameters(), strict=True))

    optimizer_file = next(path.rglob("*optim_states.pt"))
    marker = output_dir / "code-ran"
    torch.save({"optimizer_state_dict": RunsCode(str(marker))}, optimizer_file)
    write_manifest(path)
    try:
        load_checkpoint(accelerator, path)
        refused = ""
    except UnsafeCheckpointError as error:
        refused = str(error)
    result = {
        "changed": changed,
        "restored": restored,
        "refused": refused,
        "planted": optimizer_file.name,
        "code_ran": marker.exists(),
        "files": sorted(p.relative_to(path).as_posix() for p in path.rglob("*")),
    }
    if accelerator.is_main_process:
        (output_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
