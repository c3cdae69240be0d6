"""Sample text from a trained model: python generate.py --prompt "ROMEO:" [--ckpt RUN_OR_CKPT] ...

Loads the newest run (outputs/latest) unless --ckpt names a run folder or a .ckpt file. The prompt
runs through the model once to fill the KV cache; then one token per step, printed as it comes.
Needs neither Hydra nor the training data: the checkpoint carries the tokenizer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from model.checkpoint import CheckpointError, load_checkpoint
from model.sampling import check_sampling

DEFAULT_RUN = Path("outputs/latest")
EOT = "<|endoftext|>"


class UsageError(ValueError):
    """Bad command-line input; the message says what to change."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Sample text from a tinygpt2 checkpoint.")
    p.add_argument("--prompt", default="", help="text to continue (empty: start from <|endoftext|>)")
    p.add_argument("--ckpt", type=Path, default=None, help="a run folder or .ckpt file (default: outputs/latest)")
    p.add_argument("--max-new-tokens", type=int, default=500, help="tokens to generate per sample (default 500)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; higher = more varied (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample only among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample only among the most likely tokens holding mass p")
    p.add_argument("--num-samples", type=int, default=1, help="samples, generated together as one batch (default 1)")
    p.add_argument("--seed", type=int, default=1337, help="same seed, same text (sample i uses seed + i)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole window every step (slow; for comparison)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps, or auto (default)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be at least 1, got {args.num_samples}")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        raise UsageError(f"--{str(err).replace('_', '-')}") from None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: this machine has no CUDA GPU; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name}: MPS is not available here; use --device cpu")
    return device


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    if prompt:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        if ids:
            return ids
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise UsageError("the prompt is empty and this tokenizer has no <|endoftext|> token to start from; give --prompt")
    return [eot]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    device = pick_device(args.device)
    loaded = load_checkpoint(checkpoint_path(args))
    if loaded.tokenizer_json is None:
        raise CheckpointError(f"{loaded.path} carries no tokenizer, so its tokens cannot be turned into text")
    tokenizer = Tokenizer.from_str(loaded.tokenizer_json)
    model = loaded.model.to(device)
    eot = tokenizer.token_to_id(EOT)

    prompt_ids = encode_prompt(tokenizer, args.prompt)
    idx = torch.tensor([prompt_ids] * args.num_samples, dtype=torch.long, device=device)
    generators = [torch.Generator(device=device).manual_seed(args.seed + i) for i in range(args.num_samples)]
    streams = [DecodeStream(skip_special_tokens=True) for _ in range(args.num_samples)]
    texts = [args.prompt for _ in range(args.num_samples)]
    finished = [False] * args.num_samples
    live = args.num_samples == 1  # one sample prints token by token; a batch prints each sample at the end
    if live:
        print(args.prompt, end="", flush=True)

    started, generated = time.perf_counter(), 0
    for step_tokens in model.stream(
        idx, args.max_new_tokens, args.temperature, args.top_k, args.top_p, use_cache=not args.no_cache, generator=generators
    ):
        generated += 1
        for row, token in enumerate(step_tokens.tolist()):
            if finished[row]:
                continue
            if token == eot:
                finished[row] = True
                continue
            piece = streams[row].step(tokenizer, token)
            if piece:
                texts[row] += piece
                if live:
                    print(piece, end="", flush=True)
        if all(finished):
            break
    elapsed = time.perf_counter() - started

    if live:
        print()
    else:
        for row, text in enumerate(texts):
            print(f"{'-' * 20} sample {row + 1} (seed {args.seed + row}) {'-' * 20}")
            print(text)
    print(
        f"[{generated} tokens x {args.num_samples} sample(s) in {elapsed:.2f}s, "
        f"{generated * args.num_samples / max(elapsed, 1e-9):.1f} tokens/s; prompt {len(prompt_ids)} tokens; "
        f"{'no cache' if args.no_cache else 'KV cache'}; {loaded.path}]",
        file=sys.stderr,
    )
    return 0


def checkpoint_path(args: argparse.Namespace) -> Path:
    if args.ckpt is not None:
        return args.ckpt
    if DEFAULT_RUN.exists():
        return DEFAULT_RUN
    raise UsageError(f"no run found at {DEFAULT_RUN}; train one with `python train.py` or pass --ckpt RUN_FOLDER")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (UsageError, CheckpointError) as err:
        sys.exit(f"error: {err}")
