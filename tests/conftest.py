"""Shared fixtures: tiny VECA configs, a tiny DINOv3 teacher, generated images. Nothing touches the network."""

import contextlib
import gzip
import multiprocessing.process
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path


# Under pytest-xdist (`run.sh test`: one worker per core) each worker, and the processes its tests start, gets its
# share of the cores rather than every core, so that the workers do not oversubscribe the machine. Set before torch
# loads OpenMP, so that every thread (a test's thread pool included) starts with the same count.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))  # tests/reference_veca.py


from veca_hf import VecaConfig  # noqa: E402


FIXTURES = Path(__file__).parent / "fixtures"


# The quick tier (`bash run.sh test-quick`) leaves out the tests marked `processes`: those that start a process, a
# server or a browser. The mark is kept true here: an unmarked test (its fixtures included) that starts one fails.
@contextlib.contextmanager
def _refusing_processes(nodeid: str):
    def refuse(what: str):
        def refused(*args, **kwargs):
            raise RuntimeError(f"{nodeid} starts {what}: mark it `@pytest.mark.processes` (test-quick leaves it out).")

        return refused

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse("a process (subprocess)"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse("a process (multiprocessing)"))
        patch.setattr(socket.socket, "listen", refuse("a server (socket.listen)"))
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("processes"):
        return (yield)
    with _refusing_processes(item.nodeid):
        return (yield)


def tiny_config(**overrides) -> VecaConfig:
    """Two blocks, width 64, two 32-wide heads, a bank of 16 cores (budgets 8 and 16): runs in milliseconds."""
    values = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=170,
        core_bank_size=16,
        core_chunk_size=8,
        image_size=64,
    )
    values.update(overrides)
    return VecaConfig(**values)


@pytest.fixture
def config() -> VecaConfig:
    return tiny_config()


@pytest.fixture
def pixel_values() -> torch.Tensor:
    """Two non-square 64x48 images (4 x 3 patches)."""
    return torch.randn(2, 3, 64, 48, generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def random_pil_images(count: int, size=(96, 80), seed: int = 0):
    """Small random RGB PIL images (generated, so tests need no data files)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(count)]


def tiny_dinov3_config(**overrides):
    """A tiny DINOv3 teacher config (same width as `tiny_config`, patch 16, 4 registers)."""
    from transformers import DINOv3ViTConfig

    values = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        patch_size=16,
        num_register_tokens=4,
        image_size=64,
    )
    values.update(overrides)
    return DINOv3ViTConfig(**values)


@pytest.fixture
def accelerator():
    """A single-process CPU `Accelerator`, with Accelerate's global state reset before and after."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def prepared_linear(accelerator, seed=0):
    """A seeded `Linear(4, 3)` and its AdamW, prepared by `accelerator`."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


@pytest.fixture(scope="module")
def veca_dir(tmp_path_factory) -> Path:
    """A saved tiny random VECA folder with its image processor (seeded)."""
    from veca_hf import VecaImageProcessor, VecaModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "veca-tiny"
    VecaModel(tiny_config()).save_pretrained(path)
    VecaImageProcessor().save_pretrained(path)
    return path


def write_idx(folder, prefix: str, count: int, rng) -> None:
    """A Fashion-MNIST look-alike in its IDX format: 28 x 28 grey images whose brightness follows the class."""
    labels = rng.integers(0, 10, count).astype(np.uint8)
    images = (rng.integers(0, 60, (count, 28, 28)) + 19 * labels[:, None, None]).astype(np.uint8)
    with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as file:
        file.write(struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes())
    with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as file:
        file.write(struct.pack(">II", 2049, count) + labels.tobytes())
