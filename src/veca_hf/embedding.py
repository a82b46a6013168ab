# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Embedding a whole streamed dataset into Parquet files, across processes and machines, resumable at any point.

The work is cut into *parts* that do not depend on how many processes run: part `(s, k)` is rows
`[k * R, (k + 1) * R)` of the dataset's data source `s` (its `s`-th shard, in `datasets`' order), `R` =
`rows_per_file`. Each part becomes one file, `part-<s>-<k>.parquet`, written to a temporary name and renamed when
complete. A restart lists the part files that exist, passes over their rows without decoding them and redoes the
rest, so every sample lands exactly once whatever was killed when.

Parts go to *lanes*, one per DataLoader worker of each process (`world_size x num_workers`): whole sources when
there are at least as many sources as lanes (each source is then read by one lane only), else parts round-robin
(every lane walks every source, decoding only its own parts). A lane hands the main process batches that never
span two parts; the main process runs the model and writes a part when its last batch arrives.

    OUT/
      extraction.json          the settings; a restart must match them
      part-00000-00000.parquet id, embedding[, patch_mean | patch_features, grid_height, grid_width]
      .progress/source-00000.json  a source's row count, once a lane has read it to the end
      metadata.json            model, budget, resolution, processor, dtype, counts, skipped images (at the end)

Shapes: `B` batch, `D` hidden size, `Hp x Wp` patch grid, `C` active cores.
"""

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers.utils import logging

from .arguments import DTYPE_SPELLINGS, redact_urls
from .data import decode_image
from .data.retry import StreamRetries, remote_url_in_error, safe_cause
from .data.stream import exit_with_parent


logger = logging.get_logger(__name__)

PATCH_COLUMNS = {"none": [], "mean": ["patch_mean"], "all": ["patch_features", "grid_height", "grid_width"]}
PATCH_FEATURES = tuple(PATCH_COLUMNS)
SETTINGS_FILE = "extraction.json"
METADATA_FILE = "metadata.json"
PROGRESS_DIR = ".progress"
_PART_NAME = re.compile(r"part-(\d{5,})-(\d{5,})\.parquet")
_PART_METADATA_KEY = b"veca_hf"


def part_name(source: int, part: int) -> str:
    return f"part-{source:05d}-{part:05d}.parquet"


def completed_parts(output_dir: str | os.PathLike) -> set[tuple[int, int]]:
    """The `(source, part)` of every finished part: its Parquet file, or the marker of a part without a single
    usable image (`datasets` cannot read a Parquet file of zero rows). Only complete files carry these names."""
    output_dir = Path(output_dir)
    names = [*os.listdir(output_dir)] if output_dir.is_dir() else []
    names += [name.replace(".json", ".parquet") for name in _listdir(output_dir / PROGRESS_DIR)]
    return {(int(m[1]), int(m[2])) for m in map(_PART_NAME.fullmatch, names) if m}


def _listdir(path: Path) -> list[str]:
    return os.listdir(path) if path.is_dir() else []


def remove_partial_files(output_dir: str | os.PathLike) -> list[str]:
    """Delete the temporary files a killed run left (parts and markers being written); returns their names."""
    output_dir = Path(output_dir)
    leftovers = [*output_dir.glob(".part-*.tmp*"), *output_dir.glob(f"{PROGRESS_DIR}/.*.tmp*")]
    for path in leftovers:
        path.unlink(missing_ok=True)
    return sorted(path.name for path in leftovers)


def source_rows(output_dir: str | os.PathLike) -> dict[int, int]:
    """Row counts of the sources some lane has read to their end."""
    progress = Path(output_dir) / PROGRESS_DIR
    counts = {}
    for path in progress.glob("source-*.json") if progress.is_dir() else []:
        counts[int(path.stem.split("-")[1])] = json.loads(path.read_text())["rows"]
    return counts


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(temporary)
    with open(temporary, "rb") as handle:  # NOTE: on disk before the rename makes it count as done
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, lambda temporary: temporary.write_text(json.dumps(data, indent=2, sort_keys=True)))


# ----------------------------------------------------------------------------------------------------------------
# Settings and preprocessing
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class EmbeddingSettings:
    """What decides the content of the files: a restart with other values would mix two kinds of rows."""

    model: str
    model_type: str
    num_core_tokens: int | str | None  # None: not a VECA model; "auto": each image's budget picked by the policy
    resolution: int | None  # None with keep_size: each image at its own size
    keep_size: bool
    max_image_side: int | None
    patch_features: str
    dtype: str
    rows_per_file: int
    image_column: str
    dataset: str
    min_image_size: int
    budget_policy: dict | None = None  # with num_core_tokens="auto": the model's config.adaptive_budget

    def check_against(self, output_dir: Path) -> None:
        """Write the settings into a new `output_dir`, or check that they equal the ones written there before."""
        path = output_dir / SETTINGS_FILE
        current = json.loads(json.dumps(dataclasses.asdict(self)))  # as written: tuples become lists
        if not path.exists():
            write_json(path, current)
            return
        stored = json.loads(path.read_text())
        # A short spelling stored there (`bf16`) is the same setting as its torch name (`bfloat16`).
        stored["dtype"] = DTYPE_SPELLINGS.get(stored.get("dtype"), stored.get("dtype"))
        different = {name: (stored.get(name), value) for name, value in current.items() if stored.get(name) != value}
        if different:
            listed = ", ".join(f"{name}: {old!r} there, {new!r} now" for name, (old, new) in different.items())
            raise ValueError(
                f"{output_dir} holds embeddings made with other settings ({listed}). Resume with the same flags, or "
                "pass another --output_dir."
            )


def resolution_overrides(image_processor, resolution: int) -> dict:
    """Processor kwargs that give `resolution x resolution` inputs, keeping the processor's resize-to-crop ratio."""
    size, crop = image_processor.size, getattr(image_processor, "crop_size", None)
    if getattr(image_processor, "do_center_crop", False) and crop and crop.height and size.shortest_edge:
        ratio = size.shortest_edge / crop.height
        return {
            "size": {"shortest_edge": round(resolution * ratio)},
            "crop_size": {"height": resolution, "width": resolution},
        }
    return {"size": {"height": resolution, "width": resolution}, "do_center_crop": False}


class Preprocess:
    """An RGB PIL image -> `(3, H, W)` through the saved image processor: at one resolution, as saved, or (VECA's
    processors) at the image's own size rounded to patch multiples, optionally bounded by `max_image_side`."""

    def __init__(self, image_processor, resolution: int | None, keep_size: bool, patch_size: int, max_side=None):
        self.image_processor = image_processor
        self.keep_size, self.patch_size, self.max_side = keep_size, patch_size, max_side
        self.overrides = resolution_overrides(image_processor, resolution) if resolution else {}

    def __call__(self, image) -> torch.Tensor:
        overrides = self.overrides
        if self.keep_size:
            size = {"shortest_edge": min(image.size)}
            if self.max_side:
                size["longest_edge"] = self.max_side
            overrides = {"size": size, "do_center_crop": False, "ensure_multiple_of": self.patch_size, "do_pad": False}
        return self.image_processor(images=image, return_tensors="pt", **overrides)["pixel_values"][0]


def pad_batch(images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack `(3, H_i, W_i)` images; of different sizes, zero-pad bottom and right with a `pixel_mask` (B, H, W)."""
    if all(image.shape == images[0].shape for image in images):
        return torch.stack(images), None
    height, width = max(image.shape[1] for image in images), max(image.shape[2] for image in images)
    pixel_values = images[0].new_zeros(len(images), 3, height, width)
    pixel_mask = torch.zeros(len(images), height, width, dtype=torch.long)
    for index, image in enumerate(images):
        pixel_values[index, :, : image.shape[1], : image.shape[2]] = image
        pixel_mask[index, : image.shape[1], : image.shape[2]] = 1
    return pixel_values, pixel_mask


# ----------------------------------------------------------------------------------------------------------------
# The stream of part batches
# ----------------------------------------------------------------------------------------------------------------


def sample_id(example: dict, image_column: str, source: int, row: int, root: str | None) -> str:
    """A stable key of the sample: its path within a local image folder (or its URL, without credentials), the
    webdataset key, or else its position `shard-<s>#<row>` in the dataset's `s`-th data source."""
    if "__key__" in example and example["__key__"] is not None:
        return str(example["__key__"])
    value = example[image_column]
    path = value.get("path") if isinstance(value, dict) else None
    if path and root is not None:
        relative = os.path.relpath(path, root)
        return path if relative.startswith("..") else relative
    if path and "://" in path:
        return redact_urls(path)
    return f"shard-{source:05d}#{row}"


class PartBatches(torch.utils.data.IterableDataset):
    """Batches of the parts this process's lanes own that are not on disk yet, for a `DataLoader(batch_size=None)`.

    Yields `{"source", "part", "ids", "pixel_values" (B, 3, H, W) or None, "pixel_mask" or None, "skipped":
    [(id, reason)], "rows": rows of the part (on its last batch, else None)}`; a batch never spans two parts.
    `root` (a local image folder) makes ids relative to it; `image_root` is where images given as paths may be
    read (`veca_hf.data.dataset_root`; see `decode_image`).
    """

    def __init__(
        self,
        dataset: datasets.IterableDataset,
        image_column: str,
        preprocess: Callable,
        *,
        output_dir: str | os.PathLike,
        rows_per_file: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        min_image_size: int = 1,
        root: str | None = None,
        image_root: str | None = None,
    ):
        columns = [image_column] + (["__key__"] if "__key__" in (dataset.column_names or []) else [])
        dataset = dataset.select_columns(columns)
        if isinstance((dataset.features or {}).get(image_column), datasets.Image):
            dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
        self.dataset, self.image_column, self.preprocess = dataset, image_column, preprocess
        self.output_dir, self.rows_per_file, self.batch_size = Path(output_dir), rows_per_file, batch_size
        self.rank, self.world_size, self.min_image_size, self.root = rank, world_size, min_image_size, root
        self.image_root = image_root
        self.num_sources = dataset.num_shards

    def lanes(self) -> tuple[int, int]:
        worker = torch.utils.data.get_worker_info()
        num_workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        return self.world_size * num_workers, self.rank * num_workers + worker_id

    def owns(self, source: int, part: int, num_lanes: int, lane: int) -> bool:
        if self.num_sources >= num_lanes:
            return source % num_lanes == lane
        return (source + part) % num_lanes == lane

    def _rows(self, source: int, start: int) -> Iterator[dict]:
        """Undecoded examples of one source from row `start`, reopened where it stopped after a network fault."""
        retries = StreamRetries.configured()
        failures, row = 0, start  # network faults in a row
        while True:
            try:
                for example in self.dataset.shard(self.num_sources, source).skip(row).iter(batch_size=1):
                    yield {name: values[0] for name, values in example.items()}
                    row, failures = row + 1, 0
                return
            except Exception as error:
                failures += 1
                if not retries.is_retried(error, failures):
                    raise RuntimeError(
                        redact_urls(
                            f"Reading data source {source} failed at row {row} with {type(error).__name__}: {error}. "
                            "Once the shard is repaired or the server is back, run the same command again: the "
                            "finished files are kept."
                        )
                    ) from safe_cause(error)
                where = remote_url_in_error(error) or f"data source {source}"
                retries.back_off(f"Reading {where}", error, failures, f"reopening it at row {row}")

    def __iter__(self) -> Iterator[dict]:
        exit_with_parent()
        num_lanes, lane = self.lanes()
        done, counted = completed_parts(self.output_dir), source_rows(self.output_dir)
        for source in range(self.num_sources):
            if self.num_sources >= num_lanes and source % num_lanes != lane:
                continue
            if source in counted:
                parts = range(math.ceil(counted[source] / self.rows_per_file))
                if all((source, k) in done for k in parts if self.owns(source, k, num_lanes, lane)):
                    continue
            yield from self._source_batches(source, done, num_lanes, lane)

    def _source_batches(self, source: int, done: set, num_lanes: int, lane: int) -> Iterator[dict]:
        pending = None  # the part being filled: {"part", "ids", "images", "skipped", "rows"}
        row = -1
        for row, example in enumerate(self._rows(source, 0)):
            part = row // self.rows_per_file
            if pending is not None and pending["part"] != part:
                yield self._batch(source, pending, last=True)
                pending = None
            if (source, part) in done or not self.owns(source, part, num_lanes, lane):
                continue
            if pending is None:
                pending = {"part": part, "ids": [], "images": [], "skipped": [], "rows": 0}
            pending["rows"] += 1
            key = sample_id(example, self.image_column, source, row, self.root)
            image, reason = decode_image(
                example[self.image_column], min_size=self.min_image_size, root=self.image_root
            )
            if image is None:
                pending["skipped"].append((key, reason))
                continue
            try:
                pending["images"].append(self.preprocess(image))
            except Exception as error:  # NOTE: an image the processor refuses (e.g. below one patch) is data, too
                logger.warning(f"Skipping {key!r}: {type(error).__name__}: {error}")
                pending["skipped"].append((key, "unprocessable"))
                continue
            pending["ids"].append(key)
            if len(pending["images"]) == self.batch_size:
                yield self._batch(source, pending, last=False)
        if pending is not None:
            yield self._batch(source, pending, last=True)
        write_json(self.output_dir / PROGRESS_DIR / f"source-{source:05d}.json", {"rows": row + 1})

    def _batch(self, source: int, pending: dict, last: bool) -> dict:
        pixel_values, pixel_mask = pad_batch(pending["images"]) if pending["images"] else (None, None)
        batch = {
            "source": source, "part": pending["part"], "ids": pending["ids"], "pixel_values": pixel_values,
            "pixel_mask": pixel_mask, "skipped": pending["skipped"], "rows": pending["rows"] if last else None,
        }  # fmt: skip
        pending["ids"], pending["images"], pending["skipped"] = [], [], []
        return batch


# ----------------------------------------------------------------------------------------------------------------
# The model side and the files
# ----------------------------------------------------------------------------------------------------------------


def _num_prefix_tokens(model) -> int:
    config = model.config
    if config.model_type == "veca":
        return None  # the budget's cores: known from the output
    return 1 + (getattr(config, "num_register_tokens", 0) or 0)


@torch.inference_mode()
def embed(model, batch: dict, num_core_tokens: int | None, patch_features: str, dtype: torch.dtype) -> dict:
    """`{"embedding": (B, D)[, "patch_mean": (B, D) | "patch_features": list of (Hp_i * Wp_i, D), "grid": list of
    (Hp_i, Wp_i)][, "num_core_tokens": (B,)]}` in float32: VECA's `pooler_output` (core 1 after the final norm), or a
    DINO model's; `num_core_tokens` is each image's budget where the batch ran at one per image."""
    device = next(model.parameters()).device
    pixel_values = batch["pixel_values"].to(device=device, dtype=dtype)
    kwargs = {}
    if model.config.model_type == "veca":
        kwargs["num_core_tokens"] = num_core_tokens
        if batch["pixel_mask"] is not None:
            kwargs["pixel_mask"] = batch["pixel_mask"].to(device)
    outputs = model(pixel_values=pixel_values, **kwargs)
    result = {"embedding": outputs.pooler_output.float().cpu()}
    if getattr(outputs, "core_mask", None) is not None:
        result["num_core_tokens"] = outputs.core_mask.sum(dim=1).cpu()  # (B,)
    if patch_features == "none":
        return result
    prefix = _num_prefix_tokens(model) or outputs.core_positions.shape[1]
    patch_size = model.config.patch_size
    grid = (pixel_values.shape[2] // patch_size, pixel_values.shape[3] // patch_size)
    patches = outputs.last_hidden_state[:, prefix:].float().cpu().reshape(len(pixel_values), *grid, -1)
    mask = batch["pixel_mask"]  # (B, H, W), images top-left: an image's height is its first column's sum
    if mask is None:
        grids = [grid] * len(patches)
    else:
        grids = [(int(m[:, 0].sum()) // patch_size, int(m[0].sum()) // patch_size) for m in mask]
    own = [
        image[:height, :width].reshape(height * width, -1)
        for image, (height, width) in zip(patches, grids, strict=True)
    ]
    if patch_features == "mean":
        result["patch_mean"] = torch.stack([tokens.mean(0) for tokens in own])
    else:
        result["patch_features"], result["grid"] = own, grids
    return result


def part_table(ids: list[str], features: list[dict], patch_features: str, hidden_size: int) -> pa.Table:
    """The Parquet table of one part: `id`, `embedding` (float32 x D), the patch features asked for, and each image's
    budget (`num_core_tokens`) where the model picked one per image."""
    vector = pa.list_(pa.float32(), hidden_size)
    embeddings = np.concatenate([f["embedding"].numpy() for f in features]) if features else np.zeros((0, hidden_size))
    columns = {"id": pa.array(ids, pa.string()), "embedding": _vectors(embeddings, vector)}
    if patch_features == "mean":
        means = np.concatenate([f["patch_mean"].numpy() for f in features]) if features else np.zeros((0, hidden_size))
        columns["patch_mean"] = _vectors(means, vector)
    elif patch_features == "all":
        tokens = [t.numpy() for f in features for t in f["patch_features"]]
        grids = [g for f in features for g in f["grid"]]
        offsets = np.cumsum([0] + [len(t) for t in tokens]).astype(np.int32)
        flat = np.concatenate(tokens) if tokens else np.zeros((0, hidden_size), np.float32)
        columns["patch_features"] = pa.ListArray.from_arrays(pa.array(offsets), _vectors(flat, vector))
        columns["grid_height"] = pa.array([g[0] for g in grids], pa.int32())
        columns["grid_width"] = pa.array([g[1] for g in grids], pa.int32())
    if features and "num_core_tokens" in features[0]:
        columns["num_core_tokens"] = pa.array(torch.cat([f["num_core_tokens"] for f in features]).numpy(), pa.int32())
    return pa.table(columns)


def _vectors(array: np.ndarray, vector_type: pa.DataType) -> pa.Array:
    flat = pa.array(np.ascontiguousarray(array, dtype=np.float32).reshape(-1), pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, vector_type.list_size)


def write_part(output_dir: Path, source: int, part: int, table: pa.Table, rows: int, skipped: list) -> Path:
    """Write one part atomically; its row count and skipped images travel in the file's metadata (in a marker
    under `.progress/` when no image of the part could be used)."""
    info = {"rows": rows, "skipped": [{"id": key, "reason": reason} for key, reason in skipped]}
    if table.num_rows == 0:
        path = output_dir / PROGRESS_DIR / part_name(source, part).replace(".parquet", ".json")
        write_json(path, info)
        return path
    table = table.replace_schema_metadata({_PART_METADATA_KEY: json.dumps(info).encode()})
    path = output_dir / part_name(source, part)
    _write_atomically(path, lambda temporary: pq.write_table(table, temporary))
    return path


def part_info(output_dir: str | os.PathLike, source: int, part: int) -> dict:
    """`{"rows": rows of the part, images or not, "skipped": [{"id", "reason"}]}` of a finished part."""
    path = Path(output_dir) / part_name(source, part)
    if path.exists():
        return json.loads(pq.read_schema(path).metadata[_PART_METADATA_KEY])
    return json.loads((path.parent / PROGRESS_DIR / path.name.replace(".parquet", ".json")).read_text())


class PartWriter:
    """Collects each part's batches (in the order its lane made them) and writes the part at its last batch."""

    def __init__(self, output_dir: Path, patch_features: str, hidden_size: int):
        self.output_dir, self.patch_features, self.hidden_size = output_dir, patch_features, hidden_size
        self.open: dict[tuple[int, int], dict] = {}
        self.images = self.skipped = self.files = 0

    def add(self, batch: dict, features: dict | None) -> None:
        key = (batch["source"], batch["part"])
        state = self.open.setdefault(key, {"ids": [], "features": [], "skipped": []})
        state["ids"] += batch["ids"]
        state["skipped"] += batch["skipped"]
        if features is not None:
            state["features"].append(features)
        self.images += len(batch["ids"])
        self.skipped += len(batch["skipped"])
        if batch["rows"] is not None:
            del self.open[key]
            table = part_table(state["ids"], state["features"], self.patch_features, self.hidden_size)
            write_part(self.output_dir, *key, table, batch["rows"], state["skipped"])
            self.files += 1


def summarize(output_dir: Path, settings: EmbeddingSettings, processor: dict, num_sources: int) -> dict:
    """Check that every part of every source is on disk and write `metadata.json` with the counts."""
    done, counted = completed_parts(output_dir), source_rows(output_dir)
    missing_sources = [s for s in range(num_sources) if s not in counted]
    missing_parts = [
        part_name(s, k) for s, rows in counted.items() for k in range(math.ceil(rows / settings.rows_per_file))
        if (s, k) not in done
    ]  # fmt: skip
    if missing_sources or missing_parts:
        raise RuntimeError(
            f"{output_dir} is incomplete: sources not read to their end {missing_sources[:10]}, missing parts "
            f"{missing_parts[:10]}. Run the same command again to finish them."
        )
    rows, skipped = 0, []
    for source, part in sorted(done):
        info = part_info(output_dir, source, part)
        rows += info["rows"]
        skipped += info["skipped"]
    images = rows - len(skipped)
    metadata = {
        **dataclasses.asdict(settings),
        "processor": processor,
        "num_sources": num_sources,
        "num_files": sum((output_dir / part_name(source, part)).exists() for source, part in done),
        "num_rows": rows,
        "num_images": images,
        "num_skipped": len(skipped),
        "skipped": skipped,
        "columns": ["id", "embedding", *PATCH_COLUMNS[settings.patch_features]],
    }
    write_json(output_dir / METADATA_FILE, metadata)
    return metadata


__all__ = [
    "PATCH_FEATURES",
    "EmbeddingSettings",
    "PartBatches",
    "PartWriter",
    "Preprocess",
    "completed_parts",
    "embed",
    "pad_batch",
    "part_info",
    "remove_partial_files",
    "resolution_overrides",
    "sample_id",
    "summarize",
]
