"""What a checkpoint holds, in one place: what training writes into it (its description, the random
generators, the counters the step keeps, the file written whole or not at all), and reading a model, its
tokenizer and its training config back from one file or folder.

Two kinds are read:

- a tinygpt2 training checkpoint (`.ckpt`, or a run folder holding one). It describes itself:
  besides the weights, training stores under the key `tinygpt2` the model config, the tokenizer
  (the JSON text of a `tokenizers.Tokenizer`) and the resolved training config;
- a Hugging Face GPT-2 folder (`config.json` plus `model.safetensors` or `pytorch_model.bin`, whole
  or sharded), as written by `export.py` or by `transformers` itself. Its tokenizer comes from
  `tokenizer.json`, else from the GPT-2 files `vocab.json` and `merges.txt`.

Loading never executes pickled code: `torch.load(weights_only=True)` or safetensors. A file that
carries pickled objects is refused.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shlex
import shutil
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from data.sources import PYDOC_LABEL
from data.tokenizer import has_gpt2_files, read_gpt2_files
from model import GPT, ConfigError, GPTConfig
from model.hf import config_from_hf, from_hf_state_dict

META_KEY = "tinygpt2"
STATE_PREFIX = "model."  # the LightningModule keeps the GPT as `self.model`
# A run folder's checkpoints (training/checkpoints.py writes them): looked for, best first, by loaders.
CHECKPOINTS_DIR, BEST_NAME, LAST_NAME = "checkpoints", "best.ckpt", "last.ckpt"
CHECKPOINT_NAMES = (BEST_NAME, LAST_NAME)
STEP_NAME = "step-{:06d}.ckpt"  # the periodic checkpoints: step-000500.ckpt
# Keys the saved settings hold beside the settings themselves: the token cache entry the run read, and the
# settings its command line left to the machine (precision, compile), chosen again where it continues.
PREPARED, MACHINE_CHOSEN = "prepared_data", "chosen_for_the_machine"
NEWEST_RUN = Path("outputs/latest")  # where train.py links the run it made last (its latest_link setting)
HF_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which file and what to do."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint file whose bytes cannot be read back (cut short by a full disk, or damaged)."""

    def __init__(self, path: Path, detail: str = ""):
        self.path, self.detail = path, detail
        others = sibling_checkpoints(path)
        instead = (
            f"use another checkpoint of its run, e.g. {others[-1]}" if others else "use an earlier or a fresh copy"
        )
        super().__init__(
            f"cannot read checkpoint {path}{f' ({detail})' if detail else ''}: it is truncated or corrupted; {instead}"
        )


def sibling_checkpoints(path: Path) -> list[Path]:
    """The other checkpoints of the run a checkpoint file is in (its checkpoints/ folder), oldest first."""
    if Path(path).parent.name != CHECKPOINTS_DIR:
        return []
    try:
        me = Path(path).resolve()
        others = [f for f in Path(path).parent.glob("*.ckpt") if f.is_file() and f.resolve() != me]
        return sorted(others, key=lambda f: (f.stat().st_mtime, f.name))
    except OSError:
        return []


@dataclass
class Weights:
    """What a checkpoint holds, before a model is built from it."""

    config: GPTConfig
    state: dict[str, torch.Tensor]  # our parameter names, no prefix
    tokenizer_json: str | None
    run_config: dict[str, Any] = field(default_factory=dict)  # the resolved training config, if any
    path: Path | None = None  # the file (or Hugging Face folder) that was read
    eos_token_id: int | None = None  # the end-of-text token a Hugging Face config names
    step: int | None = None  # the optimizer step a training checkpoint was saved at


@dataclass
class Loaded:
    model: GPT
    tokenizer_json: str | None
    tokenizer: Tokenizer | None  # the same, read and checked against the model (see `read_tokenizer`)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved training config
    path: Path | None = None
    eos_token_id: int | None = None
    step: int | None = None  # the optimizer step of a training checkpoint (None for a Hugging Face folder)


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def is_hf_folder(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def given_or_newest(path: str | Path | None) -> Path:
    """The checkpoint a command line names, else the newest run (for --ckpt of generate.py and explain.py)."""
    if path is not None:
        return Path(path)
    if NEWEST_RUN.exists():
        return NEWEST_RUN
    if NEWEST_RUN.is_symlink():
        raise CheckpointError(
            f"{NEWEST_RUN} links to {os.readlink(NEWEST_RUN)}, which no longer exists; pass --ckpt with a run "
            f"folder that does (they are under {NEWEST_RUN.parent}/), or train one with `python train.py`"
        )
    raise CheckpointError(f"no run found at {NEWEST_RUN}; train one with `python train.py` or pass --ckpt RUN_FOLDER")


def resolve_checkpoint(path: str | Path) -> Path:
    """A `.ckpt` file itself, or the best (else last) checkpoint inside a run folder."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix != ".ckpt" and is_hf_folder(path.parent):  # its config.json, its weights
        raise CheckpointError(
            f"{path} is one file of the Hugging Face model folder {path.parent}; pass the folder itself: {path.parent}"
        )
    if path.is_file():
        return path
    if path.is_dir():
        return checkpoint_in_run(path)
    if path.exists():  # a device, a pipe, a socket
        raise CheckpointError(
            f"checkpoint {path} is not a file or a folder; pass a .ckpt file, a run folder or a Hugging Face folder"
        )
    raise CheckpointError(f"checkpoint {path} does not exist; pass a .ckpt file, a run folder or a Hugging Face folder")


def checkpoint_in_run(folder: Path) -> Path:
    """A run folder's best checkpoint, else its last; a folder without either is refused, with what it
    does hold and what to pass instead."""
    candidates = [place / name for place in (folder / CHECKPOINTS_DIR, folder) for name in CHECKPOINT_NAMES]
    found = next((file for file in candidates if file.is_file()), None)
    if found is not None:
        return found
    broken = next((file for file in candidates if file.is_symlink()), None)
    if broken is not None:
        raise broken_link(broken)
    raise no_checkpoint(folder)


def broken_link(link: Path) -> CheckpointError:
    """The error for best.ckpt or last.ckpt pointing at a file that is gone; it names another checkpoint."""
    others = checkpoint_files(link.parent)
    gone = f"{link} is a broken link: it points at {os.readlink(link)}, which no longer exists"
    if others:
        return CheckpointError(f"{gone}; name another checkpoint of the run instead, e.g. {others[-1]}")
    return CheckpointError(f"{gone}, and the run holds no other checkpoint; use another run")


def no_checkpoint(folder: Path) -> CheckpointError:
    """The error for a folder with no best.ckpt or last.ckpt, by what it holds instead: other
    checkpoints, runs, Hugging Face model folders, or nothing of use."""
    steps = checkpoint_files(folder / CHECKPOINTS_DIR)
    if steps:  # its links were lost on the way (a copy that skips symbolic links), or removed
        return CheckpointError(
            f"{folder} has no checkpoints/{BEST_NAME} or checkpoints/{LAST_NAME}, only other checkpoints; "
            f"name one of them instead, e.g. the newest, {steps[-1]}"
        )
    runs = [run.parent for run in (*folder.glob(f"*/{CHECKPOINTS_DIR}"), *folder.glob(f"*/*/{CHECKPOINTS_DIR}"))]
    if runs:  # a runs_root (outputs/) or a day of it
        newest = max(runs, key=lambda run: run.stat().st_mtime)
        return CheckpointError(f"{folder} holds runs, not one run: name one of them, e.g. the newest, {newest}")
    models = sorted(config.parent for config in folder.glob("*/config.json") if config.is_file())
    if models:  # export.py's --out folders side by side (hf/my-model)
        return CheckpointError(
            f"{folder} holds Hugging Face model folders, not one model: name one of them, e.g. {models[0]}"
        )
    return CheckpointError(
        f"no checkpoint in {folder}: expected checkpoints/best.ckpt or checkpoints/last.ckpt (a run folder), "
        "or config.json with model.safetensors (a Hugging Face folder)"
    )


def checkpoint_files(folder: Path) -> list[Path]:
    """The .ckpt files in folder, oldest first."""
    return sorted((f for f in folder.glob("*.ckpt") if f.is_file()), key=lambda f: f.stat().st_mtime)


ZIP_START = b"PK\x03\x04"
SAVED_BY_TORCH = (ZIP_START, b"\x80")  # how torch.save's files start: a zip archive, or (older) a pickle
CHECK_CHUNK = 1 << 22  # bytes read at a time when checking an entry's CRC-32
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


def safe_torch_load(path: Path, map_location="cpu", mmap: bool = False) -> Any:
    """torch.load that only rebuilds tensors and plain containers; anything else is refused. `mmap`:
    tensors stay on disk until read (for reading a checkpoint's header). A file that neither is named
    as a checkpoint nor starts as torch.save's files do (a text, a config) is said not to be one,
    rather than damaged; one whose bytes fail their checksums (see `check_sums`) is damaged."""
    if path.suffix.lower() not in CHECKPOINT_SUFFIXES and not starts_like_torch_file(path):
        raise CheckpointError(
            f"{path} is not a checkpoint; pass a .ckpt file that train.py wrote, a run folder or a Hugging Face folder"
        )
    if file_start(path) == b"":
        raise DamagedCheckpoint(path, "it is empty")
    if not starts_like_torch_file(path):  # named as a checkpoint, and something else from its first byte
        raise DamagedCheckpoint(path, "its first bytes are not those of a file torch.save wrote")
    check_sums(path, tensors=not mmap)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        code = re.search(r"GLOBAL (\S+)", str(err))
        if code is None:  # not an object it refused: bytes that are no pickle at all
            raise DamagedCheckpoint(path) from None
        raise CheckpointError(
            f"refused to load {path}: it holds a pickled object ({code.group(1)}) whose loading could run code; "
            "nothing in it was run. Load only checkpoints you trust, and save weights as plain tensors"
        ) from None
    except Exception as err:  # damaged bytes surface as any of a dozen errors inside the unpickler
        raise DamagedCheckpoint(
            path, first_line(err).split(". ")[0] if isinstance(err, (RuntimeError, OSError)) else ""
        ) from None


def check_sums(path: Path, tensors: bool = True) -> None:
    """Check the CRC-32 that torch.save's zip archive keeps of each entry, which torch.load does not:
    a damaged tensor would load as other numbers. `tensors=False` checks only the small entries (the
    pickle a header is read from), so that a header is read without reading the whole file. An older
    torch.save file, a pickle, carries no checksums."""
    if file_start(path) != ZIP_START:
        return
    try:
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                if not tensors and entry.filename.split("/")[-2:-1] == ["data"]:  # <archive>/data/<storage>
                    continue
                with archive.open(entry) as data:
                    while data.read(CHECK_CHUNK):
                        pass
    except zipfile.BadZipFile as err:
        crc = re.fullmatch(r"Bad CRC-32 for file '(.+)'", first_line(err))
        detail = f"{crc.group(1)} does not match its checksum" if crc else "its zip archive is cut short or damaged"
        raise DamagedCheckpoint(path, detail) from None
    except (OSError, EOFError, ValueError, zlib.error) as err:  # the archive's own records damaged, or unreadable
        raise DamagedCheckpoint(path, first_line(err)) from None


def starts_like_torch_file(path: Path) -> bool:
    head = file_start(path)
    return head is None or head.startswith(SAVED_BY_TORCH)  # None: torch.load says what is wrong with it


def file_start(path: Path) -> bytes | None:
    """A file's first 4 bytes; None if it cannot be opened."""
    try:
        with open(path, "rb") as file:
            return file.read(4)
    except OSError:
        return None


def read_checkpoint(path: str | Path, map_location="cpu") -> dict[str, Any]:
    """The checkpoint's dict, loaded without running any pickled code."""
    path = resolve_checkpoint(path)
    ckpt = safe_torch_load(path, map_location)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"{path} is not a tinygpt2 checkpoint (it has no state_dict of weights)")
    return ckpt


def model_state(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The GPT's own weights from a training checkpoint's state_dict, keys without the prefix."""
    state = ckpt["state_dict"]
    return {k[len(STATE_PREFIX) :]: v for k, v in state.items() if k.startswith(STATE_PREFIX)}


def read_weights(path: str | Path, map_location="cpu") -> Weights:
    """Config, weights and tokenizer of a tinygpt2 checkpoint, run folder or Hugging Face folder."""
    path = Path(path).expanduser()
    if is_hf_folder(path):
        return read_hf_folder(path, map_location)
    file = resolve_checkpoint(path)
    ckpt = read_checkpoint(file, map_location)
    meta = ckpt.get(META_KEY)
    if not isinstance(meta, dict) or "model_config" not in meta:
        raise CheckpointError(f"{file} has no model description (key '{META_KEY}'); was it written by tinygpt2?")
    try:
        config = GPTConfig.from_dict(meta["model_config"])
    except ConfigError as err:
        raise CheckpointError(f"{file} describes a model that cannot be built: {err}") from None
    step = ckpt.get("global_step")
    step = step if isinstance(step, int) else None
    return checked(Weights(config, model_state(ckpt), meta.get("tokenizer"), meta.get("config") or {}, file, step=step))


def checked(weights: Weights) -> Weights:
    """The weights, refused unless they are the tensors of the model their checkpoint describes, each of
    its shape (a config.json that names another context or width than its weight file has), and finite
    numbers: so that no command builds, samples from or trains a model on them first."""
    with torch.device("meta"):  # shapes only: nothing allocated or initialised
        wanted = {name: tuple(t.shape) for name, t in GPT(weights.config).state_dict().items()}
    have = {name: tuple(t.shape) for name, t in weights.state.items()}
    wrong = [name for name, shape in wanted.items() if have.get(name, shape) != shape]
    missing, extra = sorted(wanted.keys() - have.keys()), sorted(have.keys() - wanted.keys())
    if wrong or missing or extra:
        if wrong:
            problem = (
                f"size mismatch for {wrong[0]}: {have[wrong[0]]} in the checkpoint, {wanted[wrong[0]]} in the model"
            )
        else:
            problem = f"{missing[0]} is missing" if missing else f"{extra[0]} is not a weight of the model"
        raise CheckpointError(f"weights in {weights.path} do not fit the model it describes: {problem}")
    broken = next((n for n, t in weights.state.items() if t.is_floating_point() and not t.isfinite().all()), None)
    if broken is not None:
        raise CheckpointError(
            f"{weights.path} holds weights that are not finite numbers ({broken}); it cannot be used: take an "
            "earlier checkpoint of its run"
        )
    return weights


def describe_model(model_config: GPTConfig, tokenizer_json: str | None, run_settings: dict[str, Any]) -> dict[str, Any]:
    """What a training checkpoint carries besides the training state, under META_KEY: the model
    config, the tokenizer and the run's settings, so that it describes itself."""
    return {META_KEY: {"model_config": model_config.to_dict(), "tokenizer": tokenizer_json, "config": run_settings}}


def read_header(path: str | Path) -> dict[str, Any]:
    """A training checkpoint's step, run settings, tokenizer and model config (None if it has no
    description), and whether Lightning saved the module's hyperparameters; read without loading its
    tensors into memory."""
    path = Path(path)
    ckpt = safe_torch_load(path, mmap=True)
    if not isinstance(ckpt, dict) or "global_step" not in ckpt:
        raise CheckpointError(f"{path} is not a tinygpt2 training checkpoint (it holds no training state)")
    meta = ckpt.get(META_KEY) if isinstance(ckpt.get(META_KEY), dict) else {}
    return {
        "step": int(ckpt["global_step"]),
        "settings": meta.get("config") or {},
        "tokenizer": meta.get("tokenizer"),
        "model_config": meta.get("model_config"),
        "hyperparameters": "hyper_parameters" in ckpt,
    }


def read_loss_history(path: str | Path) -> dict[str, list[list[float]]]:
    """The training and validation loss against tokens seen, as the run's loss curve kept them in this
    checkpoint: {"train": [[tokens, loss], ...], "val": [...]}; empty lists where it kept none."""
    ckpt = safe_torch_load(Path(path), mmap=True)
    callbacks = ckpt.get("callbacks") if isinstance(ckpt, dict) else None
    state = (callbacks or {}).get("LossCurve") or {}
    return {split: [[float(t), float(v)] for t, v in state.get(split, [])] for split in ("train", "val")}


def trained_offline(settings: dict[str, Any]) -> bool:
    """Whether a run with these saved settings asked for Tiny Shakespeare (data.source=shakespeare) and,
    with no copy and no network, learned the offline pydoc corpus that stands in for it instead (its
    prepared_data names the corpus, data.sources.PYDOC_LABEL)."""
    data, prepared = settings.get("data"), settings.get(PREPARED)
    if not isinstance(data, dict) or not isinstance(prepared, dict):
        return False  # a Hugging Face folder's, or a checkpoint's from before prepared_data was saved
    return data.get("source") == "shakespeare" and str(prepared.get("source")).startswith(PYDOC_LABEL)


def module_arguments(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    """GPTModule's arguments from a checkpoint's description alone, for one written before Lightning kept
    them: its validation's tokens per character were not recorded, so val/bpc is nan unless given."""
    settings = header["settings"]
    if "optim" not in settings or "trainer" not in settings:
        raise CheckpointError(
            f"{path} holds no training settings, so no GPTModule can be rebuilt from it; "
            "load its model with generation.load_checkpoint"
        )
    return {
        "model_config": header["model_config"],
        "optim": settings["optim"],
        "max_steps": settings["trainer"]["max_steps"],
        "val_tokens_per_char": float("nan"),
    }


def checkpoint_step(path: str | Path) -> int:
    """The optimizer step a training checkpoint was saved at."""
    return read_header(path)["step"]


def load_checkpoint(path: str | Path, map_location="cpu") -> Loaded:
    """Model (in eval mode), tokenizer and training config from a checkpoint, run folder or
    Hugging Face folder."""
    weights = read_weights(path, map_location)
    model = GPT(weights.config)
    model.load_state_dict(weights.state)  # read_weights checked that they fit
    model.eval()
    tokenizer = read_tokenizer(weights)
    return Loaded(
        model, weights.tokenizer_json, tokenizer, weights.run_config, weights.path, weights.eos_token_id, weights.step
    )


def read_tokenizer(weights: Weights) -> Tokenizer | None:
    """The checkpoint's tokenizer (None if it carries none), refused if `tokenizers` cannot read it or
    if it makes token ids the model has no embedding row for."""
    if weights.tokenizer_json is None:
        return None
    try:
        tokenizer = Tokenizer.from_str(weights.tokenizer_json)
    except Exception as err:  # the library raises a bare Exception ("Model missing. at line 1 column 2")
        raise CheckpointError(
            f"the tokenizer of {weights.path} cannot be read ({first_line(err)}); it is damaged or not a "
            "`tokenizers` tokenizer.json"
        ) from None
    if tokenizer.get_vocab_size() > weights.config.vocab_size:
        raise CheckpointError(
            f"the tokenizer of {weights.path} has {tokenizer.get_vocab_size()} tokens but the model only "
            f"{weights.config.vocab_size}; the tokenizer and the weights do not belong together"
        )
    return tokenizer


# ---- Hugging Face folders ----------------------------------------------------------------------------


def read_hf_folder(folder: Path, map_location="cpu") -> Weights:
    config_file = folder / "config.json"
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {config_file} ({err}); it is not a valid config.json") from None
    try:
        config = config_from_hf(hf_config)
        state = from_hf_state_dict(read_hf_weights(folder, map_location))
    except (ConfigError, TypeError, KeyError) as err:
        raise CheckpointError(f"{folder} is not a GPT-2 model tinygpt2 can load: {err}") from None
    eos = hf_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    eos = eos if isinstance(eos, int) and 0 <= eos < config.vocab_size else None
    return checked(Weights(config, state, read_hf_tokenizer(folder), {}, folder, eos))


def read_hf_weights(folder: Path, map_location="cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files (one file, or the shards an index names)."""
    state: dict[str, torch.Tensor] = {}
    for file in hf_weight_files(folder):
        state.update(read_weight_file(file, map_location))
    return state


def hf_weight_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: its one weight file, or the shards its index names.
    Each must lie inside the folder (see `inside_folder`), so that an index or a link cannot make a
    command read, export or upload another model's weights, or any other file."""
    for name in HF_WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        inside_folder(folder, name)
        if not name.endswith(".index.json"):
            return [file]
        try:
            shards = sorted(set(json.loads(file.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError, TypeError) as err:
            raise CheckpointError(f"cannot read the shard index {file} ({err})") from None
        return [inside_folder(folder, shard, index=file) for shard in shards]
    raise CheckpointError(f"{folder} has config.json but no weights: expected one of {', '.join(HF_WEIGHT_FILES)}")


def inside_folder(folder: Path, name: str, index: Path | None = None, what: str = "weights") -> Path:
    """folder/name, refused unless it lies inside the folder, links followed. The one way out is the
    Hugging Face cache's own: a snapshot's files (models--org--name/snapshots/REV/...) are links to
    that model's blobs (models--org--name/blobs/HASH)."""
    home = folder.resolve()
    named = Path(os.path.normpath(home / str(name)))
    if index is not None and not named.is_relative_to(home):
        raise CheckpointError(
            f"the shard index {index} names {name!r}, a file outside {folder}; a model's weights are read only "
            "from its own folder: name each shard by its file name in the folder"
        )
    real = named.resolve()
    if real.is_relative_to(home) or (blobs := cache_blobs(home)) is not None and real.is_relative_to(blobs):
        return named
    raise CheckpointError(
        f"{folder / name} is a link to {real}, outside {folder}; a model's {what} are read only from its own "
        f"folder: put a copy of the file there in place of the link (cp --remove-destination {shlex.quote(str(real))} "
        f"{shlex.quote(str(folder / name))})"
    )


def cache_blobs(folder: Path) -> Path | None:
    """The blobs folder of the Hugging Face cache's copy of a model, when folder is (inside) one of its
    snapshots: .../models--org--name/snapshots/REV; else None."""
    for snapshot in (folder, *folder.parents):
        repo = snapshot.parent.parent
        if snapshot.parent.name == "snapshots" and repo.name.startswith("models--"):
            return repo / "blobs"
    return None


def read_weight_file(file: Path, map_location="cpu") -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(f"weight file {file} is missing")
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        device = map_location if isinstance(map_location, str) else str(torch.device(map_location))
        try:
            return load_file(file, device=device)
        except (SafetensorError, OSError, RuntimeError, ValueError) as err:
            raise CheckpointError(f"cannot read {file} ({first_line(err)}); it is truncated or corrupted") from None
    state = safe_torch_load(file, map_location)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{file} does not hold a state dict of tensors")
    return state


def read_hf_tokenizer(folder: Path) -> str | None:
    """The folder's tokenizer as `tokenizers` JSON: tokenizer.json, else vocab.json + merges.txt, each read
    from inside the folder (see `inside_folder`), so that a link cannot give a model another's tokenizer."""
    try:
        if (folder / "tokenizer.json").is_file():  # read from inside the folder, as its weights are
            return inside_folder(folder, "tokenizer.json", what="files").read_text(encoding="utf-8")
        if has_gpt2_files(folder):
            for name in ("vocab.json", "merges.txt"):
                inside_folder(folder, name, what="files")
            return read_gpt2_files(folder).to_str()
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"cannot read the tokenizer files in {folder} ({err})") from None
    return None


# ---- writing: what a training checkpoint holds beside Lightning's own state --------------------------
#
# Lightning writes the weights, the optimizer and schedule, its loops' counters and the callbacks' state.
# Beside them the module adds, through `add_run_state`: the description (model config, tokenizer, the
# run's settings, under META_KEY), every random generator, the counts of non-finite steps, and the
# latest logged values; `read_run_state` gives them back on resume.


def step_file(checkpoints: Path, step: int) -> Path:
    return Path(checkpoints) / STEP_NAME.format(step)


def step_files(checkpoints: Path) -> list[Path]:
    """The periodic checkpoints in a folder, oldest first (by step: step-1000000 comes after step-999999)."""
    steps = [p for p in Path(checkpoints).glob("step-*.ckpt") if p.stem[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.stem[5:]))


def add_run_state(ckpt: dict[str, Any], description: dict[str, Any], counts: dict, latest: dict) -> None:
    """What the module adds to a checkpoint Lightning is writing (see the section's comment)."""
    ckpt.update(description)
    ckpt["rng_states"] = rng_states()
    ckpt["nonfinite"] = counts  # {"skipped": updates skipped so far, "in_a_row": non-finite steps up to now}
    ckpt["latest_values"] = latest  # {"train": {...}, "val": {...}, "validated_step": N}


@dataclass
class RunState:
    counts: dict[str, int]
    latest: dict[str, Any]


def read_run_state(ckpt: dict[str, Any], restore_rng: bool) -> RunState:
    """What `add_run_state` wrote; `restore_rng`: set every random generator as it was (a resumed run)."""
    if restore_rng and "rng_states" in ckpt:
        set_rng_states(ckpt["rng_states"])
    return RunState(ckpt.get("nonfinite", {}), ckpt.get("latest_values", {}))


def rng_states() -> dict[str, Any]:
    """Every random generator a training step may draw from: dropout (torch), and Python's and
    NumPy's global ones for good measure. Python's state is stored as plain lists (weights-only loading)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def realign_accumulation(ckpt: dict[str, Any], accumulation: int) -> None:
    """A run continued on another number of devices keeps its global batch, so each process takes another
    number of micro-batches per step. Lightning decides when to validate from its count of micro-batches,
    restored from the checkpoint: counted in the old accumulation, validation would come at other steps.
    The counts are rescaled to the new one."""
    progress = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    steps = ckpt.get("global_step", 0)
    if not progress or steps <= 0 or progress["total"]["ready"] % steps:
        return
    before = progress["total"]["ready"] // steps
    if before == accumulation:
        return
    for counts in (progress["total"], progress["current"]):
        ready = counts["ready"] // before * accumulation
        for field_name in counts:  # the others trail "ready" by the micro-batches under way as it was saved
            counts[field_name] = ready - (counts["ready"] - counts[field_name])


def save(ckpt: dict[str, Any], path: Path) -> None:
    """Write the checkpoint whole or not at all: into a hidden file beside it, flushed to the disk, then
    renamed over the old one. A kill, a full disk or Ctrl-C leaves the old file as it was, and no part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)
    try:
        with open(tmp, "wb") as out:
            write_bytes(out, buffer.getbuffer())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):  # named by the checkpoint's own path, not the hidden file's
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise


def write_bytes(out, data: memoryview) -> None:
    out.write(data)


def fsync_dir(folder: Path) -> None:
    """Make a rename in folder survive a power cut (where the system allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def link_last(link: Path, target: Path) -> None:
    """Point link (last.ckpt) at target, a file beside it, replacing the link atomically."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    os.replace(tmp, link)


def share(source: Path, target: Path) -> None:
    """Make `target` the same file as `source`, a checkpoint beside it holding the same step's state: a
    hard link, so that the disk holds the state once (deleting either leaves the other whole), or a copy
    where the file system has no hard links. Target is replaced whole, as save replaces a file."""
    source, target = Path(source), Path(target)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(source, tmp)
        except OSError:
            with open(source, "rb") as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out)
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):  # named by the checkpoint's own path, not the hidden file's
            raise OSError(err.errno, err.strerror, str(target)) from None
        raise
