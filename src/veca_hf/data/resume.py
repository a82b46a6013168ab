# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Resuming a streamed epoch of parquet shards without reading what it already consumed.

The order in which `datasets` streams a shuffled parquet dataset (shard order, shards read ten at a time in batches,
the shuffle buffer's draws, the split across ranks and DataLoader workers) depends only on the seed, the epoch, the
buffer size and the shards' row-group sizes, never on the rows' content. So a *position twin*, parquet files with the
same row groups holding only each row's `(shard, row)` position, streams through the same calls in the same order as
the real shards. A resumed epoch walks the twin (a few integers per row, no image bytes) past the consumed samples,
and reads from the real shards only the row groups that hold samples still to come (those still in the shuffle
buffer at the checkpoint, and everything after it), each once.

What it costs: the footer of every shard (its row-group sizes, a few KiB) and two passes over the twin, of the epoch's
positions in this worker's share. Webdataset tars cannot be read from the middle: a resumed epoch of tars reads the
consumed part of its shards again (undecoded).
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from datasets.table import table_cast
from transformers.utils import logging

from ..arguments import redact_urls
from .retry import StreamRetries


logger = logging.get_logger(__name__)

POSITION_COLUMN = "__position__"
_ROW_BITS = 40  # position = shard << 40 | row: up to 2^40 rows per shard, 2^23 shards


# Wrappers of `datasets`' examples iterables that the twin reproduces: column selection changes nothing in the order,
# `skip(n)` and `take(n)` (a held-out split) are applied to the twin too.
_ORDER_NEUTRAL = ("SelectColumnsIterable",)
_REPLAYED = {"SkipExamplesIterable": "skip", "TakeExamplesIterable": "take"}
_REPLAYED_FLAGS = ("n", "block_sources_order_when_shuffling", "split_when_sharding")


def parquet_files_of(dataset: datasets.IterableDataset) -> tuple[list[str], dict, list[tuple]] | None:
    """What a streamed dataset of plain parquet shards reads: its files in `datasets`' shard order, their fsspec
    storage options, and the `skip`/`take` applied on top (innermost first, with their flags); `None` for anything
    else (tars, image folders, resharded row groups, other transformations).

    NOTE: reads `datasets` internals (the chain of examples iterables and the parquet builder's generator kwargs);
    `tests/test_data.py::test_position_twin_streams_in_the_real_order` checks that the twin built from them streams in
    the real order, so a change in `datasets` fails there, not silently.
    """
    iterable, operations = getattr(dataset, "_ex_iterable", None), []
    while iterable is not None and not hasattr(iterable, "generate_tables_fn"):
        name = type(iterable).__name__
        if name in _REPLAYED:
            operations.append((_REPLAYED[name], {flag: getattr(iterable, flag, None) for flag in _REPLAYED_FLAGS}))
        elif name not in _ORDER_NEUTRAL:
            return None
        iterable = getattr(iterable, "ex_iterable", None)
    if iterable is None:
        return None
    builder = getattr(iterable.generate_tables_fn, "__self__", None)
    kwargs = getattr(iterable, "kwargs", {})
    files, row_groups = kwargs.get("files"), kwargs.get("row_groups_list")
    if type(builder).__name__ != "Parquet" or not files or any(groups is not None for groups in row_groups or []):
        return None
    if getattr(builder.config, "batch_size", None) or getattr(builder.config, "filters", None):
        return None
    return list(files), dict(getattr(builder, "storage_options", None) or {}), operations[::-1]


def _open(file: str, storage_options: dict):
    """`file` opened for reading; remote files read exactly the ranges asked for (no read-ahead block)."""
    import fsspec

    filesystem, path = fsspec.core.url_to_fs(file, **_options_for(file, storage_options))
    if "file" in filesystem.protocol:
        return filesystem.open(path, "rb")
    return filesystem.open(path, "rb", cache_type="none")


def _remove_if_owner(directory: str, owner: int) -> None:
    """Remove the twin's folder, from the process that wrote it only (forked DataLoader workers share the object)."""
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)


def _read_metadata(handle) -> pq.FileMetaData:
    """A parquet file's metadata from its footer alone (two small reads at the end, whatever the file's size)."""
    size = handle.seek(0, os.SEEK_END)
    handle.seek(size - 8)
    tail = handle.read(8)  # footer length (4 bytes, little endian) + b"PAR1"
    if len(tail) != 8 or tail[4:] != b"PAR1":
        raise ValueError(redact_urls(f"{getattr(handle, 'path', handle)} is not a parquet file (no PAR1 footer)."))
    length = int.from_bytes(tail[:4], "little")
    handle.seek(size - 8 - length)
    footer = handle.read(length)
    return pq.read_metadata(io.BytesIO(b"PAR1" + footer + tail))


def _options_for(file: str, storage_options: dict) -> dict:
    """The fsspec options of `file`, picked from `datasets`' storage options as `datasets` picks them: the entry of
    the file's protocol if there is one, else every option that is not another protocol's entry."""
    import fsspec

    protocol = file.split("://", 1)[0] if "://" in file else "file"
    if protocol in storage_options:
        return dict(storage_options[protocol])
    return {key: value for key, value in storage_options.items() if key not in fsspec.available_protocols()}


class ParquetResume:
    """The position twin of parquet shards and the reader of their row groups (see the module docstring).

    Args:
        files (`Sequence[str]`): the shards, in `datasets`' order (from [`parquet_files_of`]).
        storage_options (`dict`): their fsspec options (`datasets`' form, keyed by protocol or flat).
        column (`str`): the column to read (the image column).
        feature: its `datasets` feature after the stream's cast (e.g. `Image(decode=False)`), so that a value read
            here equals the value `datasets` streams.
        operations (`list`): the `skip`/`take` the stream applies (from [`parquet_files_of`]).
    """

    def __init__(self, files: Sequence[str], storage_options: dict, column: str, feature, operations=()):
        self.files = list(files)
        self.storage_options = storage_options
        self.operations = list(operations)
        self.column = column
        self.feature = feature
        self.boundaries: list[np.ndarray] = []  # per shard: row-group start rows, then the row count
        self.metadata: list[pq.FileMetaData] = []
        self.twin_files: list[str] = []
        self._directory: str | None = None

    def build(self) -> datasets.IterableDataset:
        """Read every shard's footer and write the twin (in a temporary folder removed when this object goes)."""
        self._directory = tempfile.mkdtemp(prefix="veca_hf_resume_")
        weakref.finalize(self, _remove_if_owner, self._directory, os.getpid())
        retries = StreamRetries.configured()
        for shard, file in enumerate(self.files):
            metadata = retries.call(
                lambda file=file: self._read_footer(file), f"{file} (its footer)", not_found_attempts=1
            )
            self.metadata.append(metadata)
            sizes = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
            self.boundaries.append(np.cumsum([0, *sizes]))
            positions = (np.int64(shard) << _ROW_BITS) + np.arange(metadata.num_rows, dtype=np.int64)
            table = pa.table({POSITION_COLUMN: positions})
            twin = os.path.join(self._directory, f"{shard:06d}.parquet")
            with pq.ParquetWriter(twin, table.schema) as writer:
                for start, stop in zip(self.boundaries[-1][:-1], self.boundaries[-1][1:], strict=True):
                    writer.write_table(table.slice(start, stop - start))
            self.twin_files.append(twin)
        return self.twin()

    def _read_footer(self, file: str) -> pq.FileMetaData:
        with _open(file, self.storage_options) as handle:
            return _read_metadata(handle)

    def twin(self) -> datasets.IterableDataset:
        """The twin dataset, with the real one's `skip`/`take` (their flags checked: `ValueError` if they differ)."""
        twin = datasets.load_dataset("parquet", data_files={"train": self.twin_files}, split="train", streaming=True)
        for operation, flags in self.operations:
            twin = getattr(twin, operation)(flags["n"])
            replayed = {flag: getattr(twin._ex_iterable, flag, None) for flag in _REPLAYED_FLAGS}
            if replayed != flags:
                raise ValueError(f"The twin's {operation} has {replayed}, the stream's {flags}.")
        return twin

    def read_group(self, shard: int, group: int) -> list[Any]:
        """The column's values in one row group of one shard, as `datasets` streams them."""
        try:
            with _open(self.files[shard], self.storage_options) as handle:
                parquet = pq.ParquetFile(handle, metadata=self.metadata[shard], pre_buffer=False)
                table = parquet.read_row_group(group, columns=[self.column])
        except Exception as error:  # NOTE: name the file, so that the stream's retry and error messages can; the
            # stream tells a passing fault by the chain, and redacts it before raising further (`safe_cause`)
            raise OSError(redact_urls(f"Reading row group {group} of {self.files[shard]} failed: {error}")) from error
        table = table_cast(table, datasets.Features({self.column: self.feature}).arrow_schema)
        column = self.feature.decode_example if getattr(self.feature, "decode", False) else None
        values = table.column(self.column).to_pylist()
        return [column(value) for value in values] if column else values

    def values(
        self, positions: Iterator[tuple[int, int, int]], future: Iterator[tuple[int, int, int]], skip: int
    ) -> Iterator[tuple[int, int, Any]]:
        """
        `(stream, index, value)` of one worker's share from its `skip`-th sample on.

        Args:
            positions: the twin's `(stream, index, position)` of this worker's share, from its start.
            future: the same again (a second pass): marks which rows are still to come, so that a row group read
                for one of them keeps only the rows this worker yields later.
            skip (`int`): how many of the worker's samples were consumed.
        """
        needed: dict[int, np.ndarray] = {}
        for _, index, position in future:
            if index >= skip:
                shard, row = position >> _ROW_BITS, position & ((1 << _ROW_BITS) - 1)
                if shard not in needed:
                    needed[shard] = np.zeros(int(self.boundaries[shard][-1]), dtype=bool)
                needed[shard][row] = True
        pending: dict[int, Any] = {}
        groups_read = 0
        for stream, index, position in positions:
            if index < skip:
                continue
            if position not in pending:
                shard, row = position >> _ROW_BITS, position & ((1 << _ROW_BITS) - 1)
                group = int(np.searchsorted(self.boundaries[shard], row, side="right")) - 1
                start = int(self.boundaries[shard][group])
                for offset, value in enumerate(self.read_group(shard, group)):
                    if needed[shard][start + offset]:
                        pending[(shard << _ROW_BITS) + start + offset] = value
                groups_read += 1
            yield stream, index, pending.pop(position)
        logger.debug(f"Resumed stream: read {groups_read} row group(s); {len(pending)} row(s) left unused.")
