"""The peak train/mfu is measured against: a CPU's theoretical rate, the fastest rate seen, and a
utilisation that never exceeds 1."""

from __future__ import annotations

import json

import pytest
import torch

from shell.flops import (
    cpu_key,
    cpu_peak_flops,
    fastest_seen,
    fp32_flops_per_cycle,
    peak_cache,
    record_cpu_rate,
    remember_rate,
    theoretical_cpu_peak_flops,
    this_cpu_theoretical_peak,
)
from training.callbacks import Throughput

# /proc/cpuinfo of one logical CPU of a 4-core, 8-thread AVX2 machine, idling at 1.2 GHz
XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) CPU E5-2673 v4 @ 2.30GHz
cpu MHz\t\t: 1200.000
siblings\t: 8
cpu cores\t: 4
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx avx2
"""
GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm
CPU implementer\t: 0x41
"""


@pytest.mark.parametrize(
    "flags, machine, per_cycle",
    [
        ({"sse", "avx", "avx2", "fma", "avx512f"}, "x86_64", 16 * 2 * 2),  # 16 lanes, two FMA units
        ({"sse", "avx", "avx2", "fma"}, "x86_64", 8 * 2 * 2),
        ({"sse", "avx"}, "x86_64", 8 * 2),  # no FMA: one multiply and one add unit
        ({"sse", "sse2"}, "x86_64", 4 * 2),
        ({"fp", "asimd"}, "aarch64", 4 * 4 * 2),  # four 128-bit FMA units
        (set(), "x86_64", None),
        ({"fp"}, "aarch64", None),
    ],
)
def test_flops_per_cycle_follow_the_widest_vector_unit_and_its_fma_units(flags, machine, per_cycle):
    assert fp32_flops_per_cycle(flags, machine) == per_cycle


def test_the_theoretical_peak_takes_the_highest_clock_named_and_one_thread_per_physical_core():
    # the model name's 2.3 GHz beats the idle 1.2 GHz; 8 logical CPUs are 4 cores
    assert theoretical_cpu_peak_flops(XEON, "x86_64", [], cpus=8, threads=8) == pytest.approx(32 * 2.3e9 * 4)
    assert theoretical_cpu_peak_flops(XEON, "x86_64", [], cpus=8, threads=2) == pytest.approx(32 * 2.3e9 * 2)
    assert theoretical_cpu_peak_flops(XEON, "x86_64", [], cpus=2, threads=8) == pytest.approx(32 * 2.3e9 * 1)
    # cpufreq's maximum (turbo) beats them both
    turbo = theoretical_cpu_peak_flops(XEON, "x86_64", [3_500_000, 3_000_000], cpus=8, threads=8)
    assert turbo == pytest.approx(32 * 3.5e9 * 4)
    # Arm names no clock in /proc/cpuinfo: only cpufreq does
    arm = theoretical_cpu_peak_flops(GRAVITON, "aarch64", [2_600_000], cpus=4, threads=4)
    assert arm == pytest.approx(32 * 2.6e9 * 4)
    assert theoretical_cpu_peak_flops(GRAVITON, "aarch64", [], cpus=4, threads=4) is None
    assert theoretical_cpu_peak_flops("", "x86_64", [3_000_000], cpus=4, threads=4) is None


def store(folder, rate: float) -> None:
    peak_cache(folder).parent.mkdir(parents=True, exist_ok=True)
    peak_cache(folder).write_text(json.dumps({cpu_key(): rate}))


def test_a_measurement_taken_on_a_busy_machine_cannot_lower_the_peak_below_the_theoretical_rate(tmp_path):
    busy = 1e9  # far below any CPU torch runs on
    store(tmp_path, busy)
    assert cpu_peak_flops(tmp_path) == max(busy, this_cpu_theoretical_peak() or 0.0)
    assert fastest_seen(tmp_path) == {cpu_key(): busy}  # a stored figure is not measured again


def test_a_rate_seen_above_the_theoretical_one_is_the_peak(tmp_path):
    store(tmp_path, 1e16)  # a CPU turbo-clocked above every clock it names
    assert cpu_peak_flops(tmp_path) == 1e16


def test_the_first_run_on_a_machine_measures_a_matmul_and_keeps_it(tmp_path):
    peak = cpu_peak_flops(tmp_path)
    measured = fastest_seen(tmp_path)[cpu_key()]
    assert 0 < measured <= peak and peak == max(measured, this_cpu_theoretical_peak() or 0.0)


def test_only_a_faster_rate_replaces_the_one_kept_and_other_entries_stay(tmp_path):
    peak_cache(tmp_path).write_text('{"peak": 1.0, "other|8|8|2.4": 5e10, "bad": "x"}')
    assert record_cpu_rate(2e10, tmp_path) == 2e10
    assert record_cpu_rate(1e10, tmp_path) == 2e10
    assert fastest_seen(tmp_path) == {"peak": 1.0, "other|8|8|2.4": 5e10, cpu_key(): 2e10}
    for text in ("[1, 2]", "not json"):
        peak_cache(tmp_path).write_text(text)
        assert fastest_seen(tmp_path) == {}
        assert record_cpu_rate(3e10, tmp_path) == 3e10


def test_mfu_never_exceeds_one_a_faster_rate_raises_the_peak_and_a_cpu_remembers_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYGPT2_CACHE", str(tmp_path))
    meter = Throughput(tokens_per_step=1024, world_size=1, precision="32-true", on_faster=remember_rate)
    meter.device, meter.peak = torch.device("cpu"), 1e9
    assert meter.utilisation(5e8) == 0.5
    assert meter.utilisation(4e9) == 1.0 and meter.peak == 4e9
    assert meter.utilisation(2e9) == 0.5
    assert fastest_seen(tmp_path) == {cpu_key(): 4e9}

    gpu = Throughput(tokens_per_step=1024, world_size=1, precision="bf16-mixed", on_faster=remember_rate)
    gpu.device, gpu.peak = torch.device("cuda", 0), 1e12
    assert gpu.utilisation(2e12) == 1.0 and gpu.peak == 2e12
    assert fastest_seen(tmp_path) == {cpu_key(): 4e9}  # a GPU's rate is no CPU's


def test_a_cpu_that_multiplies_bfloat16_in_hardware_has_a_bf16_peak_of_its_own(tmp_path, monkeypatch):
    """AVX-512 BF16 dot products do twice an FMA's work a cycle, AMX tiles 32 times; a CPU without
    either converts around fp32 and has its fp32 peak in bf16 too."""
    epyc = XEON.replace("avx avx2", "avx avx2 avx512f avx512_bf16")
    sapphire = epyc.replace("avx512_bf16", "avx512_bf16 amx_bf16 amx_tile")
    fp32 = theoretical_cpu_peak_flops(epyc, "x86_64", [], cpus=8, threads=8)
    assert fp32 == pytest.approx(64 * 2.3e9 * 4)
    assert theoretical_cpu_peak_flops(epyc, "x86_64", [], cpus=8, threads=8, bf16=True) == pytest.approx(2 * fp32)
    assert theoretical_cpu_peak_flops(sapphire, "x86_64", [], cpus=8, threads=8, bf16=True) == pytest.approx(32 * fp32)
    assert theoretical_cpu_peak_flops(XEON, "x86_64", [], cpus=8, threads=8, bf16=True) == pytest.approx(32 * 2.3e9 * 4)

    # the fastest rates seen are kept apart: a bf16 run's rate does not raise the fp32 peak
    monkeypatch.setenv("TINYGPT2_CACHE", str(tmp_path))
    store(tmp_path, 1e16)
    meter = Throughput(tokens_per_step=1024, world_size=1, precision="bf16-mixed", on_faster=remember_rate)
    meter.device, meter.peak = torch.device("cpu"), 1e9
    assert meter.utilisation(4e9) == 1.0
    assert fastest_seen(tmp_path) == {cpu_key(): 1e16, cpu_key(bf16=True): 4e9}
    assert cpu_peak_flops(tmp_path, bf16=True) == max(4e9, this_cpu_theoretical_peak(bf16=True) or 0.0)
    assert cpu_peak_flops(tmp_path) == 1e16
