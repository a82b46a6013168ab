# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Streaming image data for distillation: loading, robust decoding, transforms, a deterministic stream, collate.

The pieces, in the order a training script uses them:

1. `load_image_dataset` opens a local image folder, parquet shards, webdataset tars or a Hub dataset as a streamed
   `datasets.IterableDataset`; `detect_image_column` finds the image column.
2. `build_transform` derives the image transform from an image processor's settings, in torchvision transforms v2
   (train: resize the short side, random crop, flip, TrivialAugmentWide, as in the paper; eval: resize + centre
   crop; both normalised with the processor's mean/std). `VecaImageProcessorPil.for_resolution(r)` gives the
   paper's settings at crop `r` (short side `r * 288 / 256`).
3. `ImageStream` turns the dataset into a per-epoch, per-rank stream of transformed tensors. It is exactly
   reproducible: replaying the same epoch gives bit-identical tensors, which is what exact resume relies on
   (rebuild the stream and skip, before decoding, the samples already consumed: `resume_plan`, `set_skip`; parquet
   shards are replayed on a twin of row positions and their consumed row groups are not read, `resume`).
4. `collate_images` batches it and counts the images that could not be used; `resize_batch` downsizes a batch for
   per-step multi-resolution training.

```python
from torch.utils.data import DataLoader
from veca_hf import VecaImageProcessorPil
from veca_hf.data import (
    ImageStream, build_transform, collate_images, dataset_root, detect_image_column, load_image_dataset
)

dataset = load_image_dataset("path/to/images")
processor = VecaImageProcessorPil.for_resolution(256)  # what the trained model will be saved with
stream = ImageStream(dataset, detect_image_column(dataset), build_transform(processor, train=True), seed=0,
                     image_root=dataset_root("path/to/images"))  # an image folder's files are read only inside it
loader = DataLoader(stream, batch_size=64, num_workers=4, collate_fn=collate_images,
                    generator=torch.Generator().manual_seed(0))  # keeps the global RNG out of it
for epoch in range(num_epochs):
    stream.set_epoch(epoch)
    for batch in loader:  # batch["pixel_values"]: (B', 3, 256, 256), B' = 64 - batch["num_skipped"]
        ...
```

Shapes: `B` batch, `H`/`W` image height/width, `r` resolution.

The modules, one job each: `sources` (finding and opening the data), `retry` (passing network faults, one rule for
every remote read), `decoding`, `transforms` (with collation), `stream` (the deterministic, resumable stream).
"""

from .decoding import (
    DEFAULT_MAX_IMAGE_PIXELS,
    SKIP_PATH_NOT_ALLOWED,
    SKIP_TOO_LARGE,
    SKIP_TOO_SMALL,
    SKIP_UNDECODABLE,
    decode_image,
)
from .retry import StreamRetries
from .sources import (
    IMAGE_COLUMN_NAMES,
    check_shard_count,
    dataset_root,
    detect_image_column,
    expand_braces,
    find_broken_shards,
    is_remote,
    load_image_dataset,
    parse_storage_options,
    resolve_data_files,
    resolve_remote_files,
)
from .stream import ImageStream, infinite_batches, resume_plan
from .transforms import build_transform, collate_images, resize_batch


__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "IMAGE_COLUMN_NAMES",
    "SKIP_PATH_NOT_ALLOWED",
    "SKIP_TOO_LARGE",
    "SKIP_TOO_SMALL",
    "SKIP_UNDECODABLE",
    "ImageStream",
    "StreamRetries",
    "build_transform",
    "check_shard_count",
    "collate_images",
    "dataset_root",
    "decode_image",
    "detect_image_column",
    "expand_braces",
    "find_broken_shards",
    "infinite_batches",
    "is_remote",
    "load_image_dataset",
    "parse_storage_options",
    "resize_batch",
    "resolve_data_files",
    "resolve_remote_files",
    "resume_plan",
]
