#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""How long a resumed `examples/distill.py` takes to reach its next batch, mid-epoch.

Writes parquet shards of small generated JPEGs (enough for `--steps` x `--batch_size` images in one epoch, so the
whole position lies inside the current epoch), then times `veca_hf.data.infinite_batches` (the stream of
`examples/distill.py`) up to the first batch after `--steps` consumed batches:

- `skip`: what a checkpoint holds now (batches per DataLoader worker): consumed samples are passed over undecoded;
- `replay`: a checkpoint without per-worker positions (the previous behaviour): every consumed batch is decoded,
  augmented and discarded. It grows linearly with the steps, so it is timed at `--replay_steps` and scaled
  (`first_batch_seconds` + the measured extra x steps / replay_steps).

    python benchmarks/resume_skip.py --steps 10000 --batch_size 32 --output_dir outputs/resume_skip
"""

import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
from PIL import Image
from transformers import HfArgumentParser

from veca_hf.data import ImageStream, build_transform, collate_images, infinite_batches, load_image_dataset


@dataclass
class Arguments:
    output_dir: str = field(default="outputs/resume_skip", metadata={"help": "The generated shards and results."})
    steps: int = field(default=10000, metadata={"help": "Consumed batches at the resume point."})
    replay_steps: int = field(default=200, metadata={"help": "Steps at which the replay is timed (then scaled)."})
    batch_size: int = 32
    resolution: int = 224
    image_size: int = field(default=48, metadata={"help": "Side of the generated JPEGs."})
    num_shards: int = 16
    dataloader_num_workers: int = 2
    shuffle_buffer_size: int = 1000


def write_shards(folder: Path, count: int, size: int, num_shards: int) -> None:
    """`count` distinct noisy JPEGs in `num_shards` parquet files (skipped when already there)."""
    if len(list(folder.glob("*.parquet"))) == num_shards:
        return
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    base = np.linspace(0, 255, size, dtype=np.float32)[None, :, None] * np.ones((size, 1, 3), np.float32)
    per_shard = -(-count // num_shards)
    for shard in range(num_shards):
        images = []
        for _ in range(min(per_shard, count - shard * per_shard)):
            array = np.clip(base + rng.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(array).save(buffer, format="JPEG", quality=85)
            images.append({"bytes": buffer.getvalue(), "path": None})
        table = datasets.Dataset.from_dict({"image": images}).cast_column("image", datasets.Image())
        table.to_parquet(str(folder / f"part-{shard:05d}.parquet"))


def time_to_next_batch(stream, loader_kwargs, position: dict) -> float:
    start = time.perf_counter()
    batch = next(infinite_batches(stream, loader_kwargs, 0, position, "empty"))
    assert batch["pixel_values"] is not None
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(Arguments).parse_args_into_dataclasses(args=argv)
    output_dir = Path(args.output_dir)
    write_shards(
        output_dir / "shards", args.steps * args.batch_size + args.batch_size, args.image_size, args.num_shards
    )
    dataset = load_image_dataset(str(output_dir / "shards"))
    stream = ImageStream(
        dataset,
        "image",
        build_transform(args.resolution, train=True),
        seed=0,
        shuffle_buffer_size=args.shuffle_buffer_size,
    )
    loader_kwargs = dict(
        batch_size=args.batch_size, collate_fn=collate_images, num_workers=args.dataloader_num_workers
    )
    workers = max(1, args.dataloader_num_workers)

    def position(steps: int, per_worker: bool) -> dict:
        state = {"epoch": 0, "batches": steps}
        if per_worker:  # what the training loop records: batches are taken from the workers in turn
            state.update(
                worker_batches=[len(range(w, steps, workers)) for w in range(workers)],
                last_worker=(steps - 1) % workers,
            )
        return state

    results = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "resolution": args.resolution,
        "dataloader_num_workers": args.dataloader_num_workers,
        "first_batch_seconds": time_to_next_batch(stream, loader_kwargs, position(0, True)),
        "skip_seconds": time_to_next_batch(stream, loader_kwargs, position(args.steps, True)),
        "replay_steps": args.replay_steps,
        "replay_seconds_measured": time_to_next_batch(stream, loader_kwargs, position(args.replay_steps, False)),
    }
    # The replay's cost above a fresh start grows linearly with the consumed batches.
    extra = results["replay_seconds_measured"] - results["first_batch_seconds"]
    results["replay_seconds_scaled"] = results["first_batch_seconds"] + extra * args.steps / args.replay_steps
    (output_dir / "resume_skip.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
