# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""The deterministic, resumable stream: per epoch, per rank and per DataLoader worker, with skipping before decoding
on resume."""

import os
import threading
import time
from collections.abc import Sequence

import datasets
import numpy as np
import PIL.Image
import PIL.ImageFile
import torch
from datasets.distributed import split_dataset_by_node
from transformers.utils import logging

from ..arguments import redact_urls
from .decoding import DEFAULT_MAX_IMAGE_PIXELS, SKIP_PATH_NOT_ALLOWED, check_max_pixels, decode_image
from .resume import POSITION_COLUMN, ParquetResume, parquet_files_of
from .retry import StreamRetries, is_transient_network_error, remote_url_in_error, safe_cause
from .sources import detect_image_column, redact_datasets_logs


logger = logging.get_logger(__name__)

_PARENT_CHECK_SECONDS = 0.5
_watching_pid: int | None = None  # the DataLoader worker whose parent a thread watches


def exit_with_parent() -> None:
    """In a DataLoader worker, start (once) a daemon thread that ends the worker as soon as its parent is gone.

    NOTE: torch's workers check their parent only between fetches. One that retries a failing read (`datasets`'
    read retries, then the stream's reopening: `--stream_retries` x `--stream_retry_wait` each) is inside a fetch,
    and would outlive a killed run for minutes, asking the server again and again."""
    global _watching_pid
    if torch.utils.data.get_worker_info() is None or _watching_pid == os.getpid():
        return
    # NOTE: the OS parent, as torch's own watchdog records it (`multiprocessing.parent_process()` would be the
    # DataLoader's process, which is not the OS parent of a worker started by a forkserver).
    _watching_pid, parent_pid = os.getpid(), os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:  # an orphan is adopted by init (or a subreaper): its parent pid changes
            time.sleep(_PARENT_CHECK_SECONDS)
        os._exit(1)  # NOTE: no cleanup: nobody is left to hand a batch to, and a retry may hold locks

    threading.Thread(target=watch, name="veca_hf-exit-with-parent", daemon=True).start()


def _sample_seed(*keys: int) -> int:
    """A well-mixed 64-bit seed from non-negative ints (seed, epoch, rank, stream, index)."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0])


class ImageStream(torch.utils.data.IterableDataset):
    """
    The deterministic per-epoch, per-rank stream of transformed images, for a `torch.utils.data.DataLoader`.

    Every epoch the dataset is rebuilt as `shuffle(seed, buffer_size)` -> `set_epoch(epoch)` ->
    `split_dataset_by_node(rank, world_size)`, so each rank reads a disjoint part and all ranks together read
    everything once; the iterator ends at the end of the epoch. The image column is cast to
    `datasets.Image(decode=False)`, so encoded bytes travel through the shuffle buffer and `decode_image` decodes
    them (bad files are reported instead of crashing the pipeline). Images over `max_image_pixels` are skipped from
    their header, undecoded. An image folder streams paths, not bytes: they are read only inside `image_root`, so
    that a row of a shard that names a file or a URL instead of carrying its bytes reads nothing.

    DataLoader workers: when the rank's stream has at least as many shards as workers, `datasets` hands each worker
    whole shards. Otherwise (a streamed image folder is a single shard) every worker walks the rank's whole stream
    of *undecoded* examples and decodes only every `num_workers`-th one, so all workers decode and none duplicates.
    A worker exits as soon as its parent process is gone, also in the middle of network retries (`exit_with_parent`).

    Random augmentation is seeded per sample from `(seed, epoch, rank, stream, index)`, where `index` counts the
    examples of the rank's stream (of the worker's stream when workers own whole shards, then `stream` is the worker
    id + 1), inside `torch.random.fork_rng`: the tensors depend only on those keys, not on the process's RNG, which
    they leave untouched. Replaying an epoch therefore reproduces it bit for bit, which is what exact resume needs
    (rebuild the stream, skip what was consumed), as long as `num_workers` is unchanged.

    Resuming mid-epoch: `set_skip` makes each worker pass over its first samples without decoding or augmenting
    them; `resume_plan` computes the counts from the batches each worker had delivered. A sample's index, hence its
    augmentation, does not change. Parquet shards are not read again for what was consumed: the epoch is replayed on
    a twin of row positions and only the row groups still needed are read (`veca_hf.data.resume`); other formats
    read the consumed samples' bytes again and pass them through the shuffle buffer undecoded.

    NOTE: do not pass a DataLoader over this stream to `accelerator.prepare` in multi-process runs: with batch
    dispatching off, Accelerate wraps any iterable dataset in `IterableDatasetShard`, which keeps only 1/world_size
    of each rank's (already disjoint) part. Move the batches to `accelerator.device` instead. Ranks may also get a
    different number of batches per epoch (shards differ in size): stop the epoch when any rank runs out.

    Args:
        dataset (`datasets.IterableDataset`):
            The streamed dataset, e.g. from `load_image_dataset`.
        image_column (`str`):
            The image column (see `detect_image_column`); the other columns are dropped.
        transform (`Callable`):
            Maps an RGB PIL image to a tensor, e.g. `build_transform(resolution, train=True)`.
        seed (`int`):
            Seeds the shuffle and the augmentation; the same on every rank.
        shuffle_buffer_size (`int`, *optional*, defaults to 1000):
            Size of the `datasets` shuffle buffer (also shuffles the shard order each epoch); 0 keeps the stored
            order (for evaluation).
        rank (`int`, *optional*, defaults to 0):
            This process's rank.
        world_size (`int`, *optional*, defaults to 1):
            The number of processes.
        min_image_size (`int`, *optional*, defaults to 32):
            Images with a shorter side below this are skipped as `"too_small"`.
        max_image_pixels (`int`, *optional*, defaults to 64,000,000):
            Images with more pixels (width x height, read from the header) are skipped as `"too_large"` before
            they are decoded; `None` for no limit (see `decode_image`).
        image_root (`str` or `os.PathLike`, *optional*):
            Where images given as paths may be read: the image folder being streamed, or its URL prefix, as
            `veca_hf.data.dataset_root(dataset_name)` gives it. Without it (the right choice for parquet and
            webdataset shards, whose rows carry bytes), path-only images are skipped as `"path_not_allowed"`.

    Yields:
        `dict`: `{"pixel_values": tensor, "source": str, "worker": int}` with the transform's output (e.g.
        `(3, r, r)`), the example's file path (or a stream position when it has none) and the DataLoader worker id
        (0 without workers), or `{"pixel_values": None, "skipped": reason, "source": str, "worker": int}` for an
        unusable image (`"undecodable"`, `"too_small"`, `"too_large"` or `"path_not_allowed"`), so that the count
        survives worker processes. Batch with `collate_images`.
    """

    def __init__(
        self,
        dataset: datasets.IterableDataset,
        image_column: str,
        transform,
        *,
        seed: int,
        shuffle_buffer_size: int = 1000,
        rank: int = 0,
        world_size: int = 1,
        min_image_size: int = 32,
        max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
        image_root: str | os.PathLike | None = None,
    ):
        if not isinstance(dataset, datasets.IterableDataset):
            raise ValueError(f"`dataset` must be a streamed `datasets.IterableDataset`, got {type(dataset).__name__}.")
        if seed < 0:
            raise ValueError(f"`seed` must be >= 0, got {seed}.")
        if shuffle_buffer_size < 0:
            raise ValueError(f"`shuffle_buffer_size` must be >= 0, got {shuffle_buffer_size}.")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Need 0 <= rank < world_size, got rank={rank}, world_size={world_size}.")
        if min_image_size < 0:
            raise ValueError(f"`min_image_size` must be >= 0, got {min_image_size}.")
        check_max_pixels(max_image_pixels, "max_image_pixels")
        detect_image_column(dataset, image_column)  # raises with the available columns if absent

        dataset = dataset.select_columns([image_column])
        if dataset.features is not None and isinstance(dataset.features[image_column], datasets.Image):
            dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
        self.dataset = dataset
        self.image_column = image_column
        self.transform = transform
        self.seed = seed
        self.shuffle_buffer_size = shuffle_buffer_size
        self.rank = rank
        self.world_size = world_size
        self.min_image_size = min_image_size
        self.max_image_pixels = max_image_pixels
        self.image_root = None if image_root is None else os.fspath(image_root)
        # NOTE: in shared memory (as `datasets` does), so persistent DataLoader workers see `set_epoch` too.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self.skip_samples: tuple[int, ...] | None = None
        self._resume: ParquetResume | None = None  # built by the first `set_skip` that skips anything
        self._twin: datasets.IterableDataset | None = None

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch that the next iteration streams (its shuffle order and augmentation draws)."""
        if epoch < 0:
            raise ValueError(f"`epoch` must be >= 0, got {epoch}.")
        self._epoch.fill_(epoch)

    def set_skip(self, samples_per_worker: Sequence[int] | None) -> None:
        """
        Skip, before decoding, the first samples of each DataLoader worker's share in the next iterations.

        Set it before creating the DataLoader iterator (workers get a copy then), and reset it with `None` for the
        next epoch.

        Args:
            samples_per_worker (`Sequence[int]` or `None`):
                One count per DataLoader worker (one entry without workers): how many of that worker's samples to
                pass over, e.g. from `resume_plan`. `None` skips nothing.
        """
        if samples_per_worker is not None:
            samples_per_worker = tuple(int(count) for count in samples_per_worker)
            if not samples_per_worker or min(samples_per_worker) < 0:
                raise ValueError(
                    f"`samples_per_worker` must be non-negative counts, one per worker, got {samples_per_worker}."
                )
        self.skip_samples = samples_per_worker
        if samples_per_worker is not None and max(samples_per_worker) > 0 and self._resume is None:
            self._build_resume()

    def _build_resume(self) -> None:
        """The position twin of parquet shards, so that the resumed epoch reads only the row groups it needs."""
        source = parquet_files_of(self.dataset)
        if source is None:
            return
        files, storage_options, operations = source
        feature = self.dataset.features[self.image_column]
        resume = ParquetResume(files, storage_options, self.image_column, feature, operations)
        try:
            self._twin = resume.build()
        except Exception as error:  # NOTE: never worse than before: the stream reads the consumed part again
            logger.warning(
                redact_urls(
                    f"Could not read the row groups of the {len(files)} parquet shard(s) ({type(error).__name__}: "
                    f"{error}); the resumed epoch reads its consumed samples again instead."
                )
            )
            return
        self._resume = resume
        logger.info(f"Resuming on the row positions of {len(files)} parquet shard(s): skips consumed row groups.")

    def _rank_dataset(self, epoch: int, dataset: datasets.IterableDataset | None = None) -> datasets.IterableDataset:
        """This rank's part of the epoch (of `dataset`, default the stream's): shuffled with the shared seed, then
        split by node."""
        dataset = self.dataset if dataset is None else dataset
        if self.shuffle_buffer_size > 0:
            dataset = dataset.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer_size)
            # NOTE: only on the shuffled copy: `set_epoch(e > 0)` alone would also reorder the shards.
            dataset.set_epoch(epoch)
        if self.world_size > 1:
            dataset = split_dataset_by_node(dataset, rank=self.rank, world_size=self.world_size)
        return dataset

    def _indexed_values(
        self, dataset: datasets.IterableDataset, num_workers: int, worker_id: int, skip: int, column: str
    ):
        """Yield `(stream, index, value)` of `column` for the examples this process (or DataLoader worker) must
        decode, passing over its first `skip` samples undecoded."""
        if num_workers > 1 and dataset.num_shards >= num_workers:
            # Inside a worker, iterating a `datasets.IterableDataset` gives this worker whole shards.
            for index, example in enumerate(dataset):
                if index >= skip:
                    yield worker_id + 1, index, example[column]
            return
        # NOTE: `.iter()` does not split by worker (plain iteration would leave all but one worker idle on a
        # single-shard stream): every worker walks the same undecoded stream and keeps its own round-robin share.
        for index, batch in enumerate(dataset.iter(batch_size=1)):
            if index % num_workers == worker_id and index // num_workers >= skip:
                yield 0, index, batch[column][0]

    def _values(self, epoch: int, num_workers: int, worker_id: int, skip: int):
        """`_indexed_values` of the image column from this worker's `skip`-th sample; on the position twin of
        parquet shards when one is built and something is skipped (see the class docstring)."""
        if self._resume is None or skip == 0:
            return self._indexed_values(self._rank_dataset(epoch), num_workers, worker_id, skip, self.image_column)

        def positions():
            twin = self._rank_dataset(epoch, self._twin)
            return self._indexed_values(twin, num_workers, worker_id, 0, POSITION_COLUMN)

        return self._resume.values(positions(), positions(), skip)

    def _transform(self, image: PIL.Image.Image, seed: int) -> torch.Tensor:
        """The transform, drawing from a generator seeded for this sample; the global CPU RNG is restored."""
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # NOTE: not torch.manual_seed, which also seeds CUDA
            return self.transform(image)

    def __iter__(self):
        exit_with_parent()
        redact_datasets_logs()  # NOTE: again in a worker: a spawned one does not inherit the parent's filters
        epoch = self.epoch
        worker = torch.utils.data.get_worker_info()
        num_workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        if self.skip_samples is not None and len(self.skip_samples) != num_workers:
            raise ValueError(
                f"set_skip got {len(self.skip_samples)} counts {self.skip_samples} but the stream runs with "
                f"{num_workers} DataLoader worker(s): resume with the number of workers the checkpoint was written "
                "with."
            )
        next_skip = self.skip_samples[worker_id] if self.skip_samples is not None else 0
        values = self._values(epoch, num_workers, worker_id, next_skip)
        retries = StreamRetries.configured()
        failures = 0  # network faults in a row; `next_skip`: where to reopen the stream after one
        warned_paths = self.image_root is not None
        while True:
            try:
                stream, index, value = next(values)
                failures = 0
            except StopIteration:
                return
            except Exception as error:  # NOTE: a shard that breaks mid-read; images never raise (decode_image)
                failures += 1
                where = remote_url_in_error(error) or "the data stream"  # redacted with the messages below
                if retries.is_retried(error, failures):
                    # NOTE: `datasets` retries failed reads of an open shard, not failures to open the next one:
                    # reopen the (deterministic) stream and pass over what this worker already read, undecoded.
                    how = f"reopening the stream of rank {self.rank}, worker {worker_id} where it was"
                    retries.back_off(f"Reading {where}", error, failures, how)
                    values = self._values(epoch, num_workers, worker_id, next_skip)
                    continue
                if is_transient_network_error(error):
                    raise RuntimeError(
                        redact_urls(
                            f"Reading {where} failed for good (rank {self.rank}, epoch {epoch}, DataLoader worker "
                            f"{worker_id}) after {retries.retries} attempts (--stream_retries), with "
                            f"{type(error).__name__}: {error}. The server or the network is down: once it is back, "
                            "resume with --resume_from_checkpoint latest (the run continues exactly from its last "
                            "complete checkpoint)."
                        )
                    ) from safe_cause(error)
                raise RuntimeError(
                    redact_urls(
                        f"Reading the data stream failed (rank {self.rank}, epoch {epoch}, DataLoader worker "
                        f"{worker_id}) with {type(error).__name__}: {error}. A shard is probably truncated or corrupt "
                        "(the error above may name it; for local shards `veca_hf.data.find_broken_shards` finds "
                        "cut-short ones): remove or repair it, then resume with --resume_from_checkpoint latest."
                    )
                ) from safe_cause(error)
            next_skip = index + 1 if stream > 0 else index // num_workers + 1
            # Where the example came from (its file when known, a URL without its credentials), for auditing the data
            # order of a run.
            path = value.get("path") if isinstance(value, dict) else value if isinstance(value, str) else None
            source = redact_urls(path) if path else f"rank{self.rank}/stream{stream}/{index}"
            image, reason = decode_image(
                value, min_size=self.min_image_size, max_pixels=self.max_image_pixels, root=self.image_root
            )
            if reason == SKIP_PATH_NOT_ALLOWED and not warned_paths:
                warned_paths = True
                logger.warning(
                    f"Skipping images given as paths ({source}, ...): ImageStream reads a path only inside "
                    "`image_root`, and none was given. For an image folder, pass "
                    "image_root=veca_hf.data.dataset_root(dataset_name)."
                )
            if image is None:
                yield {"pixel_values": None, "skipped": reason, "source": source, "worker": worker_id}
                continue
            pixel_values = self._transform(image, _sample_seed(self.seed, epoch, self.rank, stream, index))
            yield {"pixel_values": pixel_values, "source": source, "worker": worker_id}  # (3, r, r)


def resume_plan(worker_batches: Sequence[int], last_worker: int, batch_size: int) -> tuple[list[int], int]:
    """
    How to restart a DataLoader over an `ImageStream` mid-epoch so that it yields the batch an interrupted one
    would have yielded next, skipping the consumed samples before decoding.

    A DataLoader over an iterable dataset takes batches from its workers in turn (0, 1, ..., W-1, 0, ...; a worker
    that runs out drops out of the cycle), and worker `w`'s `k`-th batch holds its samples `k*B .. (k+1)*B - 1`.
    A fresh DataLoader starts its cycle at worker 0, but the interrupted one would continue after `last_worker`:
    so workers `0..last_worker` replay their last delivered batch, which the caller discards (at most W-1 batches
    are decoded again), and every other consumed batch is skipped undecoded.

    Args:
        worker_batches (`Sequence[int]`):
            The number of batches each worker had delivered in this epoch (one entry without workers).
        last_worker (`int`):
            The worker of the last delivered batch.
        batch_size (`int`):
            The DataLoader's batch size.

    Returns:
        `tuple`: `(samples_per_worker, discard)`: the counts for `ImageStream.set_skip`, and how many batches the new
        DataLoader yields first that were already consumed (discard them).
    """
    num_workers = len(worker_batches)
    if not 0 <= last_worker < num_workers:
        raise ValueError(f"`last_worker`={last_worker} is not one of the {num_workers} worker(s).")
    wraps = last_worker == num_workers - 1  # the interrupted cycle was complete: the next batch is worker 0's
    replayed = [int(not wraps and worker <= last_worker and count > 0) for worker, count in enumerate(worker_batches)]
    return [(count - replay) * batch_size for count, replay in zip(worker_batches, replayed, strict=False)], sum(
        replayed
    )


def infinite_batches(stream: ImageStream, loader_kwargs: dict, seed: int, position: dict, empty_message: str):
    """
    Batches of `stream` forever, epoch after epoch, from `position` on (a resume skips the consumed samples before
    decoding, [`resume_plan`]; the stream is deterministic, so the next batch is the one the interrupted run would
    have drawn).

    `loader_kwargs` are `DataLoader` arguments (`batch_size`, `num_workers` required); each epoch's loader is seeded
    with `seed + epoch`. `position` holds `epoch`, `batches` consumed in it and, from a checkpoint, `worker_batches`
    and `last_worker`; it is updated in place (save it with the checkpoint). A fresh epoch with no batch raises a
    `ValueError` with `empty_message`; one with no decodable image, or a checkpoint written with another number of
    workers, raises one too.
    """
    num_workers, batch_size = max(1, loader_kwargs["num_workers"]), loader_kwargs["batch_size"]
    epoch, consumed = position["epoch"], position["batches"]
    if consumed and "worker_batches" in position:
        if len(position["worker_batches"]) != num_workers:
            raise ValueError(
                f"The checkpoint was written with {len(position['worker_batches'])} DataLoader worker(s) per process "
                f"and this run has --dataloader_num_workers {loader_kwargs['num_workers']}: resume with the same "
                "number of workers."
            )
        skip, discard = resume_plan(position["worker_batches"], position["last_worker"], batch_size)
    else:  # a fresh epoch, or a checkpoint without per-worker positions: decode and discard the consumed batches
        skip, discard = None, consumed
    while True:
        stream.set_epoch(epoch)
        stream.set_skip(skip)
        worker_batches = [count // batch_size for count in skip] if skip else [0] * num_workers
        # A DataLoader without a generator would draw its workers' seeds from the global RNG.
        loader = torch.utils.data.DataLoader(
            stream, generator=torch.Generator().manual_seed(seed + epoch), **loader_kwargs
        )
        position.update(epoch=epoch, batches=consumed, worker_batches=worker_batches, last_worker=num_workers - 1)
        batches, usable = 0, 0
        iterator = iter(loader)
        try:
            for index, batch in enumerate(iterator):
                worker_batches[batch["worker"]] += 1
                position["last_worker"] = batch["worker"]
                if index < discard:
                    continue
                position["batches"] += 1
                batches += 1
                usable += 0 if batch["pixel_values"] is None else len(batch["pixel_values"])
                yield batch
        finally:
            # NOTE: stop the workers now, also when the stream raised: they ignore SIGTERM, and an iterator kept
            # alive by the traceback would leave them to multiprocessing's exit hook, which waits for them forever.
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        if consumed == 0 and batches == 0:
            raise ValueError(empty_message)
        if consumed == 0 and usable == 0:  # the caller would wait forever for a usable batch
            raise ValueError(
                "The training stream has no decodable images in this process's share of the data "
                f"({batches} batch(es), every image skipped: undecodable, smaller than --min_image_size, larger than "
                "--max_image_pixels, or a path outside the dataset's folder)."
            )
        epoch, consumed, skip, discard = epoch + 1, 0, None, 0
