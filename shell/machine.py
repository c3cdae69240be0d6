"""What the machine decides for a run: the precision and compile left to it, and the peak FLOP/s its MFU is
measured against. Both are measured once on a CPU and kept in the user's cache ($TINYGPT2_CACHE or
~/.cache/tinygpt2): whether bfloat16 autocast trains this shape faster than 32 bits (it depends on the
processor and the shape: bench/precision.py), and the fastest matmul rate seen."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from model import GPT, GPTConfig
from shell.checks import SettingError
from training.optim import make_adamw

log = logging.getLogger(__name__)

# The CPU flags that name bfloat16 instructions: AMX tiles (Intel Xeon from Sapphire Rapids) and AVX-512 BF16
# (AMD EPYC from Zen 4, Intel Xeon from Cooper Lake). A CPU without them only converts around fp32 arithmetic.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# bf16-mixed is chosen only where it trained at least this many times as fast: near a tie, 32 bits keep the
# exact arithmetic, and a probe of a second or two on a shared machine is noisy.
BF16_MARGIN = 1.1
PROBE_SECONDS, MIN_PAIRS, MAX_PAIRS = 1.5, 2, 40  # the probe's timed steps: about this long, this many pairs
PROBE_TOKENS = 4096  # a larger batch is timed on this many tokens: past a few thousand rows the ratio holds


class Machine(NamedTuple):
    cuda: bool  # it has CUDA GPUs
    bf16: bool  # they compute in bfloat16
    triton: bool  # torch.compile can generate GPU kernels
    cpu_bf16: bool = False  # its CPU has bfloat16 instructions, which may train a model faster

    @classmethod
    def this(cls) -> Machine:
        cuda = torch.cuda.is_available()
        triton = importlib.util.find_spec("triton") is not None
        return cls(cuda, cuda and torch.cuda.is_bf16_supported(), triton, bool(set(CPU_BF16_FLAGS) & cpu_flags()))

    def on_cuda(self, accelerator: str) -> bool:
        return accelerator in ("auto", "gpu", "cuda") and self.cuda

    def on_cpu(self, accelerator: str) -> bool:
        return accelerator == "cpu" or (
            accelerator == "auto" and not self.cuda and not torch.backends.mps.is_available()
        )


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags (x86 `flags`, Arm `Features`); none where /proc/cpuinfo cannot be read."""
    try:
        found = re.search(r"^(?:flags|Features)\s*:(.*)$", Path("/proc/cpuinfo").read_text(errors="replace"), re.M)
    except OSError:
        return set()
    return set(found[1].split()) if found else set()


def cache_file(name: str) -> Path:
    return Path(os.environ.get("TINYGPT2_CACHE") or "~/.cache/tinygpt2").expanduser() / name


def read_cache(name: str) -> dict[str, Any]:
    try:
        known = json.loads(cache_file(name).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def write_cache(name: str, known: dict[str, Any]) -> None:
    """Write a cache file whole; a read-only cache only loses its figures for next time."""
    path = cache_file(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=2))
        tmp.replace(path)
    except OSError:
        pass


# ---- precision ---------------------------------------------------------------------------------------------


def choose_precision(requested: Any, accelerator: str, machine: Machine, shape: tuple[GPTConfig, int] | None) -> str:
    """An explicit choice; else bf16-mixed on GPUs that have bfloat16, and on CPUs with bfloat16 instructions
    where the probe finds it trains the run's `shape` (model, batch) clearly faster; 32-true elsewhere."""
    if str(requested) in ("16-mixed", "16", "16-true") and machine.on_cpu(accelerator):  # Lightning: bf16, unsaid
        raise SettingError(f"trainer.precision={requested} needs a CUDA GPU (float16 has no CPU support); use "
                           "trainer.precision=bf16-mixed or 32-true on a CPU")  # fmt: skip
    if requested:
        return str(requested)
    if machine.on_cuda(accelerator):
        return "bf16-mixed" if machine.bf16 else "32-true"
    if machine.on_cpu(accelerator) and machine.cpu_bf16 and shape is not None:
        return "bf16-mixed" if bf16_speed(*shape) >= BF16_MARGIN else "32-true"
    return "32-true"


def choose_compile(requested: bool | None, accelerator: str, machine: Machine) -> bool:
    """torch.compile on CUDA GPUs with Triton; not on CPUs, where compiling costs more than a short run wins."""
    return bool(requested) if requested is not None else machine.on_cuda(accelerator) and machine.triton


def probe_key(config: GPTConfig, batch_size: int) -> str:
    """What a probe's result depends on: the processor (its name, flags, CPUs), torch, the model and batch."""
    try:
        name = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(errors="replace"), re.M)[1]
    except (OSError, TypeError):
        name = platform.machine()
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    shape = ",".join(f"{key}={value}" for key, value in sorted(config.to_dict().items()))
    return f"{name.strip()} (flags {flags}, {os.cpu_count()} CPUs)|torch {torch.__version__}|{shape},batch_size={batch_size}"


def known_speed(config: GPTConfig, batch_size: int) -> float | None:
    """How many times as fast bf16 trained this shape here, as measured before; None where it was not."""
    speed = read_cache("cpu_precision.json").get(probe_key(config, batch_size), {}).get("bf16_speed")
    return speed if isinstance(speed, int | float) and speed > 0 else None


def bf16_speed(config: GPTConfig, batch_size: int) -> float:
    """How many times as fast bf16 autocast trains this shape as 32 bits here: kept, or measured now."""
    if (speed := known_speed(config, batch_size)) is not None:
        return speed
    log.info(
        "timing a few training steps of this model in 32-true and bf16-mixed on this CPU, to train in the faster one "
        "(once for this processor and shape: kept in %s)",
        cache_file("cpu_precision.json"),
    )
    fp32, bf16 = time_both(config, batch_size)
    speed = statistics.median(a / b for a, b in zip(fp32, bf16, strict=True))  # pairs taken in turn
    known = read_cache("cpu_precision.json")
    known[probe_key(config, batch_size)] = {
        "fp32_step_s": statistics.median(fp32),
        "bf16_step_s": statistics.median(bf16),
        "bf16_speed": speed,
    }
    write_cache("cpu_precision.json", known)
    return speed


def time_both(config: GPTConfig, batch_size: int) -> tuple[list[float], list[float]]:
    """Seconds of training steps of the shape with AdamW, in float32 and under bfloat16 autocast in turn, on the
    same random tokens, so that both see the same moments of a shared machine; the first of each not counted.
    The run's random streams are left where they were."""
    batch = min(batch_size, max(1, PROBE_TOKENS // config.block_size))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(config).train()
        optimizer = make_adamw(model, 1e-3, 0.1, (0.9, 0.95))
        tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1))

        def step(bf16: bool) -> float:
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return time.perf_counter() - start

        step(False), step(True)  # the warm-up
        fp32, bf16, deadline = [], [], time.perf_counter() + PROBE_SECONDS
        while len(fp32) < MAX_PAIRS and (len(fp32) < MIN_PAIRS or time.perf_counter() < deadline):
            fp32.append(step(False))
            bf16.append(step(True))
    return fp32, bf16


def precision_words(precision: str, left_to_machine: bool, config: GPTConfig, batch_size: int) -> str:
    """Why the run trains in its precision, for its first line."""
    if not left_to_machine:
        return ""
    speed = known_speed(config, batch_size)
    if speed is not None and (speed >= BF16_MARGIN) == (precision == "bf16-mixed"):
        return f" (measured: bf16-mixed {speed:.2f}x as fast on this CPU for this shape)"
    return " (chosen for this machine)"


# ---- the peak FLOP/s behind train/mfu ----------------------------------------------------------------------


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of one device: a GPU's from Lightning's table at the training precision, a CPU's the fastest
    rate seen on it (a half-second matmul the first time, kept, and raised by any faster training since:
    remember_rate), in bfloat16 for a bf16 run; None where it is not known."""
    bf16 = "bf16" in str(precision)
    if device.type == "cuda":
        from lightning.fabric.utilities.throughput import get_available_flops

        dtype = torch.bfloat16 if bf16 else torch.float16 if "16" in str(precision) else torch.float32
        return get_available_flops(device, dtype)
    if device.type != "cpu":
        return None
    seen = read_cache("cpu_peak_flops.json").get(cpu_key(bf16))
    return seen if isinstance(seen, int | float) and seen > 0 else remember_rate(device, precision, matmul_rate(bf16))


def cpu_key(bf16: bool) -> str:
    """What a CPU rate depends on: the processor, its CPUs, torch's threads and version, and the dtype."""
    machine = platform.processor() or platform.machine()
    return f"{machine}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}" + ("|bf16" if bf16 else "")


def matmul_rate(bf16: bool, size: int = 1024, seconds: float = 0.5) -> float:
    """The best matmul rate this process reaches with its torch threads, in float32 or bfloat16."""
    rng = torch.Generator().manual_seed(0)  # its own: a run's random streams must not move
    a, b = (torch.randn(size, size, generator=rng).to(torch.bfloat16 if bf16 else torch.float32) for _ in range(2))
    torch.mm(a, b)  # the kernels and thread pool warmed up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def remember_rate(device: torch.device, precision: str, rate: float) -> float:
    """A CPU rate kept as the fastest seen if it is; returns the fastest seen."""
    if device.type != "cpu":
        return rate
    known, key = read_cache("cpu_peak_flops.json"), cpu_key("bf16" in str(precision))
    seen = known.get(key) if isinstance(known.get(key), int | float) else 0.0
    if rate > seen:
        write_cache("cpu_peak_flops.json", {**known, key: rate})
    return max(rate, seen)
