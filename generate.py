"""Sample text from a trained model: python generate.py --prompt "ROMEO:" [--ckpt RUN_OR_CKPT] ...

Loads the newest run (outputs/latest) unless --ckpt names a run folder, a .ckpt file or a Hugging
Face GPT-2 folder. The prompt runs through the model once to fill the KV cache; then one token per
step, printed as it comes. Needs neither Hydra nor the training data: the checkpoint carries the
tokenizer.
"""

from __future__ import annotations

if __name__ == "__main__":
    from shell.startup import start_up

    start_up()  # before the imports: Ctrl-C stops at once, no garbage collection until the model is loaded

import argparse
import itertools
import math
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from checkpoint import CheckpointError, given_or_newest, load_checkpoint
from generation.session import Completion, PromptError, Sampling, Session, not_utf8
from generation.text import token_label, visible
from shell.output import OutputError, cannot_write
from shell.programs import (
    Parser,
    Terminated,
    exit_quietly,
    given_path,
    number,
    run_program,
    say_what_it_learned,
    stopped_status,
    stops_raised,
    whole_number,
)
from shell.startup import started


class UsageError(ValueError):
    """Bad command-line input; the message says what to change."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description="Sample text from a tinygpt2 checkpoint or a Hugging Face GPT-2 folder.")
    p.add_argument("--prompt", default="", help="text to continue (empty: start from <|endoftext|>)")
    p.add_argument(
        "--ckpt",
        type=given_path,
        default=None,
        help="a run folder, .ckpt file or Hugging Face folder (default: outputs/latest)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=whole_number,
        default=500,
        help="tokens to generate per sample; may exceed the context (default 500)",
    )
    p.add_argument("--temperature", type=number, default=0.8, help="0 = greedy; higher = more varied (default 0.8)")
    p.add_argument("--top-k", type=whole_number, default=None, help="sample only among the k most likely tokens")
    p.add_argument("--top-p", type=number, default=None, help="sample only among the most likely tokens holding mass p")
    p.add_argument(
        "--num-samples", type=whole_number, default=1, help="samples, generated together as one batch (default 1)"
    )
    p.add_argument("--seed", type=whole_number, default=1337, help="same seed, same text (sample i uses seed + i)")
    p.add_argument(
        "--stop", action="append", default=[], metavar="STRING", help="stop a sample when it writes STRING (repeatable)"
    )
    p.add_argument(
        "--interactive", action="store_true", help="read prompts from stdin, one per line, keeping the model loaded"
    )
    p.add_argument(
        "--attention-png",
        type=given_path,
        default=None,
        metavar="FILE",
        help="draw the last layer's attention of sample 1",
    )
    p.add_argument(
        "--no-cache", action="store_true", help="recompute the whole window every step (slow; for comparison)"
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps, or auto (default)")
    return p.parse_args(argv)


MAX_NEW_TOKENS = 1_000_000  # the tokens of a sample are kept in memory; hours of sampling on a CPU
MAX_SAMPLES = 1024  # one batch: each sample has its own KV cache
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit integer


def given(count: int) -> str:
    """A count as a message quotes it: 1e100 as 1e+100, not as its hundred digits."""
    return str(count) if abs(count) < 10**15 else f"{float(count):.3g}"


def check_args(args: argparse.Namespace) -> None:
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise UsageError(f"--max-new-tokens must be from 1 to {MAX_NEW_TOKENS:,}, got {given(args.max_new_tokens)}")
    if not 1 <= args.num_samples <= MAX_SAMPLES:
        raise UsageError(
            f"--num-samples must be from 1 to {MAX_SAMPLES} (one batch), got {given(args.num_samples)}; "
            "for more, run again with another --seed"
        )
    if not 0 <= args.seed <= MAX_SEED - (args.num_samples - 1):
        raise UsageError(f"--seed must be from 0 to {MAX_SEED - (args.num_samples - 1)}, got {args.seed}")
    if not 0 <= args.temperature < math.inf:  # NaN too
        raise UsageError(f"--temperature must be 0 (greedy) or a positive number, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k must be at least 1 (leave it out to keep every token), got {args.top_k}")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}; 1 keeps every token")
    if any(stop == "" for stop in args.stop):
        raise UsageError("--stop needs a non-empty string, e.g. --stop $'\\n\\n'")
    for stop in args.stop:
        wrong = not_utf8(stop)
        if wrong:  # the samples are text: a stop string of other bytes would never be met
            raise UsageError(f"a --stop string is not valid UTF-8: {wrong}; give it as UTF-8 text")
    if args.attention_png is not None:
        check_output_file(args.attention_png)


def check_output_file(path: Path) -> None:
    """Fail now, before any work, if the picture could not be written later; make no folder yet."""
    if path.suffix.lower() != ".png":
        raise UsageError(f"--attention-png {path}: the picture is a PNG; give a file name ending in .png")
    if path.is_dir():
        raise UsageError(f"--attention-png {path} is a folder; give a file name such as {path / 'attention.png'}")
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UsageError(f"--attention-png {path}: {blocker} is a file, not a folder; choose another place")
    if path.exists() or path.is_symlink():
        raise UsageError(
            f"--attention-png {path} already exists, and a picture is never drawn over a file; give another "
            "name, or remove it first to draw it again"
        )
    nearest = next(p for p in (path.parent, *path.parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=nearest):
            pass
    except OSError as err:
        raise UsageError(
            f"--attention-png {path}: cannot write in {nearest} ({err.strerror}); choose a writable folder"
        ) from None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {name} is not a device generate.py runs on; use cpu, cuda, cuda:N, mps or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: this machine has no CUDA GPU; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: there are only {torch.cuda.device_count()} GPU(s); use cuda:0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name}: MPS is not available here; use --device cpu")
    return device


def generate_text(
    session: Session, prompt: str, args: argparse.Namespace, generators, fresh_seeds=True, out=None
) -> Completion:
    """Sample args.num_samples continuations of prompt in one batch, row i drawing with
    generators[i]; a single sample streams to out (default stdout). `fresh_seeds`: the generators
    have drawn nothing yet, so a batch's headers can name the seed that repeats each sample."""
    out = out or sys.stdout
    shown = visible if is_terminal(out) else str  # a file or a pipe gets the text as it is
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.stop, not args.no_cache)
    live = args.num_samples == 1  # one sample prints token by token; a batch prints each sample at the end
    session.encode(prompt)  # a refused prompt prints nothing
    if live:
        out.write(shown(prompt))
        out.flush()

    def show(text: str) -> None:
        out.write(shown(text))
        out.flush()

    try:
        result = session.complete(prompt, sampling, args.num_samples, generators, on_text=show if live else None)
    except (KeyboardInterrupt, Terminated):
        if live:  # the cut sample's line ends as a finished one's does, so the next answer starts a line
            out.write("\n")
            out.flush()
        raise
    if live:
        out.write("\n")
    else:
        for row, text in enumerate(result.texts):
            seed = f" (seed {args.seed + row})" if fresh_seeds else ""
            out.write(f"{'-' * 20} sample {row + 1}{seed} {'-' * 20}\n{shown(prompt + text)}\n")
    out.flush()
    return result


def is_terminal(out) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):  # stdout closed (`>&-`, a None stream), or a stream without one
        return False


def summary(result: Completion, args: argparse.Namespace, block_size: int, source: Path | None) -> str:
    rate = result.tokens / max(result.seconds, 1e-9)
    cache = "no cache" if args.no_cache else f"KV cache {result.cache_length}/{block_size} positions"
    seen = f", of which the context holds the last {block_size}" if len(result.prompt_ids) > block_size else ""
    return (
        f"[{result.tokens} tokens generated ({args.num_samples} sample(s)) in {result.seconds:.2f}s, {rate:.1f} tokens/s; "
        f"prompt {len(result.prompt_ids)} tokens{seen}; {cache}; {source}]"
    )


def save_attention(model, tokenizer: Tokenizer, result: Completion, path: Path, replace: bool = False) -> str:
    """Draw the last layer's attention over sample 1's last window of tokens; returns a note for stderr.
    `replace`: the file at path is the picture this session drew for an earlier prompt."""
    from generation.attention_plot import save_attention_png

    ids = result.prompt_ids + result.first_sample_ids
    window = ids[-model.config.block_size :]
    prompt_len = len(result.prompt_ids) - (len(ids) - len(window))
    idx = torch.tensor([window], dtype=torch.long, device=model.transformer.wte.weight.device)
    weights = model.attention_weights(idx)[-1][0]  # (n_head, T, T)
    labels = [token_label(tokenizer, t) for t in window]
    title = f"layer {model.config.n_layer - 1} attention, {len(window)} tokens (prompt {max(prompt_len, 0)})"
    try:
        save_attention_png(weights, labels, path, title=title, prompt_len=prompt_len, replace=replace)
    except FileExistsError:
        raise OutputError(
            f"--attention-png {path} appeared while the text was generated (another process?); it is kept and "
            "nothing was written; give another name"
        ) from None
    except OSError as err:  # a full disk: the picture is written whole or not at all, so nothing is left
        raise OutputError(f"{cannot_write(f'--attention-png {path}', err)} (nothing was written)") from None
    cropped = f" (the last {len(window)} of {len(ids)} tokens: the context window)" if len(window) < len(ids) else ""
    return f"[attention of the last layer written to {path}{cropped}]"


def main(argv: list[str] | None = None) -> int:
    """Run the command line; bad input ends with one `error:` line on stderr and exit status 1."""
    try:
        # from here Ctrl-C stops a sample (see the top), and a `kill` stops the run as Ctrl-C does: no
        # picture half drawn
        with stops_raised():
            args = parse_args(argv)
            return run_program(
                lambda: run(args),
                UsageError,
                PromptError,
                CheckpointError,
                less="ask for fewer --num-samples or --max-new-tokens",
            )
    except (KeyboardInterrupt, Terminated) as stop:
        print(file=sys.stderr)
        return stopped_status(stop)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    device = pick_device(args.device)
    loaded = load_checkpoint(given_or_newest(args.ckpt))
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise CheckpointError(f"{loaded.path} carries no tokenizer, so its tokens cannot be turned into text")
    model = loaded.model.to(device)
    session = Session(model, tokenizer, loaded.eos_token_id)
    started()  # (shell.startup)

    # sample i draws from its own generator, seeded seed + i once: in an interactive session the
    # first answer is what a one-off run prints, and later ones go on drawing, so that asking
    # again gives a new sample while the whole session stays repeatable
    generators = [torch.Generator(device=device).manual_seed(args.seed + i) for i in range(args.num_samples)]
    prompts = iter([args.prompt])
    if args.interactive:  # --prompt, if given, is answered first
        prompts = itertools.chain([args.prompt] if args.prompt else [], read_prompts())
    # Ctrl-C stops one sample where someone types the prompts and is asked for the next; prompts read
    # from a file or a pipe have no one to ask, so there it ends the run, as it ends a one-off run
    stop_one = args.interactive and typed_at_terminal()
    fresh = True  # the generators have drawn nothing yet (a refused prompt draws nothing)
    unsaid = True  # what the model learned, if it is not what its run asked for, is said before its first text
    drawn = False  # the --attention-png file is this session's picture, redrawn for each prompt
    for prompt in prompts:
        try:
            if unsaid:
                session.encode(prompt)  # a refused prompt is said alone
                say_what_it_learned(loaded.config)
                unsaid = False
            result = generate_text(session, prompt, args, generators, fresh_seeds=fresh)
        except KeyboardInterrupt:
            if not stop_one:
                raise
            print("[stopped]" if args.num_samples == 1 else "\n[stopped]", file=sys.stderr)
            fresh = False
            continue
        except PromptError as err:
            if not args.interactive:
                raise
            print(f"error: {err}", file=sys.stderr)
            continue
        fresh = False
        print(summary(result, args, model.config.block_size, loaded.path), file=sys.stderr)
        if args.attention_png is not None:
            print(save_attention(model, tokenizer, result, args.attention_png, replace=drawn), file=sys.stderr)
            drawn = True
    return 0


def read_prompts():
    """Prompts typed on stdin, one a line (`\\n` in a line is a line break), until end of input
    (Ctrl-D) or Ctrl-C."""
    if sys.stdin is None:  # started with stdin closed (`<&-`): no lines, as from an empty file
        return
    tty = typed_at_terminal()
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 reach the prompt check, which names them
        sys.stdin.reconfigure(errors="surrogateescape")
    if tty:
        print(
            "type a prompt and press Enter; \\n makes a line break, Ctrl-C stops a sample, Ctrl-D quits",
            file=sys.stderr,
        )
    for count in itertools.count():
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            if tty:  # Ctrl-D after "> ": the shell's prompt comes on a line of its own
                print(file=sys.stderr)
            return
        if count == 0:  # a byte-order mark, which some editors put at the start of a UTF-8 file, is no text
            line = line.removeprefix("\ufeff")
        prompt = line.rstrip("\r\n").replace("\\n", "\n")
        if prompt:
            yield prompt


def typed_at_terminal() -> bool:
    """Prompts come from someone at a terminal (not a file, a pipe or a closed stdin)."""
    return sys.stdin is not None and sys.stdin.isatty()


if __name__ == "__main__":
    exit_quietly(main())
