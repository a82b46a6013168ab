"""bf16 on a CPU without bf16 instructions: a measured warning, and bf16 still runs (never a silent switch)."""

import logging
import re

import pytest
import torch

from veca_hf.cpu import hardware


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"fpu", "avx2", "fma"})


def test_slow_bf16_warning_gives_the_measured_slowdown(cpu_without_bf16, caplog):
    with caplog.at_level(logging.WARNING, logger="veca_hf.cpu.hardware"):
        text = hardware.warn_if_slow_bf16("cpu", "--dtype bf16")
    assert text is not None and text.startswith("--dtype bf16: ") and caplog.messages == [text]
    fp32, bf16 = hardware._linear_rates_gflops(torch.get_num_threads())  # cached: the numbers the text gives
    assert fp32 > 0 and bf16 > 0
    assert f"{bf16:.1f} GFLOP/s against {fp32:.1f} in fp32" in text
    assert re.search(rf"about {fp32 / bf16:.1f}x slower", text)


def test_no_bf16_warning_where_bf16_is_fast(monkeypatch, caplog):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    with caplog.at_level(logging.WARNING, logger="veca_hf.cpu.hardware"):
        assert hardware.warn_if_slow_bf16("cpu", "--dtype bf16") is None
        assert hardware.slow_bf16_warning("cuda") is None  # GPUs are not judged by the CPU's flags
    assert caplog.messages == []


def test_linear_throughput_counts_the_projection_flops(monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr(hardware.time, "perf_counter", lambda: float(next(clock)))  # every call takes 1 "second"
    assert hardware.linear_throughput(torch.float32, tokens=4, features=8) == 2 * 4 * 8 * 8


def test_probe_model_in_bf16_warns_and_keeps_bf16(cpu_without_bf16, tmp_path, caplog):
    from conftest import tiny_config

    from veca_hf import VecaModel
    from veca_hf.evaluation.features import ProbeModel

    VecaModel(tiny_config()).save_pretrained(tmp_path / "tiny")
    probe = ProbeModel(str(tmp_path / "tiny"), device="cpu", dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="veca_hf.cpu.hardware"):
        model = probe.model
    assert next(model.parameters()).dtype == torch.bfloat16
    assert any(message.startswith("tiny in bfloat16: this CPU") for message in caplog.messages)


@pytest.mark.parametrize(
    "flags, kind",
    [
        ({"avx2", "avx512_bf16", "amx_bf16", "amx_tile"}, "amx"),
        ({"avx2", "avx512f", "avx512_bf16"}, "avx512_bf16"),
        ({"avx2", "avx512f"}, "no native bf16"),
        (None, None),
    ],
)
def test_cpu_kind_names_the_bf16_instructions(monkeypatch, flags, kind):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    assert hardware.cpu_kind() == kind
    assert hardware.cpu_bf16_support(measure_size=None)["cpu_kind"] == kind


def test_timed_bf16_support_records_mm_and_linear_rates(cpu_without_bf16):
    info = hardware.cpu_bf16_support(measure_size=64, repeats=1)
    assert info["fast_bf16"] is False and info["cpu_kind"] == "no native bf16"
    assert info["mm_size"] == info["bf16_mm_size"] == 64
    assert info["linear_fp32_gflops_per_s"] > 0 and info["linear_bf16_gflops_per_s"] > 0
    assert info["bf16_speedup"] == pytest.approx(info["bf16_gflops_per_s"] / info["fp32_gflops_per_s"])
