"""Generation speed: our KV-cache `generate` against transformers' `generate`, same weights, same process.

    python bench/generate.py            # all three cases (the uncached GPT-2 run takes ~20 minutes on 2 cores)
    python bench/generate.py --quick    # fewer repeats, and the uncached comparison on 300 tokens
    python bench/generate.py --device cuda   # on a GPU: GPT-2 small in float32 and bfloat16

Both models hold the same random weights (ours, exported through model.hf into GPT2LMHeadModel).
Greedy decoding, batch 1, a 16-token prompt; runs alternate between the two so that machine load
falls on both alike. Prints tokens per second, their ratio, and checks the tokens are the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from generation import generate, stream  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.hf import hf_config_dict, to_hf_state_dict  # noqa: E402

PROMPT_TOKENS = 16
NANO = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=1024, vocab_size=65)
GPT2_SMALL = GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)


def twins(config: GPTConfig, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Our GPT and a transformers GPT2LMHeadModel with the same random weights, both in eval mode,
    on `device` in `dtype`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    ours = GPT(config).eval()
    hf_config = {k: v for k, v in hf_config_dict(config).items() if k not in ("architectures", "model_type")}
    hf = GPT2LMHeadModel(GPT2Config(**hf_config)).eval()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), config), strict=False)
    return ours.to(device, dtype), hf.to(device, dtype)


def prompt(config: GPTConfig, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def ours_generate(model: GPT, idx: torch.Tensor, n: int, use_cache: bool = True) -> tuple[torch.Tensor, float]:
    synchronize(idx)
    start = time.perf_counter()
    out = generate(model, idx, n, temperature=0, use_cache=use_cache)
    synchronize(idx)
    return out, time.perf_counter() - start


def synchronize(tensor: torch.Tensor) -> None:
    """Wait for the GPU's queued work, so a timing ends when the work does."""
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)


@torch.no_grad()
def hf_generate(model, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
    synchronize(idx)
    start = time.perf_counter()
    out = model.generate(
        idx,
        attention_mask=torch.ones_like(idx),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    synchronize(idx)
    return out, time.perf_counter() - start


def versus(config: GPTConfig, new_tokens: int, repeats: int, device: str = "cpu", dtype=torch.float32) -> dict:
    ours, hf = twins(config, device=device, dtype=dtype)
    idx = prompt(config).to(device)
    ours_generate(ours, idx, 8)  # warm up both: first calls pay for allocations and kernel choice
    hf_generate(hf, idx, 8)
    ours_times, hf_times, same = [], [], True
    for _ in range(repeats):  # interleaved
        a, t_ours = ours_generate(ours, idx, new_tokens)
        b, t_hf = hf_generate(hf, idx, new_tokens)
        ours_times.append(t_ours)
        hf_times.append(t_hf)
        same &= torch.equal(a, b)
    t_ours, t_hf = statistics.median(ours_times), statistics.median(hf_times)
    return {"ours": new_tokens / t_ours, "hf": new_tokens / t_hf, "ratio": t_hf / t_ours, "same": same, "model": ours}


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second a large tensor copy moves (read + write)."""
    src = torch.empty(megabytes * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def bytes_per_token(model: GPT, context: float) -> float:
    """Bytes one decoding step must read: every weight once, plus the keys and values of `context`
    cached positions in every layer."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = 2 * config.n_layer * context * config.n_embd * 4
    return weights + cache


@torch.no_grad()
def step_times(model: GPT, idx: torch.Tensor, n: int) -> list[float]:
    """Seconds of every decoding step (the first includes the prefill)."""
    times, last = [], time.perf_counter()
    for _ in stream(model, idx, n, temperature=0):
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats; uncached comparison on 300 tokens")
    parser.add_argument("--cases", nargs="+", type=int, default=[1, 2, 3], choices=[1, 2, 3], help="which to run (CPU)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the GPU cases instead")
    args = parser.parse_args()
    repeats = 3 if args.quick else 5
    torch.manual_seed(0)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("error: --device cuda needs a CUDA GPU; this machine has none")
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
        gpu_cases(repeats)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    if 1 in args.cases:
        nano_case(repeats)
    if 2 in args.cases or 3 in args.cases:
        gpt2_cases(repeats, args.cases, args.quick)


def nano_case(repeats: int) -> None:
    print("\n1. nanoGPT CPU shape (4 layers, 4 heads, 128 wide, vocab 65, context 1024), 512 new tokens, greedy")
    r = versus(NANO, 512, repeats)
    print(
        f"   ours {r['ours']:9.1f} tok/s | transformers {r['hf']:9.1f} tok/s | ratio {r['ratio']:.2f}x (target >= 4) | same tokens: {r['same']}"
    )


def gpu_cases(repeats: int) -> None:
    """GPT-2 small on one GPU, batch 1, greedy: ours (one CUDA graph replay per token) against
    transformers' generate, in float32 and in bfloat16 (which must be at least as fast)."""
    rates = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        print(f"\nGPU. GPT-2 small shape (124M), {name}, 256 new tokens, greedy, batch 1")
        r = versus(GPT2_SMALL, 256, repeats, device="cuda", dtype=dtype)
        rates[name] = r["ours"]
        print(
            f"   ours {r['ours']:9.1f} tok/s (target >= 2000) | transformers {r['hf']:9.1f} tok/s | "
            f"ratio {r['ratio']:.2f}x (target >= 10) | same tokens: {r['same']}"
        )
    print(f"\n   bfloat16 / float32: {rates['bfloat16'] / rates['float32']:.2f} (target >= 1)")


def gpt2_cases(repeats: int, cases: list[int], quick: bool) -> None:
    if 2 not in cases:
        torch.manual_seed(0)  # the weights twins() makes
        model = GPT(GPT2_SMALL).eval()
    else:
        model = gpt2_versus(repeats)
    if 3 in cases:
        gpt2_long(model, quick)


def gpt2_versus(repeats: int) -> GPT:
    print("\n2. GPT-2 small shape (124M, vocab 50257, context 1024), 256 new tokens, greedy")
    r = versus(GPT2_SMALL, 256, max(2, repeats - 2))
    bandwidth = copy_bandwidth()
    per_token = bytes_per_token(r["model"], PROMPT_TOKENS + 256 / 2)
    bound = bandwidth / per_token
    print(
        f"   ours {r['ours']:9.1f} tok/s | transformers {r['hf']:9.1f} tok/s | ratio {r['ratio']:.2f}x (target >= 1.3) | same tokens: {r['same']}"
    )
    print(
        f"   memory: {per_token / 1e6:.0f} MB read per token, copy bandwidth {bandwidth / 1e9:.1f} GB/s -> bound {bound:.1f} tok/s; "
        f"ours reaches {r['ours'] / bound:.0%} of it"
    )
    return r["model"]


def gpt2_long(model: GPT, quick: bool) -> None:
    print("\n3. GPT-2 small shape, 1000 new tokens: no slowdown as the cache fills; cached against uncached")
    idx = prompt(GPT2_SMALL)
    times = step_times(model, idx, 1000)
    first, last = statistics.mean(times[1:101]), statistics.mean(times[-100:])  # times[0] is the prefill
    print(
        f"   per token: first 100 {first * 1e3:.1f} ms, last 100 {last * 1e3:.1f} ms, ratio {last / first:.2f} (target <= 1.5)"
    )
    n = 300 if quick else 1000
    _, cached = ours_generate(model, idx, n, use_cache=True)
    _, uncached = ours_generate(model, idx, n, use_cache=False)
    print(
        f"   {n} tokens: cached {cached:.1f}s, uncached {uncached:.1f}s, ratio {uncached / cached:.1f}x (target >= 10)"
    )


if __name__ == "__main__":
    common.run_benchmark(main)
