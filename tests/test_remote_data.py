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

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from shard_server import ShardServer
from test_distill_script import (  # noqa: F401 (workspace: the fixture)
    ROOT,
    SCRIPT,
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


def test_a_server_gone_for_good_stops_the_run_clearly_and_it_resumes_when_back(workspace, shards, clean_run, tmp_path):  # noqa: F811
    output_dir = tmp_path / "outage"
    server = ShardServer(shards).start()
    args = remote_args(workspace, server, output_dir)
    process = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               env={**run_env(), "VECA_HF_TEST_PAUSE_AFTER_STEP": "2"})  # fmt: skip
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


def test_a_worker_killed_from_outside_stops_the_run_with_a_clear_error(workspace, shards, tmp_path):  # noqa: F811
    """The kernel's OOM killer sends SIGKILL to a DataLoader worker: the run says so and names its last checkpoint,
    and never hangs."""
    output_dir = tmp_path / "killed-worker"
    with ShardServer(shards) as server:
        process = subprocess.Popen([sys.executable, str(SCRIPT), *remote_args(workspace, server, output_dir)],
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
