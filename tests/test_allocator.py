"""The glibc malloc settings of `veca_hf.cpu.allocator.tune_cpu_allocator()`: nothing at import, nothing
from a model's forward (no process-wide side effect), nothing when opted out, large tensors served from the heap
once called, and outputs bit for bit unchanged.

Each check runs in a fresh interpreter: the settings are process-wide, and this test process has run models already."""

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import ctypes, json, os, torch

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def mapped_bytes(size):  # how much a fresh tensor of `size` bytes adds to glibc's mmapped memory
        before = libc.mallinfo2().hblkhd
        tensor = torch.ones(size, dtype=torch.uint8)
        return libc.mallinfo2().hblkhd - before

    import veca_hf.cpu.allocator
    from veca_hf import VecaConfig, VecaModel

    report = {"import": mapped_bytes(64 << 20)}
    torch.manual_seed(0)
    # SwiGLU input (1, 16 + 1024, 2 * 4096) fp32 = 34 MiB: above glibc's largest mmap threshold (32 MiB)
    config = VecaConfig(hidden_size=64, num_attention_heads=2, intermediate_size=4096, num_hidden_layers=2,
                        patch_size=16, core_bank_size=16)
    model = VecaModel(config).eval()
    pixel_values = torch.randn(1, 3, 512, 512)
    with torch.no_grad():
        untuned = model(pixel_values).last_hidden_state
    report["after_forward"] = mapped_bytes(64 << 20)
    report["after_forward_state"] = veca_hf.cpu.allocator.cpu_allocator_state()
    os.environ["VECA_HF_TUNE_MALLOC"] = "0"
    report["opted_out_call"] = veca_hf.cpu.allocator.tune_cpu_allocator()
    report["opted_out"] = mapped_bytes(64 << 20)
    report["opted_out_reason"] = veca_hf.cpu.allocator.cpu_allocator_state()["reason"]
    del os.environ["VECA_HF_TUNE_MALLOC"]
    report["call"] = veca_hf.cpu.allocator.tune_cpu_allocator()
    with torch.no_grad():
        tuned = model(pixel_values).last_hidden_state
        before = libc.mallinfo2().hblkhd
        again = model(pixel_values).last_hidden_state
        report["forward_mapped"] = libc.mallinfo2().hblkhd - before
    report["tuned"] = mapped_bytes(64 << 20)
    report["state"] = veca_hf.cpu.allocator.cpu_allocator_state()
    report["equal"] = bool(torch.equal(untuned, tuned) and torch.equal(tuned, again))
    print(json.dumps(report))
    """
)


@pytest.mark.processes
@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="the settings are glibc's"
)
def test_only_an_explicit_call_keeps_large_tensors_in_the_heap_with_equal_outputs():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1"}
    env.pop("VECA_HF_TUNE_MALLOC", None)
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    assert report["import"] >= 64 << 20  # importing veca_hf left glibc alone: a 64 MiB tensor is a fresh mmap
    assert report["after_forward"] >= 64 << 20 and not report["after_forward_state"]["tuned"]  # so did a forward
    assert report["opted_out_call"] is False and report["opted_out"] >= 64 << 20
    assert report["opted_out_reason"].startswith("opted out")
    assert report["call"] is True and report["state"]["tuned"] and report["state"]["settings"]["M_MMAP_MAX"] == 0
    assert report["tuned"] == 0 and report["forward_mapped"] == 0  # from the heap now, the model's 34 MiB too
    assert report["equal"]  # bit for bit the outputs of the untuned process
