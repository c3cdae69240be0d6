"""Reading checkpoints: a model, its tokenizer and its training config, from one file.

A checkpoint describes itself: besides the weights, training stores under the key `tinygpt2` the
model config, the tokenizer (as the JSON text of a `tokenizers.Tokenizer`) and the resolved training
config. Loading never executes pickled code (`torch.load(weights_only=True)`).
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, GPTConfig
from .gpt import GPT

META_KEY = "tinygpt2"
STATE_PREFIX = "model."  # the LightningModule keeps the GPT as `self.model`
CHECKPOINT_NAMES = ("best.ckpt", "last.ckpt")  # looked for, in this order, in a run's checkpoints/


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which file and what to do."""


@dataclass
class Loaded:
    model: GPT
    tokenizer_json: str | None
    config: dict[str, Any] = field(default_factory=dict)  # the resolved training config
    path: Path | None = None


def resolve_checkpoint(path: str | Path) -> Path:
    """A `.ckpt` file itself, or the best (else last) checkpoint inside a run folder."""
    path = Path(path).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        for folder in (path / "checkpoints", path):
            for name in CHECKPOINT_NAMES:
                if (folder / name).is_file():
                    return folder / name
        raise CheckpointError(f"no checkpoint in {path}: expected checkpoints/best.ckpt or checkpoints/last.ckpt")
    raise CheckpointError(f"checkpoint {path} does not exist; pass a .ckpt file or a run folder")


def read_checkpoint(path: str | Path, map_location="cpu") -> dict[str, Any]:
    """The checkpoint's dict, loaded without running any pickled code."""
    path = resolve_checkpoint(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refused to load {path}: it holds pickled objects that could run code ({str(err).splitlines()[0]}); "
            "only load checkpoints you trust, and re-save them as plain tensors"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(
            f"cannot read checkpoint {path} ({str(err).splitlines()[0]}); it is truncated or corrupted, "
            "use an earlier checkpoint of the run"
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{path} is not a tinygpt2 checkpoint (it has no state_dict)")
    return ckpt


def model_state(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The GPT's own weights from a training checkpoint's state_dict, keys without the prefix."""
    state = ckpt["state_dict"]
    return {k[len(STATE_PREFIX) :]: v for k, v in state.items() if k.startswith(STATE_PREFIX)}


def load_checkpoint(path: str | Path, map_location="cpu") -> Loaded:
    """Model (in eval mode), tokenizer and training config from a checkpoint or run folder."""
    file = resolve_checkpoint(path)
    ckpt = read_checkpoint(file, map_location)
    meta = ckpt.get(META_KEY)
    if not isinstance(meta, dict) or "model_config" not in meta:
        raise CheckpointError(f"{file} has no model description (key '{META_KEY}'); was it written by tinygpt2?")
    try:
        config = GPTConfig.from_dict(meta["model_config"])
    except ConfigError as err:
        raise CheckpointError(f"{file} describes a model that cannot be built: {err}") from None
    model = GPT(config)
    try:
        model.load_state_dict(model_state(ckpt))
    except RuntimeError as err:
        raise CheckpointError(f"weights in {file} do not fit the model it describes: {str(err).splitlines()[0]}") from None
    model.eval()
    return Loaded(model, meta.get("tokenizer"), meta.get("config") or {}, file)
