"""Model FLOPs utilisation: the FLOPs a model needs per token, and the peak of the device it runs on."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from model import GPTConfig

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


def flops_per_token(config: GPTConfig, training: bool = True) -> float:
    """Matmul FLOPs per token: 6 per weight for a training step (2 forward, 4 backward) plus the
    attention products (PaLM's estimate: 12 * n_layer * n_embd * block_size). Embedding lookups
    cost nothing; the tied lm_head is a real matmul and counts."""
    C, L = config.n_embd, config.n_layer
    per_block = 12 * C * C  # c_attn 3C^2, attn c_proj C^2, c_fc 4C^2, mlp c_proj 4C^2
    weights = L * per_block + C * config.vocab_size
    attention = 2 * 2 * L * C * config.block_size  # q @ k^T and att @ v: C * T multiply-adds each
    forward = 2 * weights + attention
    return 3 * forward if training else forward


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of a known GPU at the precision Lightning trains with; None when unknown."""
    for key, (half, tf32, fp32) in GPU_PEAK_TFLOPS:
        if key in device_name:
            if "16" in precision:
                return half * 1e12
            tf32_on = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
            return (tf32 if tf32_on else fp32) * 1e12
    return None


def measure_cpu_peak_flops(size: int = 1024, seconds: float = 0.5) -> float:
    """Best fp32 matmul rate this process reaches with its torch threads."""
    rng = torch.Generator().manual_seed(0)  # its own: a run's random streams must not move
    a, b = torch.randn(size, size, generator=rng), torch.randn(size, size, generator=rng)
    torch.mm(a, b)  # warm up the kernels and thread pool
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def cpu_peak_flops(cache_dir: str | os.PathLike | None = None) -> float:
    """The CPU matmul peak: the best rate measured so far on this machine, thread count and torch
    version. Each call measures once more (half a second) and keeps the best, so a first measurement
    taken while other work held the cores (which would put MFU above 100%) does not stay."""
    root = Path(cache_dir or os.environ.get("TINYGPT2_CACHE", "~/.cache/tinygpt2")).expanduser()
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{torch.get_num_threads()}|{torch.__version__}"
    cache = root / "cpu_peak_flops.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    measured = measure_cpu_peak_flops()
    if measured > known.get(key, 0.0):
        known[key] = measured
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=2))
            tmp.replace(cache)
        except OSError:
            pass  # a read-only cache only loses the best figure for next time
    return known[key]


def device_peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of one device: a GPU from the table, a CPU measured; None when not known."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
    if device.type == "cpu":
        return cpu_peak_flops()
    return None
