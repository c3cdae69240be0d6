"""Export a checkpoint as a Hugging Face GPT-2 folder: python export.py --ckpt RUN_OR_CKPT --out DIR

The folder holds config.json, model.safetensors, tokenizer.json and tokenizer_config.json, and loads
with `GPT2LMHeadModel.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` alone. Before
the folder is put in place, transformers loads it and its logits on a sample text are compared with
ours; a difference above 1e-4 fails the export and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from data.tokenizer import EOT
from generation.checkpoint import NEWEST_RUN, CheckpointError, Loaded, load_checkpoint
from model import GPT
from model.hf import hf_config_dict, to_hf_state_dict

TOLERANCE = 1e-4
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
SAMPLE_TEXT = (
    "First, the model reads this text; then transformers reads it too, and both must agree.\n"
    "Numbers such as 1024 and 3.14, quotes 'like these', accents (café, naïve) and arrows (→).\n\n"
    "KING: What say you, my lord? Speak plainly, and be brief.\n"
)


class ExportError(ValueError):
    """An export that cannot be done; the message says why and what to do."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Write a checkpoint as a Hugging Face GPT-2 folder and check it with transformers.")
    p.add_argument("--ckpt", type=Path, default=NEWEST_RUN, help="a run folder, .ckpt file or Hugging Face folder (default: outputs/latest)")
    p.add_argument("--out", type=Path, required=True, help="the folder to write; must be new or empty")
    p.add_argument("--force", action="store_true", help="replace --out even if it already holds a Hugging Face model")
    return p.parse_args(argv)


def check_destination(out: Path, ckpt: Path, force: bool) -> None:
    """Refuse, before any work, destinations that would lose something or cannot be written."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a folder")
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ExportError(f"--out {out}: {blocker} is a file, not a folder; cannot write there")
    if ckpt.exists() and (out.resolve() == ckpt.resolve() or out.resolve() in ckpt.resolve().parents):
        raise ExportError(f"--out {out} holds the checkpoint being exported; choose another folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"--out {out} is not empty; choose a new folder, or pass --force to replace the model in it")
        check_replaceable(out)


# What a folder may hold for --force to replace it: this export's files, or a GPT-2 that transformers saved.
MODEL_FILES = {*FILES, "generation_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
               "added_tokens.json", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json"}
MODEL_SHARD = re.compile(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)")


def check_replaceable(out: Path) -> None:
    """--force replaces a folder only when all it holds is a Hugging Face model's files; anything else
    (the user's own files, a config.json that describes no model) would be lost, so it is refused."""
    for entry in sorted(out.iterdir()):
        if entry.is_dir() or not (entry.name in MODEL_FILES or MODEL_SHARD.fullmatch(entry.name)):
            shown = f"{entry.name}/" if entry.is_dir() else entry.name
            raise ExportError(f"--out {out} holds {shown}, which is not a Hugging Face model's file; --force replaces "
                              "only a folder of model files, and would lose it. Choose another folder")
    try:
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    is_model = isinstance(config, dict) and "model_type" in config
    if not is_model:
        raise ExportError(f"--out {out}: its config.json describes no model (no model_type); --force replaces only a "
                          "Hugging Face model folder, and would lose it. Choose another folder")


def write_folder(folder: Path, loaded: Loaded, tokenizer: Tokenizer) -> None:
    from safetensors.torch import save_file

    model = loaded.model
    eot = tokenizer.token_to_id(EOT)
    config = {**hf_config_dict(model.config, eot), "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    save_file(to_hf_state_dict(state, model.config), folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "tokenizer.json").write_text(loaded.tokenizer_json, encoding="utf-8")
    specials = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT} if eot is not None else {}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # reads tokenizer.json as it is
        "model_max_length": model.config.block_size,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,  # decode gives back exactly the text that was encoded
        **specials,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    umask = os.umask(0)
    os.umask(umask)
    for name in FILES:  # safetensors writes owner-only files; make them as readable as the others
        os.chmod(folder / name, 0o666 & ~umask)


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


def install(staging: Path, out: Path) -> None:
    """Put the finished folder at out; an old one is moved aside first and removed only after."""
    old = None
    if out.is_dir():
        old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        out.rename(old)
    try:
        staging.rename(out)
    except OSError:
        if old is not None:
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old)


def export(ckpt: Path, out: Path, force: bool = False) -> float:
    """Write ckpt as a Hugging Face folder at out; returns the largest logit difference found."""
    check_destination(out, ckpt, force)
    loaded = load_checkpoint(ckpt)
    if loaded.tokenizer_json is None:
        raise ExportError(f"{loaded.path} carries no tokenizer; a Hugging Face folder needs one")
    tokenizer = Tokenizer.from_str(loaded.tokenizer_json)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed export with the same process id
        staging.mkdir()
    except OSError as err:
        raise ExportError(f"--out {out}: cannot write in {out.parent} ({err.strerror}); choose a writable folder") from None
    try:
        write_folder(staging, loaded, tokenizer)
        difference, count = compare_logits(staging, loaded.model, tokenizer)
        if not difference <= TOLERANCE:  # a NaN fails too
            raise ExportError(
                f"transformers' logits differ from ours by {difference:.3g} (limit {TOLERANCE:g}); nothing was written"
            )
        install(staging, out)
    except OSError as err:
        raise ExportError(f"writing {out} failed ({err}); nothing was written") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    note = "" if loaded.model.config.bias else " (this model has no biases: they are written as zeros, which compute the same)"
    print(f"wrote {out}: {', '.join(FILES)}{note}")
    print(f"checked with transformers: largest logit difference {difference:.3g} over {count} tokens (limit {TOLERANCE:g})")
    print(f"load it with GPT2LMHeadModel.from_pretrained({str(out)!r}) and AutoTokenizer.from_pretrained({str(out)!r})")
    return difference


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        export(args.ckpt, args.out, args.force)
    except (ExportError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
