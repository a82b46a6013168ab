"""Remote shards: URL forms, and distillation over a flaky loopback HTTP server that must train exactly what a clean
one does (dropped connections, 503 answers, a stalled response, a server gone for good, a killed DataLoader worker)."""

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from shard_server import ShardServer
from test_distill_script import (  # noqa: F401 (workspace: the fixture)
    FAULTS_SCRIPT,
    ROOT,
    distill_args,
    run_distill,
    run_env,
    two_cpu_processes,
    workspace,
)

from veca_hf.data import (
    ImageStream,
    StreamRetries,
    build_transform,
    check_shard_count,
    collate_images,
    dataset_root,
    expand_braces,
    load_image_dataset,
    parse_storage_options,
)
from veca_hf.data.resume import _options_for
from veca_hf.data.sources import _filesystem, resolve_remote_files, split_sources


NUM_SHARDS = 8  # of 8 images: a worker opens its later shards well after the first checkpoint


def test_url_forms():
    assert expand_braces("https://h/s-{00008..00011}.tar") == [f"https://h/s-{i:05d}.tar" for i in range(8, 12)]
    assert expand_braces("s3://b/{train,val}-{0..1}.tar") == ["s3://b/train-0.tar", "s3://b/train-1.tar",
                                                               "s3://b/val-0.tar", "s3://b/val-1.tar"]  # fmt: skip
    assert split_sources("https://a/x.tar, https://b/y.tar") == ["https://a/x.tar", "https://b/y.tar"]
    assert split_sources('["https://a/x.tar", "https://b/y.tar"]') == ["https://a/x.tar", "https://b/y.tar"]
    assert resolve_remote_files("https://a/x-{0..1}.tar https://b/y.tar") == [
        "https://a/x-0.tar", "https://a/x-1.tar", "https://b/y.tar"]  # fmt: skip
    with pytest.raises(ValueError, match="counts down"):
        expand_braces("https://h/s-{9..1}.tar")
    with pytest.raises(ValueError, match="HTTP servers cannot be listed"):
        resolve_remote_files("https://h/*.tar")
    with pytest.raises(ValueError, match="--storage_options is not valid JSON"):
        parse_storage_options("{endpoint: x}")
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_storage_options("[1]")
    assert parse_storage_options('{"anon": true}') == {"anon": True}


def test_a_missing_filesystem_backend_names_the_extra(monkeypatch):
    import fsspec

    def missing(url, **options):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", missing)
    with pytest.raises(ImportError, match=r"s3:// URLs needs s3fs: pip install 'veca_hf\[remote\]'"):
        _filesystem("s3://bucket/shards/*.parquet", None)


def test_fewer_shards_than_readers_warns(caplog):
    class Sharded:
        num_shards = 3

    with caplog.at_level(logging.WARNING):
        check_shard_count(Sharded(), world_size=2, num_workers=2)
    assert "3 shards for 2 process(es) x 2 DataLoader worker(s) = 4 readers" in caplog.text


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Parquet shards of 8 small distinct images each, two row groups per shard."""
    folder = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image()})
    for shard in range(NUM_SHARDS):
        images = []
        for _ in range(8):
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(buffer, format="PNG")
            images.append({"bytes": buffer.getvalue(), "path": None})
        table = datasets.Dataset.from_dict({"image": images}, features=features)
        table.to_parquet(str(folder / f"train-{shard:05d}.parquet"), batch_size=4)
    return folder


@pytest.mark.processes
def test_retried_reads_yield_the_bytes_of_clean_reads(shards):
    """503 when opening, a dropped connection, a 503 and a stalled response while reading: the same bytes, in order."""

    def read(server):
        dataset = load_image_dataset(server.url("train-{00000..00007}.parquet"), retries=StreamRetries(5, 0.05),
                                     timeout=1.0).cast_column("image", datasets.Image(decode=False))  # fmt: skip
        return [row["image"]["bytes"] for row in dataset]

    StreamRetries(5, 0.05).configure()
    with ShardServer(shards) as server:
        clean = read(server)
    faults = {"/train-00001.parquet": ["drop"], "/train-00002.parquet": ["503"], "/train-00003.parquet": ["stall"]}
    with ShardServer(shards, faults=faults, stall_seconds=2.5) as server:
        server.faults["/train-00000.parquet"] = ["503"]  # the very first request: while opening the dataset
        server.on = "any"
        flaky = read(server)
        injected = [r for r in server.requests if r[2] is not None]
    assert len(clean) == NUM_SHARDS * 8 and flaky == clean
    assert sorted(fault for _, _, fault in injected) == ["503", "503", "drop", "stall"]


def _bytes_served(requests) -> int:
    """Bytes the server sent for ranged GETs (data reads; HEAD and whole-file GETs are not counted)."""
    total = 0
    for _, header, _ in requests:
        if header:
            start, end = header.removeprefix("bytes=").split("-")
            total += int(end) - int(start) + 1 if end else 0
    return total


@pytest.mark.processes
def test_a_resumed_epoch_reads_only_the_row_groups_it_still_needs(shards):
    """Resumed near the end of an epoch, the stream yields the rest exactly and downloads a fraction of the shards:
    consumed row groups (out of the shuffle buffer) are not read again, only the footers and what is still to come."""
    transform = build_transform(32, train=True)

    def stream(server, skip=None):
        dataset = load_image_dataset(server.url("train-{00000..00007}.parquet"), storage_options={"block_size": 1024})
        images = ImageStream(dataset, "image", transform, seed=3, shuffle_buffer_size=4)
        images.set_epoch(1)
        images.set_skip(skip)
        assert (images._resume is not None) == bool(skip)  # resumed on the row positions
        return list(images)

    with ShardServer(shards) as server:
        full = stream(server)
        epoch_bytes = _bytes_served(server.requests)
        server.requests.clear()
        rest = stream(server, skip=[56])
        resumed_bytes = _bytes_served(server.requests)
        # 503s and dropped connections while the resumed stream reads the footers (retried) and then its row groups
        # (the stream reopened where it was): the same samples
        StreamRetries(5, 0.05).configure()
        server.faults = {f"/train-{shard:05d}.parquet": ["503", "drop", "503"] for shard in range(NUM_SHARDS)}
        flaky = stream(server, skip=[56])
        injected = [request for request in server.requests if request[2] is not None]
    assert len(full) == NUM_SHARDS * 8 and len(rest) == len(flaky) == 8
    assert len(injected) > 2 * NUM_SHARDS  # two faults per footer, and more in the row groups read afterwards
    for a, b, c in zip(full[56:], rest, flaky, strict=True):
        assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["pixel_values"], c["pixel_values"])
    # 8 of 64 samples to come: their row groups (4 images each) and the buffer's, plus 8 footers
    assert resumed_bytes < 0.35 * epoch_bytes, (resumed_bytes, epoch_bytes)


def test_the_resume_reader_picks_storage_options_as_datasets_does():
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}, "hf": {"token": None}}
    assert _options_for("s3://bucket/a.parquet", options) == {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}
    }
    assert _options_for("hf://datasets/org/name/a.parquet", options) == {"token": None}
    assert _options_for("/data/a.parquet", {"hf": {"token": None}}) == {}


def _keep_retry_config(monkeypatch):
    """Restore `datasets`' streaming retries (which `StreamRetries.configure` sets process-wide) after the test."""
    for name in dir(datasets.config):
        if name.startswith("STREAMING_") and "RETR" in name:
            monkeypatch.setattr(datasets.config, name, getattr(datasets.config, name))


@pytest.mark.processes
def test_finding_every_shard_is_retried_like_a_read(shards, caplog):
    """Two 503s for every shard's first requests (fsspec's HEAD, then its GET): each file is found again after a
    logged retry, and the data is complete; a shard that never answers stops with a ConnectionError naming it."""
    faults = {f"/train-{shard:05d}.parquet": ["any:503"] * 4 for shard in range(NUM_SHARDS)}
    with caplog.at_level(logging.WARNING), ShardServer(shards, faults=faults) as server:
        dataset = load_image_dataset(server.url("train-{00000..00007}.parquet"), retries=StreamRetries(5, 0.01))
        rows = list(dataset.cast_column("image", datasets.Image(decode=False)))
        injected = [fault for _, _, fault in server.requests if fault is not None]
        retried = [record.getMessage() for record in caplog.records if "retry" in record.getMessage()]
        server.faults = {"/train-00003.parquet": ["any:503"] * 100}
        with pytest.raises(ConnectionError, match="after 3 attempts") as gone:
            load_image_dataset(server.url("train-{00000..00007}.parquet"), retries=StreamRetries(3, 0.01))
    assert len(rows) == NUM_SHARDS * 8 and injected == ["503"] * 4 * NUM_SHARDS
    for shard in range(NUM_SHARDS):  # two failed attempts per shard, each logged with its URL
        assert sum(server.url(f"train-{shard:05d}.parquet") in message for message in retried) == 2, retried
    assert server.url("train-00003.parquet") in str(gone.value) and "--stream_retries" in str(gone.value)


@pytest.mark.processes
def test_a_missing_shard_fails_at_once_naming_it(shards):
    """A 404 is not a passing fault: no retries (20 attempts 1 s apart would take minutes), a ValueError naming
    the missing shards and what to check."""
    start = time.monotonic()
    with ShardServer(shards) as server, pytest.raises(ValueError, match="2 of the 4 remote data file") as missing:
        load_image_dataset(server.url("train-{00006..00009}.parquet"), retries=StreamRetries(20, 1.0))
    assert time.monotonic() - start < 5.0
    message = str(missing.value)
    assert server.url("train-00008.parquet") in message and server.url("train-00009.parquet") in message
    assert "train-00007" not in message and "brace range" in message


SECRET = "FAKEsecret42"  # the password or signature of every URL below: in no log record, error or sample source
CREDENTIALS = {"userinfo": dict(auth=("user", SECRET)), "signature": dict(query=f"X-Amz-Signature={SECRET}")}


def _url_with_credentials(server: ShardServer, name: str, form: str) -> str:
    if form == "userinfo":
        return server.url(name).replace("http://", f"http://user:{SECRET}@")
    return f"{server.url(name)}?X-Amz-Signature={SECRET}"


def test_errors_out_of_the_retries_are_redacted_and_spent_retries_say_so():
    """An error that is not a passing fault is raised at once, of its type, with its URL redacted and no chain that
    holds the secret; a passing fault that never passes ends in a ConnectionError naming the attempts."""
    url = f"http://user:{SECRET}@127.0.0.1:9/shard-00000.parquet?X-Amz-Signature={SECRET}"
    calls = []

    def missing():
        calls.append(1)
        raise FileNotFoundError(f"Unable to find {url!r}") from OSError(f"404 for {url}")

    with pytest.raises(FileNotFoundError) as error:
        StreamRetries(5, 0.0).call(missing, url, not_found_attempts=1)
    text = "".join(traceback.format_exception(error.value))
    assert len(calls) == 1 and SECRET not in text
    assert "http://<REDACTED>@127.0.0.1:9/shard-00000.parquet?<REDACTED>" in str(error.value)

    def refused():
        raise ConnectionRefusedError(f"Cannot connect to {url}")

    with pytest.raises(ConnectionError, match="failed after 3 attempts") as error:
        StreamRetries(3, 0.0).call(refused, url)
    assert "--stream_retries" in str(error.value)
    assert SECRET not in "".join(traceback.format_exception(error.value))


def test_one_retry_rule_for_every_remote_read(caplog, monkeypatch):
    """Passing faults are tried again up to the attempts in a row, a fixed wait apart, each retry logged redacted in
    one form; the numbers configured in the main process are those every reader uses."""
    retries = StreamRetries(3, 0.0)
    refused = ConnectionRefusedError("Cannot connect to http://host/a.parquet")
    assert [retries.is_retried(refused, attempt) for attempt in (1, 2, 3)] == [True, True, False]
    assert not retries.is_retried(ValueError("not a parquet file"), 1)
    hidden_503 = FileNotFoundError("Unable to find 'http://host/a.parquet'")  # how `datasets` reports one
    assert retries.is_retried(hidden_503, 2, not_found_attempts=3) and not retries.is_retried(hidden_503, 1)
    with caplog.at_level(logging.WARNING):
        retries.back_off(f"Reading http://user:{SECRET}@host/a.parquet", refused, 2, "reopening it at row 4")
    assert caplog.records[-1].getMessage() == (
        "Reading http://<REDACTED>@host/a.parquet failed (ConnectionRefusedError: Cannot connect to "
        "http://host/a.parquet); retry 2/2 in 0 s, reopening it at row 4."
    )
    _keep_retry_config(monkeypatch)
    StreamRetries(7, 0.5).configure()
    configured = StreamRetries.configured()
    assert (configured.retries, configured.wait) == (7, 0.5)


@pytest.fixture(scope="module")
def credential_files(tmp_path_factory):
    """Eight PNG images, and two parquet shards of them whose stored paths are signed URLs (as a dataset built from
    a list of URLs keeps them)."""
    folder = tmp_path_factory.mktemp("credentials")
    rng = np.random.default_rng(2)
    features = datasets.Features({"image": datasets.Image()})
    for shard in range(2):
        images = []
        for index in range(4 * shard, 4 * shard + 4):
            image = Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))
            image.save(folder / f"img-{index}.png")
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            path = f"https://images.example/img-{index}.png?X-Amz-Signature={SECRET}"
            images.append({"bytes": buffer.getvalue(), "path": path})
        table = datasets.Dataset.from_dict({"image": images}, features=features)
        table.to_parquet(str(folder / f"shard-{shard:05d}.parquet"))
    return folder


@pytest.mark.processes
@pytest.mark.parametrize("form", list(CREDENTIALS))
def test_credentials_in_urls_reach_no_log_error_or_sample_source(credential_files, form, caplog, monkeypatch):
    """Shard URLs with a password or a signature, served by a server that refuses requests without it: the data
    loads through 503s and dropped connections (the real URL is read), and the secret is in no log record, no error
    (with its chain, as a traceback prints it) and no `sources` entry, which name the URLs redacted."""
    _keep_retry_config(monkeypatch)
    retries = StreamRetries(5, 0.01)
    retries.configure()
    faults = {f"/shard-{shard:05d}.parquet": ["any:503", "any:503", "drop"] for shard in range(2)}
    with caplog.at_level(logging.INFO), ShardServer(credential_files, faults=faults, **CREDENTIALS[form]) as server:
        if form == "userinfo":
            urls = _url_with_credentials(server, "shard-{00000..00001}.parquet", form)
        else:  # a signed URL per shard
            urls = " ".join(_url_with_credentials(server, f"shard-{shard:05d}.parquet", form) for shard in range(2))
        dataset = load_image_dataset(urls, retries=retries, timeout=2.0)
        stream = ImageStream(dataset, "image", build_transform(32, train=True), seed=0, shuffle_buffer_size=0)
        batches = list(torch.utils.data.DataLoader(stream, batch_size=4, collate_fn=collate_images))
        with pytest.raises(ValueError, match="1 of the 2 remote data file") as missing:
            load_image_dataset(_url_with_credentials(server, "shard-{00001..00002}.parquet", form), retries=retries)
        StreamRetries(2, 0.01).configure()
        server.faults = {f"/shard-{shard:05d}.parquet": ["503"] * 100 for shard in range(2)}  # every read
        with pytest.raises(RuntimeError, match="failed for good") as failed:
            list(ImageStream(dataset, "image", build_transform(32, train=True), seed=0, shuffle_buffer_size=0))
    assert sum(len(batch["pixel_values"]) for batch in batches) == 8  # read with the credentials (401/403 without)
    sources = [source for batch in batches for source in batch["sources"]]
    assert sources == [f"https://images.example/img-{index}.png?<REDACTED>" for index in range(8)]
    messages = [record.getMessage() for record in caplog.records]
    redacted = "http://<REDACTED>@127.0.0.1" if form == "userinfo" else ".parquet?<REDACTED>"
    assert any(redacted in message and "etry" in message for message in messages), messages  # retries were logged
    assert [message for message in messages if SECRET in message] == []
    assert redacted in str(missing.value) and "shard-00002.parquet" in str(missing.value)
    assert "127.0.0.1" in str(failed.value)
    for error in (missing.value, failed.value):
        assert SECRET not in "".join(traceback.format_exception(error))


@pytest.mark.processes
def test_remote_images_are_read_with_their_credentials_and_sourced_without(credential_files):
    """An image folder by URLs with a password: each image is read with it, its source is the redacted URL."""
    with ShardServer(credential_files, **CREDENTIALS["userinfo"]) as server:
        url = _url_with_credentials(server, "img-{0..7}.png", "userinfo")
        dataset = load_image_dataset(url)
        stream = ImageStream(dataset, "image", build_transform(32, train=True), seed=0, shuffle_buffer_size=0,
                             image_root=dataset_root(url))  # fmt: skip
        batches = list(torch.utils.data.DataLoader(stream, batch_size=4, collate_fn=collate_images))
    assert sum(len(batch["pixel_values"]) for batch in batches) == 8
    sources = [source for batch in batches for source in batch["sources"]]
    assert sources == [server.url(f"img-{index}.png").replace("http://", "http://<REDACTED>@") for index in range(8)]


# A process that streams remote shards through one DataLoader worker; it waits for a line on stdin between opening
# the dataset and iterating, so that the server can turn to 503s for the worker only.
RETRYING_PARENT = """
import sys
import torch
from veca_hf.data import ImageStream, StreamRetries, build_transform, collate_images, load_image_dataset

retries = StreamRetries(50, 2.0)  # minutes of retries: 50 x 2 s in datasets' read loop, as many reopenings after
retries.configure()
stream = ImageStream(load_image_dataset(sys.argv[1], retries=retries), "image", build_transform(32, train=True),
                     seed=0, shuffle_buffer_size=0)
print("ready", flush=True)
sys.stdin.readline()
for batch in torch.utils.data.DataLoader(stream, batch_size=2, num_workers=1, collate_fn=collate_images):
    print("batch", flush=True)
"""


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie left to a parent that does not reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_retrying_worker_exits_when_its_parent_is_killed(shards, tmp_path):
    """A DataLoader worker retrying reads against a server that answers only 503 (for minutes: 50 attempts 2 s apart)
    is gone within seconds of its parent's SIGKILL."""
    with ShardServer(shards) as server, open(tmp_path / "stderr.txt", "w") as stderr:
        parent = subprocess.Popen([sys.executable, "-c", RETRYING_PARENT, server.url("train-{00000..00007}.parquet")],
                                  cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                  env=run_env())  # fmt: skip
        try:
            assert parent.stdout.readline().strip() == "ready", (tmp_path / "stderr.txt").read_text()[-3000:]
            server.faults = {f"/train-{shard:05d}.parquet": ["503"] * 10_000 for shard in range(NUM_SHARDS)}
            parent.stdin.write("go\n")
            parent.stdin.flush()
            deadline = time.monotonic() + 60
            while sum(fault == "503" for _, _, fault in server.requests) < 2:  # the worker is in its retries
                assert parent.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr.txt").read_text()
                time.sleep(0.05)
            workers = subprocess.run(["ps", "--ppid", str(parent.pid), "-o", "pid="], capture_output=True, text=True)
            (worker,) = (int(pid) for pid in workers.stdout.split())
            parent.kill()
            parent.wait()
            killed = time.monotonic()
            while _alive(worker) and time.monotonic() - killed < 10:
                time.sleep(0.05)
            alive_for = time.monotonic() - killed
        finally:
            parent.kill()
            parent.wait()
        requests_after = len(server.requests)
        time.sleep(1.0)
        still_asking = len(server.requests) > requests_after
    survived = _alive(worker)
    if survived:
        os.kill(worker, signal.SIGKILL)
    assert not survived and alive_for < 5.0, f"the worker outlived its parent by {alive_for:.1f} s (or more)"
    assert not still_asking


REMOTE_RUN = dict(max_train_steps=12, checkpointing_steps=2, validation_steps=100, validation_size=4,
                  dataloader_num_workers=2, stream_retries=5, stream_retry_wait=0.05, stream_timeout=1.0)  # fmt: skip


def remote_args(workspace, server, output_dir, **overrides):  # noqa: F811
    dataset = server.url("train-{00000..00007}.parquet")
    return distill_args(workspace, output_dir, dataset_name=dataset, **{**REMOTE_RUN, **overrides})


@pytest.fixture(scope="module")
def clean_run(workspace, shards, tmp_path_factory):  # noqa: F811
    output_dir = tmp_path_factory.mktemp("remote-clean")
    with ShardServer(shards) as server:
        run_distill(remote_args(workspace, server, output_dir))
    return output_dir


def assert_same_weights(first, second):
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


@pytest.mark.processes
def test_a_flaky_server_trains_the_same_weights(workspace, shards, clean_run, tmp_path):  # noqa: F811
    faults = {"/train-00001.parquet": ["drop"], "/train-00002.parquet": ["503"], "/train-00003.parquet": ["stall"]}
    with ShardServer(shards, faults=faults, stall_seconds=2.5) as server:
        result = run_distill(remote_args(workspace, server, tmp_path / "flaky"))
        injected = [r for r in server.requests if r[2] is not None]
    assert len(injected) == 3
    assert_same_weights(clean_run, tmp_path / "flaky")
    retries = [line for line in result.stderr.splitlines() if "Retrying in" in line]
    for name in ("train-00001", "train-00002", "train-00003"):  # each retry is logged with its URL
        assert any(f"{server.url(name)}.parquet" in line for line in retries), (name, retries)


@pytest.mark.processes
def test_a_503_on_first_contact_with_every_shard_trains_the_same_weights(workspace, shards, clean_run, tmp_path):  # noqa: F811
    """Every shard answers 503 to its first request (finding the file, before any read) and drops its first transfer:
    each data file is resolved with the retries of a read, and the run trains what a clean one does."""
    faults = {f"/train-{shard:05d}.parquet": ["any:503", "drop"] for shard in range(NUM_SHARDS)}
    with ShardServer(shards, faults=faults) as server:
        run_distill(remote_args(workspace, server, tmp_path / "first-contact"))
        injected = [fault for _, _, fault in server.requests if fault is not None]
    assert sorted(injected) == ["503"] * NUM_SHARDS + ["drop"] * NUM_SHARDS
    assert_same_weights(clean_run, tmp_path / "first-contact")


@pytest.mark.processes
def test_a_server_gone_for_good_stops_the_run_clearly_and_it_resumes_when_back(workspace, shards, clean_run, tmp_path):  # noqa: F811
    output_dir = tmp_path / "outage"
    server = ShardServer(shards).start()
    args = remote_args(workspace, server, output_dir)
    process = subprocess.Popen([sys.executable, str(FAULTS_SCRIPT), *args], cwd=ROOT, stderr=subprocess.PIPE,
                               text=True, env={**run_env(), "VECA_HF_TEST_PAUSE_AFTER_STEP": "2"})  # fmt: skip
    deadline = time.time() + 240
    while not (output_dir / "checkpoints" / "checkpoint-2").is_dir():
        assert process.poll() is None and time.time() < deadline, "no checkpoint-2"
        time.sleep(0.05)
    server.stop()  # gone for good; then let the run go on
    process.send_signal(signal.SIGUSR1)
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        if os.environ.get("DEBUG_HANG"):
            subprocess.run(["py-spy", "dump", "--pid", str(process.pid)])
            subprocess.run(f"ps --ppid {process.pid} -o pid= | xargs -I{{}} py-spy dump --pid {{}}", shell=True)
        process.kill()
        pytest.fail("the run hung after the server went away:\n" + process.communicate()[1][-5000:])
    assert process.returncode != 0
    assert "failed for good" in stderr and server.url("train-") in stderr, stderr[-3000:]
    assert "after 5 attempts (--stream_retries)" in stderr and "reopening the stream" in stderr
    assert "Newest checkpoint:" in stderr
    server.start()  # back, on the same port
    try:
        run_distill(remote_args(workspace, server, output_dir, resume_from_checkpoint="latest"))
    finally:
        server.stop()
    assert_same_weights(clean_run, output_dir)
    assert json.loads((output_dir / "distill_results.json").read_text())["step"] == REMOTE_RUN["max_train_steps"]


@pytest.mark.processes
def test_a_worker_killed_from_outside_stops_the_run_with_a_clear_error(workspace, shards, tmp_path):  # noqa: F811
    """The kernel's OOM killer sends SIGKILL to a DataLoader worker: the run says so and names its last checkpoint,
    and never hangs."""
    output_dir = tmp_path / "killed-worker"
    with ShardServer(shards) as server:
        process = subprocess.Popen([sys.executable, str(FAULTS_SCRIPT), *remote_args(workspace, server, output_dir)],
                                   cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                   env={**run_env(), "VECA_HF_TEST_PAUSE_AFTER_STEP": "2"})  # fmt: skip
        deadline = time.time() + 240
        while not (output_dir / "checkpoints" / "checkpoint-2").is_dir():
            assert process.poll() is None and time.time() < deadline, "no checkpoint-2"
            time.sleep(0.05)
        workers = subprocess.run(["ps", "--ppid", str(process.pid), "-o", "pid="], capture_output=True, text=True)
        worker = int(workers.stdout.split()[0])
        os.kill(worker, signal.SIGKILL)
        time.sleep(0.5)
        process.send_signal(signal.SIGUSR1)  # if the pause is still waiting, let the run go on into the dead worker
        try:
            _, stderr = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail("the run hung after its worker was killed:\n" + process.communicate()[1][-5000:])
    assert process.returncode != 0
    assert "A DataLoader worker was killed from outside" in stderr, stderr[-3000:]
    assert f"Newest checkpoint: {output_dir / 'checkpoints' / 'checkpoint-2'}" in stderr


@pytest.mark.processes
def test_s3_glob_with_storage_options_splits_shards_across_two_processes(workspace, tmp_path):  # noqa: F811
    """A local S3-compatible server (moto) and s3fs: a glob of parquet shards, the endpoint and keys in
    --storage_options, two processes under accelerate launch reading disjoint shards; no key reaches a file."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server._server.server_address[1]}"
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                              aws_secret_access_key="s3cretKEYnotONdisk", region_name="us-east-1")  # fmt: skip
        client.create_bucket(Bucket="veca-shards")
        rng = np.random.default_rng(1)
        features = datasets.Features({"image": datasets.Image()})
        for shard in range(4):  # 4 shards, named images: the sources each rank logs tell the split
            images = []
            for index in range(6):
                buffer = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(buffer, format="PNG")
                images.append({"bytes": buffer.getvalue(), "path": f"shard{shard}-img{index}.png"})
            path = tmp_path / f"train-{shard}.parquet"
            datasets.Dataset.from_dict({"image": images}, features=features).to_parquet(str(path))
            client.upload_file(str(path), "veca-shards", f"train/train-{shard}.parquet")
        options = {"key": "testing", "secret": "s3cretKEYnotONdisk",
                   "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}  # fmt: skip
        output_dir = tmp_path / "s3-ddp"
        launcher = two_cpu_processes(29535)
        args = distill_args(workspace, output_dir, dataset_name="s3://veca-shards/train/*.parquet",
                            storage_options=json.dumps(options), max_train_steps=2, validation_size=2,
                            log_sample_sources="true", dataloader_num_workers=1)  # fmt: skip
        run_distill(args, launcher=launcher)
    finally:
        server.stop()
    seen = [(output_dir / "sample_sources" / f"rank{rank}.txt").read_text().splitlines() for rank in range(2)]
    shards = [{line.split("\t")[1].split("-")[0] for line in part} for part in seen]
    assert all(part for part in shards) and shards[0].isdisjoint(shards[1]), shards  # whole shards per rank
    written = [p for p in output_dir.rglob("*") if p.is_file()]
    assert not [p for p in written if b"s3cretKEYnotONdisk" in p.read_bytes()]
