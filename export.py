"""Export a checkpoint as a Hugging Face GPT-2 folder: python export.py --ckpt RUN_OR_CKPT --out DIR

The folder is written by transformers' own `save_pretrained` (model, generation config and tokenizer,
with <|endoftext|> as its pad token so batches work) plus a model card, README.md; it loads with
`GPT2LMHeadModel.from_pretrained(DIR)`, `AutoTokenizer.from_pretrained(DIR)` or
`pipeline("text-generation", model=DIR)`. Before the folder is put in place, transformers loads it and
its logits on a sample text are compared with ours; a difference above 1e-4 fails the export and
nothing is written. `--push-to-hub REPO` then uploads the folder with huggingface_hub.
"""

from __future__ import annotations

if __name__ == "__main__":
    from shell.startup import start_up

    start_up(pause_gc=False)  # before the imports: Ctrl-C stops at once

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer

from checkpoint import CheckpointError, Loaded, given_or_newest, load_checkpoint
from data.tokenizer import EOT, UNK
from data.writes import making_folders
from model import GPT
from model.hf import hf_config_dict, to_hf_state_dict
from shell.folders import RunFolder
from shell.output import OutputError, cannot_write
from shell.programs import (
    STOPS,
    Parser,
    Terminated,
    exit_quietly,
    given_path,
    run_program,
    stopped_status,
    stops_raised,
)

TOLERANCE = 1e-4
FILES = (
    "README.md",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
CARD_TAG = "tinygpt2"  # in the model card's tags: marks a README.md that an export wrote
SAMPLE_TEXT = (
    "First, the model reads this text; then transformers reads it too, and both must agree.\n"
    "Numbers such as 1024 and 3.14, quotes 'like these', accents (café, naïve) and arrows (→).\n\n"
    "KING: What say you, my lord? Speak plainly, and be brief.\n"
)


class ExportError(ValueError):
    """An export that cannot be done; the message says why and what to do."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description="Write a checkpoint as a Hugging Face GPT-2 folder and check it with transformers.")
    p.add_argument(
        "--ckpt",
        type=given_path,
        default=None,
        help="a run folder, .ckpt file or Hugging Face folder (default: outputs/latest)",
    )
    p.add_argument("--out", type=given_path, required=True, help="the folder to write; must be new or empty")
    p.add_argument("--force", action="store_true", help="replace --out even if it already holds a Hugging Face model")
    p.add_argument("--push-to-hub", metavar="REPO", default=None, help="then upload the folder to this Hub repository")
    return p.parse_args(argv)


def check_hub_login(repo: str | None) -> None:
    """Fail before any work if an upload was asked for and could not be made."""
    if repo is None:
        return
    if not re.fullmatch(r"[\w.-]+/[\w.-]+|[\w.-]+", repo):
        raise ExportError(f"--push-to-hub {repo} is not a repository name; use NAME or USER/NAME")
    from huggingface_hub import get_token

    if get_token() is None:
        raise ExportError("--push-to-hub needs a Hugging Face login; run `hf auth login` or set HF_TOKEN")


def push_to_hub(out: Path, repo: str) -> str:
    """Upload the exported folder to repo (made if missing); returns its address."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        url = api.create_repo(repo, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=out, commit_message="Upload a model exported by tinygpt2")
    except Exception as err:  # network and Hub errors come as many types; the folder is written either way
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ExportError(
            f"{out} is written, but uploading it to {repo} failed ({reason}); "
            f"upload it later with `hf upload {repo} {out}`"
        ) from None
    return str(url)


WORK_ENTRY = re.compile(r"\.export\.(partial|replaced)-(\d+)")  # an export's own, inside an existing --out


def entries(out: Path) -> list[Path]:
    """What --out holds, less the unfinished work of exports into it."""
    return sorted(p for p in out.iterdir() if not WORK_ENTRY.fullmatch(p.name))


def through_links(out: Path) -> Path:
    """--out, or the folder it names when it is a link (written through, into that folder)."""
    try:
        real = out.resolve()
    except (OSError, RuntimeError):  # links that lead back to themselves (RuntimeError before Python 3.13)
        raise ExportError(f"--out {out} goes through a loop of symbolic links; give another folder") from None
    return real if out.is_symlink() else out


def check_destination(out: Path, ckpt: Path, force: bool) -> None:
    """Refuse, before any work, destinations that would lose something or cannot be written."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a folder")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ExportError(f"--out {out}: {blocker} is a file, not a folder; cannot write there")
    if ckpt.exists() and (out.resolve() == ckpt.resolve() or out.resolve() in ckpt.resolve().parents):
        raise ExportError(f"--out {out} holds the checkpoint being exported; choose another folder")
    if out.is_dir() and entries(out):
        if not force:
            try:
                check_replaceable(out)
            except ExportError:  # files of someone's own: --force would not replace them either
                raise ExportError(f"--out {out} is not empty and holds no model; choose a new folder") from None
            raise ExportError(
                f"--out {out} is not empty; choose a new folder, or pass --force to replace the model in it"
            )
        check_replaceable(out)


# What a folder may hold for --force to replace it: this export's files (its README.md only if it is an
# export's model card), or a GPT-2 that transformers saved.
MODEL_FILES = {
    *(set(FILES) - {"README.md"}),
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
}
MODEL_SHARD = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")


def is_model_card(file: Path) -> bool:
    """A README.md that an export wrote: its front matter carries the CARD_TAG tag."""
    try:
        front = file.read_text(encoding="utf-8").split("\n---", 1)[0]
    except (OSError, UnicodeDecodeError):
        return False
    return front.startswith("---") and re.search(rf"tags:.*\b{CARD_TAG}\b", front) is not None


def check_replaceable(out: Path) -> None:
    """--force replaces a folder only when all it holds is a Hugging Face model's files; anything else
    (the user's own files, a config.json that describes no model) would be lost, so it is refused."""
    for entry in entries(out):
        if entry.name == "README.md" and is_model_card(entry):
            continue
        if entry.is_dir() or not (entry.name in MODEL_FILES or MODEL_SHARD.fullmatch(entry.name)):
            shown = f"{entry.name}/" if entry.is_dir() else entry.name
            raise ExportError(
                f"--out {out} holds {shown}, which is not a Hugging Face model's file; --force replaces "
                "only a folder of model files, and would lose it. Choose another folder"
            )
    try:
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    is_model = isinstance(config, dict) and "model_type" in config
    if not is_model:
        raise ExportError(
            f"--out {out}: its config.json describes no model (no model_type); --force replaces only a "
            "Hugging Face model folder, and would lose it. Choose another folder"
        )


def write_folder(folder: Path, loaded: Loaded, tokenizer: Tokenizer, name: str) -> None:
    """The model, its generation config and tokenizer through transformers' save_pretrained, and a card."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = loaded.model
    eot = tokenizer.token_to_id(EOT)
    fields = {k: v for k, v in hf_config_dict(model.config, eot).items() if k not in ("model_type", "architectures")}
    hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields, pad_token_id=eot)).eval()
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    hf_model.load_state_dict(to_hf_state_dict(state, model.config), strict=False)  # lm_head is tied to wte
    # generation stays inside the context: past n_positions GPT-2's position table has no row
    hf_model.generation_config = transformers.GenerationConfig(
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, max_length=model.config.block_size
    )
    hf_model.save_pretrained(folder)
    unk = UNK if tokenizer.token_to_id(UNK) is not None else EOT  # the char tokenizer has a token of its own
    specials = {"bos_token": EOT, "eos_token": EOT, "unk_token": unk, "pad_token": EOT} if eot is not None else {}
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(loaded.tokenizer_json),
        model_max_length=model.config.block_size,
        padding_side="left",  # a batch of prompts ends together, where generation goes on
        clean_up_tokenization_spaces=False,  # decode gives back exactly the text that was encoded
        **specials,
    )
    hf_tokenizer.save_pretrained(folder)
    for extra in set(p.name for p in folder.iterdir()) - set(FILES):  # e.g. special_tokens_map.json
        (folder / extra).unlink()
    (folder / "README.md").write_text(model_card(loaded, name), encoding="utf-8")
    umask = os.umask(0)
    os.umask(umask)
    for name in FILES:  # safetensors writes owner-only files; make them as readable as the others
        os.chmod(folder / name, 0o666 & ~umask)


def model_card(loaded: Loaded, name: str) -> str:
    """README.md for the Hub: what the model is, what it learnt from, how to load it, and its limits.
    `name`: the folder's. Paths of this machine are named by their last part only."""
    c, settings = loaded.model.config, loaded.config or {}
    data, tokenizer = settings.get("data") or {}, settings.get("tokenizer") or {}
    result = run_result(loaded.path)
    max_steps = settings.get("trainer", {}).get("max_steps")
    # result.json scores the run's last weights: quoted only for a checkpoint of those
    final = bool(result.get("finished")) and loaded.step is not None and loaded.step == max_steps
    metrics = (result.get("metrics") or {}) if final else {}
    loss, bpc = metrics.get("val/loss"), metrics.get("val/bpc")
    start = settings.get("init_from")
    trained = f"Fine-tuned with tinygpt2 from {last_part(start)}" if start else "Trained with tinygpt2"
    if data:
        shakespeare = data.get("source") == "shakespeare" and not data.get("path")
        trained += f" on {'Tiny Shakespeare' if shakespeare else last_part(data.get('path') or data.get('name')) or data.get('source')}"
    if loaded.step:
        trained += f" for {loaded.step} step{'s' if loaded.step != 1 else ''}" + (
            "" if final or not max_steps else f" (of the run's {max_steps})"
        )
    scores = f" Final validation loss {loss:.4f} nats per token, {bpc:.4f} bits per character." if loss and bpc else ""
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [gpt2, {CARD_TAG}]
---

# {name}

A GPT-2 language model: {c.n_layer} layers, {c.n_head} heads, {c.n_embd} wide, {loaded.model.num_parameters():,}
parameters, a context of {c.block_size} tokens and a vocabulary of {c.vocab_size} tokens
({tokenizer_words(tokenizer)}; `<|endoftext|>` ends a text and pads a batch).
{trained}.{scores}

## Use

```python
from transformers import pipeline

generate = pipeline("text-generation", model="path/to/{name}")
print(generate(["ROMEO:", "JULIET:"], max_new_tokens=20, do_sample=True))
```

## Limits

- The context is {c.block_size} tokens: the prompt and the new tokens together must fit, since GPT-2's
  position table has no row past it (transformers raises an IndexError). `generation_config.json`
  sets `max_length` to {c.block_size}; with `max_new_tokens`, keep the prompt short enough.
- A small model trained on one text: it writes in the manner of that text and knows nothing else.
"""


def tokenizer_words(tokenizer: dict) -> str:
    """The run's tokenizer settings, as the model card names the tokenizer."""
    kind = tokenizer.get("kind")
    if kind == "bpe":
        return "a byte-level BPE tokenizer learnt from the training text"
    if kind == "char":
        return "one token per character of the training text"
    if kind == "pretrained" and tokenizer.get("path"):
        return f"the tokenizer of {last_part(tokenizer['path'])}"
    return "its own tokenizer"


def last_part(path: str | None) -> str | None:
    """A local path's last part (a file, a folder, a glob's pattern); a Hub name as it is."""
    if not path:
        return path
    return Path(path).name if os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path) else path


def run_result(checkpoint: Path | None) -> dict:
    """The result.json of the run a checkpoint belongs to (whether it finished, its final metrics), if any."""
    if checkpoint is None:
        return {}
    for folder in (RunFolder(checkpoint.parent), RunFolder(checkpoint.parent.parent)):
        if (result := folder.read_result()) and isinstance(result, dict):
            return result
    return {}


def sample_ids(tokenizer: Tokenizer, length: int) -> list[int]:
    """The sample text's tokens, repeated to fill `length` positions."""
    ids = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False).ids
    return (ids * (length // max(1, len(ids)) + 1))[:length]


def compare_logits(folder: Path, model: GPT, tokenizer: Tokenizer) -> tuple[float, int]:
    """Largest absolute logit difference between our model and transformers' load of folder, over a
    full context of sample text; and the number of tokens compared. Also checks that transformers'
    tokenizer from the folder encodes the sample exactly as ours does."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ours = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False).ids
    theirs = hf_tokenizer(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
    if ours != theirs:
        raise ExportError(f"transformers' tokenizer from {folder} encodes the sample text differently from ours")
    ids = torch.tensor([sample_ids(tokenizer, model.config.block_size)])
    model = model.float().cpu().eval()
    with torch.no_grad():
        difference = (model(ids)[0] - hf_model(ids).logits).abs().max().item()
    return difference, ids.numel()


def remove_left_behind(out: Path) -> None:
    """Remove the unfinished folders that exports to `out` killed outright (SIGKILL, a power cut) left
    beside it or in it: those of processes no longer running (and any of this process id, from an
    earlier one)."""
    beside = list(out.parent.glob(f".{glob.escape(out.name)}.partial-*"))
    inside = [p for p in out.iterdir() if WORK_ENTRY.fullmatch(p.name)] if out.is_dir() else []
    for staging in beside + inside:
        pid = staging.name.rsplit("-", 1)[1]
        if pid.isdigit() and (int(pid) == os.getpid() or not process_exists(int(pid))):
            shutil.rmtree(staging, ignore_errors=True)


def staging_for(out: Path) -> Path:
    """Where the folder is written before it is put in place: on the same file system as its place, so
    that putting it there is a rename. In --out itself when that exists (a mount point, the shell's
    working folder: neither can be renamed or replaced), else beside it."""
    if out.is_dir():
        return out / f".export.partial-{os.getpid()}"
    return out.with_name(f".{out.name}.partial-{os.getpid()}")


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def stops_held():
    """Ctrl-C and SIGTERM wait until the folder is in place: between moving a replaced model aside and
    putting the new one in its place, a stop would leave --out with neither. Held by handlers that note
    them, not by blocking the signals: a blocked signal is delivered to another thread (torch's), and
    Python raises it in the main thread all the same."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    held: list[int] = []
    before = {stop: signal.signal(stop, lambda signum, frame: held.append(signum)) for stop in STOPS}
    try:
        yield
    finally:
        for stop, handler in before.items():
            signal.signal(stop, handler)
        if held:  # the first stop that came meanwhile, as it would have come
            handler = before[held[0]]
            if callable(handler):
                handler(held[0], None)
            else:  # SIG_DFL: export() called where no handler was set
                signal.raise_signal(held[0])


@contextlib.contextmanager
def taking_turns_in(parent: Path):
    """Held while a finished folder is put in `parent`: two exports to one --out take turns, so that
    the second finds the first's folder (and refuses it without --force) rather than replacing it."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
        except ImportError:  # no flock (Windows): exports to one folder at one time are not guarded
            pass
        yield
    finally:
        os.close(fd)


def install(staging: Path, out: Path) -> None:
    """Put the finished folder at out. A new --out is the staging folder renamed; an existing one (empty,
    or a model that --force replaces) keeps its place and gets the files: a replaced model's are moved
    aside first and removed only once the new ones are in. A failure part way puts back what was there."""
    if staging.parent != out:
        staging.rename(out)
        return
    aside = out / f".export.replaced-{os.getpid()}"
    old, new = entries(out), sorted(staging.iterdir())
    aside.mkdir()
    put_aside: list[Path] = []
    moved_in: list[Path] = []
    try:
        for entry in old:
            put_aside.append(entry.rename(aside / entry.name))
        for file in new:
            moved_in.append(file.rename(out / file.name))
    except OSError:
        for file in moved_in:
            file.rename(staging / file.name)
        for entry in put_aside:
            entry.rename(out / entry.name)
        aside.rmdir()
        raise
    staging.rmdir()
    shutil.rmtree(aside, ignore_errors=True)  # the new model is in place; the old one's remains are no loss


@dataclass
class Exported:
    out: Path  # absolute
    difference: float  # the largest logit difference transformers' load of it gives
    tokens: int  # over this many tokens
    bias: bool  # whether the model has biases (else they are written as zeros)


class Progress:
    """How far an export went, as the line a stop (or a report that cannot be printed) ends with says it."""

    def __init__(self):
        self.written: Path | None = None

    def __str__(self) -> str:
        return "nothing was written" if self.written is None else f"{self.written} is written"


def export(
    ckpt: Path, out: Path, force: bool = False, hub_repo: str | None = None, progress: Progress | None = None
) -> Exported:
    """Write ckpt as a Hugging Face folder at out, checked with transformers first: the folder is put in
    place whole, or nothing is written (no folder it made, no file it began)."""
    # `--out .` has no name to stage beside; `x/..` is its parent, before anything is checked or made
    out = through_links(Path(os.path.abspath(out.expanduser())))
    ckpt = ckpt.expanduser()
    check_destination(out, ckpt, force)
    check_hub_login(hub_repo)
    loaded = load_checkpoint(ckpt)
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ExportError(f"{loaded.path} carries no tokenizer; a Hugging Face folder needs one")
    staging = staging_for(out)
    with making_folders(out.parent):
        try:
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                remove_left_behind(out)
                staging.mkdir()
            except OSError as err:
                raise ExportError(
                    f"--out {out}: cannot write in {staging.parent} ({err.strerror}); choose a writable folder"
                ) from None
            try:
                write_folder(staging, loaded, tokenizer, out.name)
                difference, count = compare_logits(staging, loaded.model, tokenizer)
                if not difference <= TOLERANCE:  # a NaN fails too
                    raise ExportError(
                        f"transformers' logits differ from ours by {difference:.3g} (limit {TOLERANCE:g}); "
                        "nothing was written"
                    )
                with taking_turns_in(out.parent), stops_held():
                    try:  # again: another export may have written --out while this one ran
                        check_destination(out, ckpt, force)
                    except ExportError as err:
                        raise ExportError(
                            f"{err} (it was written while this export ran); nothing was written"
                        ) from None
                    install(staging, out)
                    if progress is not None:  # before a stop held meanwhile is raised
                        progress.written = out
            except (OSError, SafetensorError) as err:  # a full disk: safetensors says so in its own error
                raise ExportError(f"{cannot_write(f'--out {out}', err)}; nothing was written") from None
        finally:
            with stops_held():  # a second Ctrl-C would leave it half removed
                shutil.rmtree(staging, ignore_errors=True)
    return Exported(out, difference, count, loaded.model.config.bias)


def report(exported: Exported, hub_repo: str | None) -> None:
    """Say what was written and how to load it; then upload it, if asked."""
    out = exported.out
    note = "" if exported.bias else " (this model has no biases: they are written as zeros, which compute the same)"
    print(f"wrote {out}: {', '.join(FILES)}{note}")
    print(
        f"checked with transformers: largest logit difference {exported.difference:.3g} over {exported.tokens} "
        f"tokens (limit {TOLERANCE:g})"
    )
    print(f"load it with GPT2LMHeadModel.from_pretrained({str(out)!r}) and AutoTokenizer.from_pretrained({str(out)!r})")
    if hub_repo is not None:
        print(f"uploaded to {push_to_hub(out, hub_repo)}")


def main(argv: list[str] | None = None) -> int:
    progress = Progress()
    try:
        with stops_raised():  # Ctrl-C or SIGTERM from here: see the except below
            args = parse_args(argv)
            return run_program(lambda: run(args, progress), ExportError, CheckpointError)
    except (KeyboardInterrupt, Terminated) as stop:
        print(f"\nstopped; {progress}", file=sys.stderr)
        return stopped_status(stop)


def run(args: argparse.Namespace, progress: Progress) -> None:
    exported = export(given_or_newest(args.ckpt), args.out, args.force, args.push_to_hub, progress)
    try:
        report(exported, args.push_to_hub)
    except OutputError as err:
        raise OutputError(f"{err} ({progress})") from None


if __name__ == "__main__":
    exit_quietly(main())
