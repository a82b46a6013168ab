# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Finding the data: local image folders, parquet and webdataset shards, globs, Hub datasets and remote shards
(`https://`, `s3://`, `gs://`, `hf://`, any fsspec filesystem), opened as streamed `datasets` datasets; broken
shards; the image column. Retries over the network follow `retry`.

NOTE: a URL may carry credentials (`https://user:password@host/...`, a signed URL's `?X-Amz-Signature=...`): the
real URL is what is read, but every log line and error message of `veca_hf.data` that names one passes it through
`veca_hf.arguments.redact_urls`.
"""

import glob
import inspect
import json
import logging as python_logging
import os
import re
import tarfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import datasets
from datasets.data_files import DataFilesDict, DataFilesList, _get_single_origin_metadata, get_data_patterns
from datasets.download import DownloadConfig
from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder
from datasets.utils.file_utils import _prepare_path_and_storage_options
from huggingface_hub import HfFileSystem
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.utils import logging

from ..arguments import redact_urls
from .retry import StreamRetries


logger = logging.get_logger(__name__)

IMAGE_COLUMN_NAMES = ("image", "img", "jpg", "jpeg", "png", "webp")

_IMAGE_EXTENSIONS = frozenset(extension.lower() for extension in ImageFolder.EXTENSIONS)
_GLOB_CHARACTERS = ("*", "?", "[")
_SHARD_EXTENSIONS = {"parquet": ".parquet", "webdataset": ".tar"}


# ----------------------------------------------------------------------------------------------------------------
# Remote shards
# ----------------------------------------------------------------------------------------------------------------

# The fsspec backends a protocol needs, and the extra that installs them.
_BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
_BRACE_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_BRACE_LIST = re.compile(r"\{([^{}]*,[^{}]*)\}")


def is_remote(path: str) -> bool:
    """Whether `path` is a URL of a remote filesystem (`https://...`, `s3://...`, `hf://...`), not a local path."""
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path)) and not path.startswith("file://")


def expand_braces(pattern: str) -> list[str]:
    """
    Webdataset-style brace expansion: `shard-{00000..00003}.tar` -> 4 names (zero padding kept from the first bound),
    `{train,val}-0.tar` -> 2 names; several braces expand as a product, in order.
    """
    matches = [m for m in (_BRACE_RANGE.search(pattern), _BRACE_LIST.search(pattern)) if m is not None]
    if not matches:
        return [pattern]
    match = min(matches, key=lambda m: m.start())  # the first brace; the rest expand recursively
    head, tail = pattern[: match.start()], pattern[match.end() :]
    if match.re is _BRACE_RANGE:
        first, last = match.group(1), match.group(2)
        if int(last) < int(first):
            raise ValueError(f"The brace range {match.group(0)!r} in {pattern!r} counts down: write {{low..high}}.")
        width = len(first) if first.startswith("0") else 0
        items = [str(number).zfill(width) for number in range(int(first), int(last) + 1)]
    else:
        items = match.group(1).split(",")
    return [head + item + rest for item in items for rest in expand_braces(tail)]


def split_sources(dataset_name: str) -> list[str]:
    """Several sources in one `--dataset_name`: a JSON list, or URLs separated by whitespace or commas."""
    text = dataset_name.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except ValueError:
            raise ValueError(f"--dataset_name {dataset_name!r} starts like a JSON list but does not parse.") from None
        return [str(value) for value in values]
    return [part for part in re.split(r"[\s,]+(?=[a-zA-Z][a-zA-Z0-9+.-]*://)", text) if part]


def _filesystem(url: str, storage_options: dict | None):
    """The fsspec filesystem of `url`, or an ImportError naming the package and the extra to install."""
    import fsspec

    protocol = url.split("://", 1)[0].lower()
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as error:
        package = _BACKENDS.get(protocol, f"the fsspec backend of {protocol}://")
        raise ImportError(
            f"Reading {protocol}:// URLs needs {package}: pip install 'veca_hf[remote]' (s3fs, gcsfs), or "
            f"pip install {package}."
        ) from error


def resolve_remote_files(dataset_name: str, storage_options: dict | None = None) -> list[str]:
    """
    The remote shard URLs `dataset_name` stands for, in order: brace ranges and lists expanded, several URLs split,
    and globs (`*`, `?`, `[`) listed on filesystems that can list (S3, GCS, `hf://`, local `file://`; plain HTTP
    cannot: give brace ranges or lists there; a `?` there starts the query string, e.g. a signed URL's signature).
    """
    files = []
    for source in split_sources(dataset_name):
        for url in expand_braces(source):
            path = url.split("://", 1)[1]
            if url.startswith(("http://", "https://")):
                path = path.split("?", 1)[0]
            if any(character in path for character in _GLOB_CHARACTERS):
                filesystem, path = _filesystem(url, storage_options)
                if url.startswith(("http://", "https://")):
                    raise ValueError(f"{redact_urls(repr(url))}: HTTP servers cannot be listed; name the shards "
                                     "with a brace range such as https://host/shard-{00000..00127}.tar, or a list of "
                                     "URLs.")  # fmt: skip
                matches = sorted(filesystem.glob(path))
                if not matches:
                    raise ValueError(redact_urls(f"No files match {url!r}."))
                files += [filesystem.unstrip_protocol(match) for match in matches]
            else:
                files.append(url)
    return files


def parse_storage_options(text: str | dict | None) -> dict | None:
    """`--storage_options` as a dict: JSON text (or a dict already), or None."""
    if text is None or isinstance(text, dict):
        return text
    try:
        options = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--storage_options is not valid JSON ({error}); give an object such as "
                         '\'{"anon": true}\'.') from None  # fmt: skip
    if not isinstance(options, dict):
        raise ValueError(f"--storage_options must be a JSON object, got {type(options).__name__}.")
    return options


def http_timeout_options(files: Sequence[str], storage_options: dict | None, timeout: float | None) -> dict | None:
    """`storage_options` with a read and connect timeout for HTTP(S) shards (aiohttp's default waits five minutes
    for a stalled response); a timeout the options already set wins."""
    if not timeout or not any(file.startswith(("http://", "https://")) for file in files):
        return storage_options
    import aiohttp

    options = dict(storage_options or {})
    client_kwargs = dict(options.get("client_kwargs") or {})
    client_kwargs.setdefault("timeout", aiohttp.ClientTimeout(sock_connect=timeout, sock_read=timeout))
    options["client_kwargs"] = client_kwargs
    return options


def _origin_metadata(file: str, download_config: DownloadConfig) -> tuple:
    """What `datasets` records of a data file to tell its versions apart (its ETag or mtime, the Hub revision), as
    `datasets.data_files._get_single_origin_metadata` reads it; FileNotFoundError if there is no such file."""
    import fsspec

    url, options = _prepare_path_and_storage_options(file, download_config=download_config)
    filesystem, path = fsspec.core.url_to_fs(url, **options)
    info = filesystem.info(path)  # HTTP: HEAD, then GET; a 404 is a FileNotFoundError whose cause says so
    if info.get("type") != "file":
        raise FileNotFoundError(redact_urls(f"{file} is a {info.get('type')}, not a file."))
    if isinstance(filesystem, HfFileSystem):  # the revision (the file's info is cached: no second request)
        return _get_single_origin_metadata(file, download_config=download_config)
    return next(((str(info[key]),) for key in ("ETag", "etag", "mtime") if key in info), ())


def resolve_data_files(
    files: Sequence[str], storage_options: dict | None = None, retries: StreamRetries | None = None
) -> DataFilesList:
    """
    Remote data files resolved as `datasets.load_dataset` resolves them (each must exist; its ETag, mtime or Hub
    revision is recorded), each file with the retries of a read.

    `datasets` finds every data file before streaming and gives up at the first 5xx answer, timeout or dropped
    connection, as a `FileNotFoundError` that hides it; a `DataFilesList` passed as `data_files={split: ...}` is not
    resolved again. Files are resolved in parallel, as `datasets` does.

    Args:
        files (`Sequence[str]`): URLs (`resolve_remote_files`).
        storage_options (`dict`, *optional*): their fsspec options, as `datasets.load_dataset` takes them.
        retries (`StreamRetries`, *optional*): attempts and wait (default: 20 attempts, 5 s apart).

    Returns:
        `datasets.data_files.DataFilesList`: the files, in order, with their origin metadata.

    Raises:
        `ValueError`: naming the files that do not exist (a 404 is not retried).
        `ConnectionError`: if a file cannot be reached in `retries.retries` attempts.
    """
    retries = retries or StreamRetries()
    download_config = DownloadConfig()
    download_config.storage_options.update(storage_options or {})

    def resolve(file: str) -> tuple | FileNotFoundError:
        try:
            return retries.call(lambda: _origin_metadata(file, download_config), file, not_found_attempts=1)
        except FileNotFoundError as error:  # not a passing fault: reported with the others below
            return error

    workers = max(1, min(len(files), datasets.config.HF_DATASETS_MULTITHREADING_MAX_WORKERS))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(resolve, files))
    missing = [file for file, result in zip(files, results, strict=True) if isinstance(result, FileNotFoundError)]
    if missing:
        listing = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            redact_urls(
                f"{len(missing)} of the {len(files)} remote data file(s) do not exist: {listing}. Check "
                "--dataset_name: the host, the path and the brace range (shard-{00000..00127} names every shard "
                "from the first to the last, zero-padded as written)."
            )
        )
    return DataFilesList(list(files), list(results))


class _RedactingFilter(python_logging.Filter):
    """Passes a record's URLs through `redact_urls` (on a logger, before any handler sees it)."""

    def filter(self, record: python_logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_urls(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


# `datasets`' modules that log the names of the files they stream (a failed read, a bad parquet schema).
_DATASETS_LOGGERS = (
    "datasets.builder",
    "datasets.iterable_dataset",
    "datasets.packaged_modules.folder_based_builder.folder_based_builder",
    "datasets.packaged_modules.parquet.parquet",
    "datasets.packaged_modules.webdataset.webdataset",
)


def redact_datasets_logs() -> None:
    """Redact the URLs that `datasets` logs while streaming (its retries also get the URL, `_RetryUrlFilter`)."""
    for name in ("datasets.utils.file_utils", *_DATASETS_LOGGERS):
        named = python_logging.getLogger(name)
        kind = _RetryUrlFilter if name == "datasets.utils.file_utils" else _RedactingFilter
        if not any(isinstance(f, kind) for f in named.filters):
            named.addFilter(kind())


class _RetryUrlFilter(_RedactingFilter):
    """Adds the URL to `datasets`' "Got disconnected from remote data host. Retrying ..." warnings.

    NOTE: the message is logged inside `datasets`' retry loop, whose frame holds the bound `read` of the open file
    (or the URL being opened): the URL is read from there."""

    def filter(self, record: python_logging.LogRecord) -> bool:
        if "Retrying" in str(record.msg):
            url = self._url()
            if url:
                record.msg = f"{record.msg} ({url})"
                record.args = ()
        return _RedactingFilter.filter(self, record)

    @staticmethod
    def _url() -> str | None:
        frame = inspect.currentframe()
        while frame is not None:
            local = frame.f_locals
            read = local.get("read")
            owner = getattr(read, "__self__", None)
            for candidate in (getattr(owner, "url", None), getattr(owner, "full_name", None), local.get("file")):
                if isinstance(candidate, str) and is_remote(candidate):
                    return candidate
            frame = frame.f_back
        return None


def check_shard_count(dataset, world_size: int, num_workers: int) -> None:
    """Warn when a sharded dataset has fewer shards than processes x DataLoader workers: the extra ones get nothing
    to read (parquet and tar shards are split file by file)."""
    num_shards = getattr(dataset, "num_shards", None) or getattr(dataset, "n_shards", None)
    readers = world_size * max(1, num_workers)
    if num_shards and 1 < num_shards < readers:
        logger.warning(
            f"The dataset has {num_shards} shards for {world_size} process(es) x {max(1, num_workers)} DataLoader "
            f"worker(s) = {readers} readers: {readers - num_shards} of them will have no shard to read. Write at "
            "least as many shards as readers, or lower --dataloader_num_workers."
        )


def _builder_for_files(files: list[str], source: str) -> str:
    """The packaged `datasets` builder for a list of files: parquet, then webdataset tars, then images."""
    # NOTE: a URL's query string (a signed URL's signature) is not part of its extension.
    extensions = {os.path.splitext(file.split("?")[0] if is_remote(file) else file)[1].lower() for file in files}
    if ".parquet" in extensions:
        return "parquet"
    if ".tar" in extensions:
        return "webdataset"
    if extensions & _IMAGE_EXTENSIONS:
        return "imagefolder"
    raise ValueError(
        redact_urls(
            f"{source!r} holds no image, parquet or webdataset (.tar) files (found extensions: {sorted(extensions)})."
        )
    )


def _check_tar(file: str) -> None:
    """Raise if a tar file is cut short: a member's data past the end of the file, or no end-of-archive blocks."""
    size = os.path.getsize(file)
    end = 0
    with tarfile.open(file, mode="r:") as tar:
        for member in tar:
            end = member.offset_data + member.size
            if end > size:
                raise tarfile.ReadError(
                    f"member {member.name!r} is cut off ({size - member.offset_data} of {member.size} bytes)"
                )
    if size < end + 2 * tarfile.BLOCKSIZE:  # a complete archive ends with two zero blocks
        raise tarfile.ReadError("no end-of-archive marker (the file is cut short)")


def find_broken_shards(files: Sequence[str]) -> dict[str, str]:
    """
    Local parquet and webdataset tar shards that cannot be read to the end, without reading their data.

    A parquet shard must have its footer (`pyarrow.parquet.read_metadata`); a tar shard must hold every member's
    bytes and end with the end-of-archive blocks. Other files are not checked. Truncation (a copy or download cut
    short, a disk failure) is caught; corrupt bytes inside a shard are not (they fail later, see `ImageStream`).

    Args:
        files (`Sequence[str]`): local file paths.

    Returns:
        `dict[str, str]`: each broken file and why.
    """
    import pyarrow.parquet

    broken = {}
    for file in files:
        extension = os.path.splitext(file)[1].lower()
        try:
            if extension == ".parquet":
                pyarrow.parquet.read_metadata(file)
            elif extension == ".tar":
                _check_tar(file)
        except Exception as error:  # NOTE: pyarrow and tarfile raise several types for a damaged file
            broken[file] = f"{type(error).__name__}: {error}"
    return broken


def _broken_shards_to_skip(files: list[str], builder: str, source: str, broken_shards: str) -> set[str]:
    """The broken shards among `files` (skipped with a warning naming them), or a ValueError with `"error"`."""
    if builder not in _SHARD_EXTENSIONS:
        return set()
    broken = find_broken_shards([f for f in files if f.lower().endswith(_SHARD_EXTENSIONS[builder])])
    if not broken:
        return set()
    listing = "; ".join(f"{file} ({why})" for file, why in broken.items())
    if broken_shards == "error":
        raise ValueError(
            f"{len(broken)} shard(s) of {source!r} cannot be read: {listing}. Repair or remove them, or skip them "
            "with --broken_shards skip."
        )
    logger.warning(f"Skipping {len(broken)} broken shard(s) of {source!r} (--broken_shards skip): {listing}.")
    return set(broken)


def _looks_like_hub_id(name: str) -> bool:
    """`namespace/name` or `name` as the Hub spells dataset ids (local-looking paths are never Hub ids)."""
    if name.startswith((".", "/", "~")) or "\\" in name:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def load_image_dataset(
    dataset_name: str,
    dataset_config_name: str | None = None,
    split: str = "train",
    streaming: bool = True,
    broken_shards: str = "skip",
    storage_options: dict | None = None,
    retries: StreamRetries | None = None,
    timeout: float | None = 60.0,
) -> datasets.IterableDataset:
    """
    Open an image dataset, streamed by default, from a local folder, local shards, remote shards or the Hub.

    What `dataset_name` may be, and the `datasets` builder used for it:

    - a local directory: scanned recursively; if it holds parquet files the `"parquet"` builder is used, else if it
      holds `.tar` files the `"webdataset"` builder, else if it holds images the `"imagefolder"` builder. All three
      get `data_dir=dataset_name`, so the usual `datasets` split inference applies (files or folders named
      `train`/`validation`/`test` form those splits; anything else is `train`).
    - a glob (`"shards/*.parquet"`, `"tars/*.tar"`, `"images/**/*.jpg"`) or a single local file: the matching files,
      sorted, become the split `split` (`data_files={split: files}`), with the builder chosen as above.
    - remote shards (parquet, webdataset tars or images) by URL: `https://host/shard-{00000..00127}.tar` (brace
      ranges and lists, as webdataset writes them), several URLs (a JSON list, or separated by spaces or commas),
      or a glob on a filesystem that can list (`s3://bucket/prefix/*.parquet`, `gs://...`,
      `hf://datasets/org/name/data/*.tar`); `storage_options` go to fsspec (endpoint, credentials, anonymous
      access). S3 and GCS need `pip install veca_hf[remote]`.
    - anything else that is a valid Hub dataset id: `datasets.load_dataset(dataset_name, dataset_config_name,
      split=split, streaming=streaming)`.

    NOTE: a streamed image folder is a single shard whatever its file count, so several ranks split it example by
    example; parquet and tar shards are split file by file, so write at least as many shards as ranks x workers.
    Webdataset columns are named after the file extensions inside the tars (`"jpg"`, `"png"`, `"cls"`, plus
    `"__key__"` and `"__url__"`).

    Args:
        dataset_name (`str`):
            A local directory, glob or file, or a Hub dataset id.
        dataset_config_name (`str`, *optional*):
            The Hub dataset configuration; ignored (with a warning) for local data.
        split (`str`, *optional*, defaults to `"train"`):
            The split to load.
        streaming (`bool`, *optional*, defaults to `True`):
            Stream the data (a `datasets.IterableDataset`). `False` returns a map-style `datasets.Dataset`.
        storage_options (`dict`, *optional*):
            fsspec options of remote shards, e.g. `{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}`.
        retries (`StreamRetries`, *optional*):
            Retries for finding and opening remote shards (default: 20 attempts, 5 s apart).
        timeout (`float`, *optional*, defaults to 60):
            Seconds before a stalled HTTP(S) connection or read counts as failed (and is retried).
        broken_shards (`str`, *optional*, defaults to `"skip"`):
            What to do with local parquet or tar shards that are cut short (`find_broken_shards`): `"skip"` them
            with a warning naming each, or `"error"`: raise a `ValueError` naming them. Hub datasets are not checked.

    Returns:
        `datasets.IterableDataset` (or `datasets.Dataset` when `streaming=False`).

    Raises:
        `ValueError`: if `dataset_name` is neither an existing local path nor a valid Hub id, if the local
        folder or glob holds no usable files, if a remote file does not exist, or if a shard is broken and
        `broken_shards="error"`.
        `ConnectionError`: if the remote files cannot be reached in `retries.retries` attempts.
    """
    if broken_shards not in ("skip", "error"):
        raise ValueError(f"--broken_shards {broken_shards!r} is not one of 'skip', 'error'.")
    if not dataset_name:
        raise ValueError("`dataset_name` is empty: pass a local folder, glob or file, or a Hub dataset id.")
    if is_remote(dataset_name) or (dataset_name.lstrip().startswith("[") and "://" in dataset_name):
        retries = retries or StreamRetries()
        redact_datasets_logs()
        files = retries.call(lambda: resolve_remote_files(dataset_name, storage_options), repr(dataset_name))
        builder = _builder_for_files(files, dataset_name)
        options = http_timeout_options(files, storage_options, timeout)
        data_files = resolve_data_files(files, options, retries)
        logger.info(
            redact_urls(
                f"Streaming {len(files)} remote file(s) of {dataset_name!r} with the {builder!r} builder as {split!r}."
            )
        )
        return retries.call(
            lambda: datasets.load_dataset(
                builder, data_files={split: data_files}, split=split, streaming=streaming, storage_options=options
            ),
            f"{len(files)} remote file(s) of {dataset_name!r}",
        )
    path = os.path.expanduser(dataset_name)
    is_glob = any(character in path for character in _GLOB_CHARACTERS)
    is_local = is_glob or os.path.exists(path)
    if is_local and dataset_config_name is not None:
        logger.warning(f"`dataset_config_name={dataset_config_name!r}` is ignored for local data {dataset_name!r}.")

    if os.path.isdir(path):
        files = [file for file in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(file)]
        if not files:
            raise ValueError(f"The folder {dataset_name!r} is empty.")
        builder = _builder_for_files(files, dataset_name)
        broken = _broken_shards_to_skip(files, builder, dataset_name, broken_shards)
        if broken:  # the same split inference as data_dir, minus the broken shards
            data_files = DataFilesDict.from_patterns(get_data_patterns(path), path)
            extension = _SHARD_EXTENSIONS[builder]
            broken = {os.path.abspath(file) for file in broken}
            data_files = {
                name: [f for f in split_files if f.lower().endswith(extension) and os.path.abspath(f) not in broken]
                for name, split_files in data_files.items()
            }
            if not data_files.get(split):
                raise ValueError(f"Every {extension} shard of split {split!r} in {dataset_name!r} is broken.")
            return datasets.load_dataset(builder, data_files=data_files, split=split, streaming=streaming)
        logger.info(f"Loading {dataset_name!r} with the {builder!r} builder (data_dir), split {split!r}.")
        return datasets.load_dataset(builder, data_dir=path, split=split, streaming=streaming)

    if is_local:
        files = sorted(file for file in glob.glob(path, recursive=True) if os.path.isfile(file))
        if not files:
            raise ValueError(f"No files match {dataset_name!r}.")
        builder = _builder_for_files(files, dataset_name)
        broken = _broken_shards_to_skip(files, builder, dataset_name, broken_shards)
        files = [file for file in files if file not in broken]
        if not files:
            raise ValueError(f"Every shard matching {dataset_name!r} is broken.")
        logger.info(f"Loading {len(files)} files matching {dataset_name!r} with the {builder!r} builder as {split!r}.")
        return datasets.load_dataset(builder, data_files={split: files}, split=split, streaming=streaming)

    if _looks_like_hub_id(dataset_name):
        logger.info(f"Loading the Hub dataset {dataset_name!r} (config {dataset_config_name!r}), split {split!r}.")
        return datasets.load_dataset(dataset_name, dataset_config_name, split=split, streaming=streaming)

    raise ValueError(
        f"{dataset_name!r} does not exist locally and is not a valid Hub dataset id: pass an image folder, a folder "
        "or glob of parquet or webdataset .tar shards, or a Hub dataset id such as 'namespace/name'."
    )


def dataset_root(dataset_name: str) -> str | None:
    """
    Where the files of `dataset_name` live, as `load_image_dataset` finds them: the only place from which an image
    given as a path (what a streamed image folder yields) is read, as `ImageStream(image_root=...)`.

    A local folder is its own root; a local glob or file, the folder before its first glob character; remote files,
    the folder URL they all share (before any brace or glob, without a query string); a Hub id `org/name`, its
    repository at any revision (`hf://datasets/org/name@`, how `datasets` names the files it resolves there).

    Returns:
        `str` or `None`: the root, or `None` when there is none (a path that does not exist, remote files on
        several hosts or buckets): then no path is read.
    """
    if is_remote(dataset_name) or (dataset_name.lstrip().startswith("[") and "://" in dataset_name):
        folders = []
        for source in split_sources(dataset_name):
            if source.startswith(("http://", "https://")):
                source = source.split("?", 1)[0]  # a signed URL's signature, not a glob
            end = min([source.find(c) for c in ("{", *_GLOB_CHARACTERS) if c in source] or [len(source)])
            folders.append(source[: source.rfind("/", 0, end) + 1])
        root = os.path.commonprefix(folders)
        root = root[: root.rfind("/") + 1]
        host, _, path = root.partition("://")[2].partition("/")
        return root if host and _ == "/" else None  # at least `scheme://host/`: never a whole protocol
    path = os.path.expanduser(dataset_name)
    if any(character in path for character in _GLOB_CHARACTERS):
        head = path[: min(path.find(c) for c in _GLOB_CHARACTERS if c in path)]
        return os.path.abspath(os.path.dirname(head) or ".")
    if os.path.isdir(path):
        return os.path.abspath(path)
    if os.path.exists(path):
        return os.path.abspath(os.path.dirname(path) or ".")
    if _looks_like_hub_id(dataset_name):
        return f"hf://datasets/{dataset_name}@"
    return None


def _first_example_columns(dataset) -> list[str]:
    """Column names of a dataset whose features are unknown (some streamed Hub datasets): peek at one example."""
    for example in dataset.take(1) if hasattr(dataset, "take") else dataset:
        return list(example)
    return []


def detect_image_column(dataset, image_column: str | None = None) -> str:
    """
    Find the column of a dataset that holds the images.

    Args:
        dataset (`datasets.IterableDataset` or `datasets.Dataset`):
            The dataset.
        image_column (`str`, *optional*):
            The column asked for (e.g. `--image_column_name`); it is checked and returned as is.

    Returns:
        `str`: `image_column` if given, else the first column whose feature is `datasets.Image`, else the first of
        `"image"`, `"img"`, `"jpg"`, `"jpeg"`, `"png"`, `"webp"` that is present.

    Raises:
        `ValueError`: if `image_column` is absent, or if no column qualifies; the message lists the columns.
    """
    features = dataset.features
    columns = list(features) if features is not None else (dataset.column_names or _first_example_columns(dataset))
    if image_column is not None:
        if image_column not in columns:
            raise ValueError(f"Image column {image_column!r} not found; the dataset has the columns {columns}.")
        return image_column
    if features is not None:
        for name, feature in features.items():
            if isinstance(feature, datasets.Image):
                return name
    for name in IMAGE_COLUMN_NAMES:
        if name in columns:
            return name
    raise ValueError(
        f"Could not find an image column among the dataset's columns {columns}: pass it with `--image_column_name`."
    )
