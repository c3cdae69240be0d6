"""The studio's streaming speed: tokens per second that reach a client of studio.py's /api/generate
(each with its probability and ten alternatives, as server-sent events over HTTP), against generate.py
printing the same tokens of the same model.

    python bench/studio.py             # the default model shape (nano, BPE 1280), 500 tokens, 5 rounds
    python bench/studio.py --quick     # 200 tokens, 3 rounds

The model has the default run's shape and random weights (speed does not depend on what it learned),
with a BPE tokenizer trained on Tiny Shakespeare. Both sides sample the same tokens (same seed,
temperature 1); generate.py's figure is its own summary line (model loaded, prompt prefill included),
the studio's is timed at the client from the request to the last event. Rounds alternate between the
two so that machine load falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from checkpoint import STATE_PREFIX, describe_model, save  # noqa: E402
from data.tokenizer import train_bpe  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

PROMPT = "ROMEO:"
SEED = 1


def default_model(folder: Path) -> Path:
    """A checkpoint of the default shape: configs/model/nano.yaml with the default 1280-token BPE."""
    tokenizer = train_bpe([common.shakespeare().read_text(encoding="utf-8")], 1280)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=tokenizer.get_vocab_size()))
    ckpt = {"state_dict": {STATE_PREFIX + k: v for k, v in model.state_dict().items()}}
    ckpt |= describe_model(model.config, tokenizer.to_str(), {})
    path = folder / "model.ckpt"
    save(ckpt, path)
    return path


def generate_py(ckpt: Path, tokens: int) -> float:
    """generate.py's own tokens per second."""
    done = common.run(
        [sys.executable, str(common.ROOT / "generate.py"), "--ckpt", str(ckpt), "--prompt", PROMPT,
         "--max-new-tokens", str(tokens), "--temperature", "1", "--seed", str(SEED)],
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"error: generate.py failed: {done.stderr.strip().splitlines()[-1]}")
    return float(re.search(r"([\d.]+) tokens/s", done.stderr).group(1))


def streamed(address: str, tokens: int) -> float:
    """Tokens per second of /api/generate, counted as their events arrive at this client."""
    body = {"prompt": PROMPT, "max_new_tokens": tokens, "temperature": 1.0, "seed": SEED}
    request = urllib.request.Request(
        address + "/api/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    count = 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            count += line.startswith(b"event: token")
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    tokens, rounds = (200, 3) if args.quick else (500, 5)
    with tempfile.TemporaryDirectory() as folder:
        ckpt = default_model(Path(folder))
        command = [sys.executable, str(common.ROOT / "studio.py"), "--ckpt", str(ckpt), "--port", "0"]
        with common.started(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as studio:
            address = re.search(r"http://\S+", studio.stdout.readline()).group(0)
            streamed(address, 20)  # warm up the server's first request
            ours, theirs = [], []
            for _ in range(rounds):
                theirs.append(generate_py(ckpt, tokens))
                ours.append(streamed(address, tokens))
            common.signal_group(studio, 2)
            studio.communicate()
    ratio = statistics.median(o / t for o, t in zip(ours, theirs, strict=True))
    print(
        f"{tokens} tokens, {rounds} rounds, default model shape (nano, BPE 1280), CPU threads {torch.get_num_threads()}"
    )
    print(f"generate.py       median {statistics.median(theirs):8.1f} tokens/s  {[round(t) for t in theirs]}")
    print(f"studio (streamed) median {statistics.median(ours):8.1f} tokens/s  {[round(o) for o in ours]}")
    print(f"studio / generate.py: {ratio:.2f} (median of the rounds' ratios; target >= 0.9)")


if __name__ == "__main__":
    common.run_benchmark(main)
