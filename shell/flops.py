"""The peak FLOP/s of the device a run trains on, for its MFU: a GPU's from its data sheet, a CPU's from its
flags, clock and cores, or the fastest rate seen on it (kept in the user's cache)."""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import time
from pathlib import Path

import torch

# Dense peak TFLOPS per GPU: (bf16/fp16 tensor cores, tf32 tensor cores, plain fp32), from the vendors'
# data sheets. Matched against torch.cuda.get_device_name(), first match wins, so specific names
# come before general ones.
GPU_PEAK_TFLOPS: list[tuple[str, tuple[float, float, float]]] = [
    ("GB200", (2500.0, 1250.0, 80.0)),
    ("B200", (2250.0, 1100.0, 80.0)),
    ("H200", (989.4, 494.7, 66.9)),
    ("GH200", (989.4, 494.7, 66.9)),
    ("H100 PCIe", (756.5, 378.0, 51.2)),
    ("H100 NVL", (835.5, 417.5, 60.0)),
    ("H100", (989.4, 494.7, 66.9)),
    ("H800", (989.4, 494.7, 66.9)),
    ("A100", (312.0, 156.0, 19.5)),
    ("A800", (312.0, 156.0, 19.5)),
    ("L40S", (362.1, 183.0, 91.6)),
    ("L40", (181.0, 90.5, 90.5)),
    ("L4", (121.0, 60.0, 30.3)),
    ("A10G", (70.0, 35.0, 31.2)),
    ("A10", (125.0, 62.5, 31.2)),
    ("A6000", (154.8, 77.4, 38.7)),
    ("RTX 4090", (165.2, 82.6, 82.6)),
    ("RTX 3090", (71.0, 35.6, 35.6)),
    ("V100", (125.0, 15.7, 15.7)),  # no bf16 or tf32: fp16 tensor cores, else fp32
    ("T4", (65.0, 8.1, 8.1)),
]


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of a known GPU at the precision Lightning trains with; None when unknown."""
    for key, (half, tf32, fp32) in GPU_PEAK_TFLOPS:
        if key in device_name:
            if "16" in precision:
                return half * 1e12
            tf32_on = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
            return (tf32 if tf32_on else fp32) * 1e12
    return None


# fp32 lanes of the widest vector unit a CPU flag names (x86: /proc/cpuinfo `flags`), widest first
X86_FP32_LANES = (("avx512f", 16), ("avx", 8), ("sse", 4))
# Vector FMA units per core: two on x86 (the most any x86 core has), four 128-bit ones on Arm
# (Neoverse V1/V2, Apple M). The most a core of its kind has, so the figure is an upper bound for most;
# a core that computes faster still (say an A64FX) raises the peak by doing so (cpu_peak_flops).
X86_FMA_UNITS, ARM_FMA_UNITS = 2, 4
# bfloat16 matrix products against fp32 FMAs, per core and cycle, by the flag naming the instructions:
# AMX tiles do 1,024 bf16 multiply-adds a cycle (Intel's figure), 32 times two AVX-512 FMA units;
# AVX-512 BF16 dot products take two bf16 pairs in each fp32 lane, twice an FMA. Strongest first.
BF16_FLAGS = (("amx_bf16", 32), ("avx512_bf16", 2))


def flags_of(cpuinfo: str) -> set[str]:
    """The feature flags a /proc/cpuinfo text names for its first processor (x86 `flags`, Arm `Features`)."""
    flags = re.search(r"^(?:flags|Features)\s*:(.*)$", cpuinfo, re.MULTILINE)
    return set(flags[1].split()) if flags else set()


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags; none where /proc/cpuinfo cannot be read."""
    try:
        return flags_of(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return set()


def bf16_speedup(flags: set[str]) -> int:
    """How many times its fp32 rate a CPU with these flags multiplies bfloat16 matrices at: 1 where it
    has no bf16 instructions (autocast then converts around fp32 arithmetic)."""
    return next((times for flag, times in BF16_FLAGS if flag in flags), 1)


def fp32_flops_per_cycle(flags: set[str], machine: str) -> int | None:
    """fp32 FLOPs one core can issue per clock cycle: lanes x FMA units x 2 (a multiply-add is two
    FLOPs). Without FMA, a multiply and an add unit do as much as one FMA unit. None when unknown."""
    if machine.lower().startswith(("aarch64", "arm")):
        return 4 * ARM_FMA_UNITS * 2 if "asimd" in flags else None
    lanes = next((lanes for flag, lanes in X86_FP32_LANES if flag in flags), None)
    if lanes is None:
        return None
    return lanes * (X86_FMA_UNITS if "fma" in flags or "avx512f" in flags else 1) * 2


def theoretical_cpu_peak_flops(
    cpuinfo: str, machine: str, max_khz: list[int], cpus: int, threads: int, bf16: bool = False
) -> float | None:
    """The most fp32 FLOP/s (`bf16`: bfloat16 FLOP/s) `threads` torch threads can reach on `cpus`
    logical CPUs of the processor /proc/cpuinfo describes: FLOPs per cycle x the highest clock any
    source names (cpufreq's `max_khz`, `cpu MHz`, `@ 2.40GHz` in the model name) x the physical cores
    the threads can occupy (hyper-threads share a core's vector units). None when the text does not
    say enough.

    A processor may turbo above every clock it names (a virtual machine often names only its base
    clock); a rate measured above this figure then raises the peak (cpu_peak_flops)."""
    names = flags_of(cpuinfo)
    per_cycle = fp32_flops_per_cycle(names, machine)
    mhz = [khz / 1000 for khz in max_khz]
    mhz += [float(m) for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo, re.MULTILINE)]
    mhz += [float(g) * 1000 for g in re.findall(r"@\s*([\d.]+)\s*GHz", cpuinfo)]
    if per_cycle is None or not mhz:
        return None
    siblings = re.search(r"^siblings\s*:\s*(\d+)", cpuinfo, re.MULTILINE)
    cores = re.search(r"^cpu cores\s*:\s*(\d+)", cpuinfo, re.MULTILINE)
    per_core = max(1, int(siblings[1]) // int(cores[1])) if siblings and cores and int(cores[1]) else 1
    used = max(1, min(threads, cpus // per_core))
    return per_cycle * (bf16_speedup(names) if bf16 else 1) * max(mhz) * 1e6 * used


def this_cpu_theoretical_peak(bf16: bool = False) -> float | None:
    """theoretical_cpu_peak_flops of this machine, for the cores this process may use."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    max_khz = []
    for file in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/cpuinfo_max_freq"):
        try:
            max_khz.append(int(Path(file).read_text()))
        except (OSError, ValueError):
            pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return theoretical_cpu_peak_flops(cpuinfo, platform.machine(), max_khz, cpus, torch.get_num_threads(), bf16)


def measure_cpu_peak_flops(size: int = 1024, seconds: float = 0.5, bf16: bool = False) -> float:
    """Best fp32 (`bf16`: bfloat16) matmul rate this process reaches with its torch threads."""
    rng = torch.Generator().manual_seed(0)  # its own: a run's random streams must not move
    dtype = torch.bfloat16 if bf16 else torch.float32
    a, b = (torch.randn(size, size, generator=rng).to(dtype) for _ in range(2))
    torch.mm(a, b)  # warm up the kernels and thread pool
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def peak_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """The file that keeps the fastest fp32 and bf16 rates seen on each machine, thread count and torch version."""
    root = cache_dir or os.environ.get("TINYGPT2_CACHE") or "~/.cache/tinygpt2"  # (set but empty: unset)
    return Path(root).expanduser() / "cpu_peak_flops.json"


def cpu_key(bf16: bool = False) -> str:
    """What a measured rate depends on: the processor, its logical CPUs, torch's threads and version,
    and whether it multiplied in bfloat16."""
    machine = platform.processor() or platform.machine()
    return f"{machine}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}" + ("|bf16" if bf16 else "")


def fastest_seen(cache_dir: str | os.PathLike | None = None) -> dict[str, float]:
    """The rates the cache file holds, by cpu_key; a file that cannot be read holds none."""
    try:
        known = json.loads(peak_cache(cache_dir).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(known, dict):
        return {}
    return {
        key: float(rate)
        for key, rate in known.items()
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0
    }


def record_cpu_rate(rate: float, cache_dir: str | os.PathLike | None = None, bf16: bool = False) -> float:
    """Keeps `rate` (FLOP/s, in bfloat16 if `bf16`) as this machine's fastest if it is; returns the
    fastest seen."""
    known = fastest_seen(cache_dir)
    key = cpu_key(bf16)
    if rate > known.get(key, 0.0):
        known[key] = rate
        write_cache(peak_cache(cache_dir), known)
    return known[key]


def write_cache(path: Path, known: dict) -> None:
    """Write a cache file of figures measured on this machine whole (a temporary file, then renamed); a
    read-only cache only loses them for next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=2))
        tmp.replace(path)
    except OSError:
        pass


def cpu_peak_flops(cache_dir: str | os.PathLike | None = None, bf16: bool = False) -> float:
    """The CPU peak train/mfu is measured against: the larger of the theoretical fp32 rate of the
    cores torch uses (this_cpu_theoretical_peak) and the fastest rate seen on this machine, thread
    count and torch version (a matmul measured for half a second when none is stored yet, and any
    faster training rate since: record_cpu_rate). A measurement taken while other work held the cores
    cannot pull it below the theoretical rate, so it cannot inflate MFU. `bf16`: the same in bfloat16,
    for a run under bf16 autocast, kept apart from the fp32 figures."""
    seen = fastest_seen(cache_dir).get(cpu_key(bf16))
    if seen is None:
        seen = record_cpu_rate(measure_cpu_peak_flops(bf16=bf16), cache_dir, bf16)
    return max(seen, this_cpu_theoretical_peak(bf16) or 0.0)


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of one device: a GPU from the table, a CPU from cpu_peak_flops; None when not known."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
    if device.type == "cpu":
        return cpu_peak_flops(bf16="bf16" in str(precision))
    return None


def remember_rate(device: torch.device, precision: str, rate: float) -> None:
    """A rate a device reached above its assumed peak: on a CPU, kept for later runs (record_cpu_rate)."""
    if device is not None and device.type == "cpu":
        record_cpu_rate(rate, bf16="bf16" in str(precision))
