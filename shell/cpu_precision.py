"""Whether this CPU trains a model of a given shape faster under bfloat16 autocast (trainer.precision=
bf16-mixed) than in 32 bits, measured rather than assumed: a few timed training steps of the shape in
each precision, the first time a processor, torch version and shape are seen, kept in the user's cache
beside the CPU peak (shell.flops.peak_cache). Which one wins depends on the processor's bf16
instructions, the model's width and vocabulary and the batch: one rule measured on one processor
(bf16 from 192 wide) trained at half speed on another."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from model import GPT, GPTConfig
from shell.flops import cpu_flags, peak_cache, write_cache
from training.optim import make_adamw

log = logging.getLogger(__name__)

# bf16-mixed is chosen only when it trains at least this many times as fast as 32-true: near a tie,
# 32 bits keep the exact arithmetic, and a probe of a second or two on a shared machine is noisy.
BF16_MARGIN = 1.1
# The measured steps of both precisions together take about this long (the warm-up is not counted) ...
PROBE_SECONDS = 1.5
# ... but no fewer than MIN_PAIRS, and no more than MAX_PAIRS, steps of each: a shape whose step takes
# seconds is timed for longer (its steps are long enough to time well in two), once for this processor
# and shape.
MIN_PAIRS, MAX_PAIRS = 2, 40
# A batch of more tokens than this is timed on this many tokens' worth of sequences: past a few thousand
# rows both precisions' matrix products run at their full rate, and every cost of a step but the
# optimizer's grows with the tokens, so the ratio is the full batch's, measured in a fraction of the time.
PROBE_TOKENS = 4096


class Measured(NamedTuple):
    """A probe's result: seconds per training step in each precision (medians) and bf16's speed against
    32 bits (the median of the ratios of steps taken in turn), and the precision it chooses."""

    fp32_step_s: float
    bf16_step_s: float
    bf16_speed: float  # how many times as fast bf16 autocast trained: above 1, faster

    @property
    def precision(self) -> str:
        return faster_precision(self.bf16_speed)

    def words(self) -> str:
        """What the run's first line says of the choice."""
        return f"measured: bf16-mixed {self.bf16_speed:.2f}x as fast on this CPU for this shape"


def faster_precision(bf16_speed: float) -> str:
    """bf16-mixed where it trained clearly faster (BF16_MARGIN times as fast or more), else 32-true."""
    return "bf16-mixed" if bf16_speed >= BF16_MARGIN else "32-true"


def bf16_speed(fp32_seconds: list[float], bf16_seconds: list[float]) -> float:
    """How many times as fast bf16 trained, from step times taken in turn (fp32, bf16, fp32, ...): the
    median of each pair's ratio, so a moment when other work held the cores slows both of a pair alike,
    and a step slowed alone is outvoted."""
    return statistics.median(fp32 / bf16 for fp32, bf16 in zip(fp32_seconds, bf16_seconds, strict=True))


def probe_cache(cache_dir: str | os.PathLike | None = None) -> Path:
    """The file that keeps each processor's probes, beside the CPU peaks ($TINYGPT2_CACHE or ~/.cache/tinygpt2)."""
    return peak_cache(cache_dir).with_name("cpu_precision.json")


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), or its architecture where that does not say."""
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(errors="replace"), re.MULTILINE)
    except OSError:
        found = None
    return found[1].strip() if found else platform.machine()


def probe_key(config: GPTConfig, batch_size: int) -> str:
    """What a probe's result depends on: the processor (its name, feature flags and logical CPUs), torch's
    version, and the model's shape and batch. Not torch's thread count: the processes of a multi-process
    CPU run (which Lightning starts with fewer threads each) find the probe the launching process made,
    and all train in the precision it chose."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    shape = ",".join(f"{key}={value}" for key, value in sorted(config.to_dict().items()))
    return (
        f"{cpu_name()} (flags {flags}, {os.cpu_count()} CPUs)|torch {torch.__version__}|{shape},batch_size={batch_size}"
    )


_MEASURED: dict[str, Measured] = {}  # the probes this process found or made, by probe_key


def stored(cache_dir: str | os.PathLike | None = None) -> dict[str, Measured]:
    """The probes the cache file holds; a file (or an entry) that cannot be read holds none."""
    try:
        known = json.loads(probe_cache(cache_dir).read_text())
    except (OSError, ValueError):
        return {}
    found = {}
    for key, entry in known.items() if isinstance(known, dict) else ():
        try:
            measured = Measured(**entry)
        except TypeError:
            continue
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in measured):
            found[key] = measured
    return found


def store(key: str, measured: Measured, cache_dir: str | os.PathLike | None = None) -> None:
    """Keep a probe for later runs; a cache that cannot be written only loses it for next time."""
    known = {k: m._asdict() for k, m in stored(cache_dir).items()}
    known[key] = measured._asdict()
    write_cache(probe_cache(cache_dir), known)


def known(config: GPTConfig, batch_size: int, cache_dir: str | os.PathLike | None = None) -> Measured | None:
    """The probe of this shape on this machine, if one was made (by this process or an earlier run)."""
    key = probe_key(config, batch_size)
    if key not in _MEASURED and key in (found := stored(cache_dir)):
        _MEASURED[key] = found[key]
    return _MEASURED.get(key)


def measured(config: GPTConfig, batch_size: int, cache_dir: str | os.PathLike | None = None) -> Measured:
    """The probe of this shape on this machine: the one kept, or made now (a second or two) and kept."""
    if (found := known(config, batch_size, cache_dir)) is not None:
        return found
    log.info(
        "timing a few training steps of this model in 32-true and bf16-mixed on this CPU, to train in the faster one "
        "(once for this processor and shape: kept in %s)",
        probe_cache(cache_dir),
    )
    result = time_both(config, batch_size)
    _MEASURED[probe_key(config, batch_size)] = result
    store(probe_key(config, batch_size), result, cache_dir)
    return result


def time_both(config: GPTConfig, batch_size: int, seconds: float = PROBE_SECONDS) -> Measured:
    """The model, with AdamW, trained a step at a time in float32 and under bfloat16 autocast (as
    Lightning's bf16-mixed does on a CPU) in turn, on the same random tokens, so both precisions see the
    same moments of a shared machine; the first step of each (kernels made, memory found) is not counted.
    One model for both: the weights stay float32 under autocast, so each step computes as the run's
    would, and the probe takes no more memory than a step of the run. The run's random streams are left
    where they were."""
    batch = min(batch_size, max(1, PROBE_TOKENS // config.block_size))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        trainee = Trainee(config)
        tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1))
        x, y = tokens[:, :-1], tokens[:, 1:]
        for bf16 in (False, True):  # the warm-up
            trainee.step(x, y, bf16)
        fp32: list[float] = []
        half: list[float] = []
        deadline = time.perf_counter() + seconds
        while len(fp32) < MAX_PAIRS and (len(fp32) < MIN_PAIRS or time.perf_counter() < deadline):
            fp32.append(trainee.step(x, y, bf16=False))
            half.append(trainee.step(x, y, bf16=True))
    return Measured(statistics.median(fp32), statistics.median(half), bf16_speed(fp32, half))


class Trainee:
    """A model and its AdamW, trained a step at a time."""

    def __init__(self, config: GPTConfig):
        self.model = GPT(config).train()
        self.optimizer = make_adamw(self.model, 1e-3, 0.1, (0.9, 0.95))

    def step(self, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> float:
        """One training step, in float32 or under bfloat16 autocast; returns the seconds it took."""
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = self.model(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start
