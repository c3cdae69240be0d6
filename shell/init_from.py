"""Starting a run from existing weights: `python train.py init_from=PATH`.

PATH is a tinygpt2 checkpoint or run folder, or a Hugging Face GPT-2 folder (one written by
export.py, or by transformers). The run keeps that model's tokenizer and its shape; model settings
given on the command line may change what does not touch the weights (`dropout`, `attention`) and
may shorten `block_size` (the position table is cropped), but a shape that contradicts the
checkpoint is refused, naming both values.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from checkpoint import HF_WEIGHT_FILES, CheckpointError, read_tokenizer, read_weights
from data.tokenizer import load_pretrained
from model import ConfigError, GPTConfig

SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "vocab_size", "bias")  # fixed by the weights


@dataclass
class Start:
    """What a run starts from: the model's shape, its weights and its tokenizer."""

    config: GPTConfig
    state: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: Path


def keys_of(overrides: Iterable[str]) -> set[str]:
    """The keys that overrides (`key=value`, `+key=value`, `~key`) or dotted keys name."""
    return {item.split("=", 1)[0].lstrip("+~") for item in overrides}


def model_keys_in(overrides: Iterable[str], model_cfg) -> set[str]:
    """The `model` settings that command-line overrides name (`model=preset` names all of them)."""
    keys: set[str] = set()
    for key in keys_of(overrides):
        if key == "model":
            keys |= set(model_cfg)
        elif key.startswith("model."):
            keys.add(key.split(".", 1)[1])
    return keys


def reconcile(saved: GPTConfig, requested, asked: set[str], source: Path) -> GPTConfig:
    """The checkpoint's config with the settings the user asked for, where they are compatible."""
    values = saved.to_dict()
    for key in sorted(asked, key=lambda k: (k not in SHAPE_KEYS, k)):  # shape conflicts first
        want = requested.get(key)
        if key not in values or want is None:
            continue
        have = values[key]
        if key in SHAPE_KEYS and want != have:
            raise ConfigError(
                f"model.{key}={want} contradicts init_from={source}, whose {key} is {have}; "
                f"the shape comes from the checkpoint, so leave model.{key} out"
            )
        if key == "block_size" and want > have:
            raise ConfigError(
                f"model.block_size={want} is more than the {have} positions init_from={source} has; use {have} or less"
            )
        values[key] = want
    return GPTConfig.from_dict(values)


def missing_source(path: str) -> str:
    """What to say of an init_from that names nothing on this machine. A name such as `gpt2` or
    `openai-community/gpt2` is likely a Hugging Face Hub model, which init_from does not download: the
    message points at the copy in the Hugging Face cache, if there is one, else at how to fetch it."""
    missing = f"init_from={path} does not exist; pass a .ckpt file, a run folder or a Hugging Face folder"
    parts = path.split("/")
    hub_like = re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", path) and (
        len(parts) == 1 or not Path(parts[0]).exists()
    )
    if not hub_like or Path(path).suffix in (".ckpt", ".pt", ".pth", ".bin"):
        return missing
    cached = hub_cache_copy(path)
    if cached is not None:
        return f"init_from={path} does not exist here, but the Hugging Face cache holds a copy of {path}: pass init_from={cached}"
    local = f"hf/{parts[-1]}"
    return (
        f"{missing}. If {path} is a Hugging Face Hub model: init_from reads only local files, and it was never "
        f"downloaded here (the Hugging Face cache has no copy); download it once where there is a network (hf "
        f"download {path} config.json model.safetensors tokenizer.json --local-dir {local}), then pass init_from={local}"
    )


def hub_cache_copy(repo_id: str) -> Path | None:
    """The folder of a Hub model's newest copy in the Hugging Face cache, if it holds a whole model."""
    from huggingface_hub import try_to_load_from_cache

    try:
        config = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repository id after all
        return None
    if not isinstance(config, str):
        return None
    folder = Path(config).parent
    return folder if any((folder / name).is_file() for name in HF_WEIGHT_FILES) else None


def start_from(cfg, asked: set[str]) -> Start | None:
    """The weights, shape and tokenizer of `cfg.init_from`, or None when it is not set.

    `asked`: the model settings the user gave (model_keys_in of the command line's overrides).
    """
    path = cfg.get("init_from")
    if not path:
        return None
    weights = read_weights(path)
    if weights.tokenizer_json is None:
        raise CheckpointError(f"init_from={path} carries no tokenizer; training needs the one its weights learned with")
    config = reconcile(weights.config, cfg.model, asked, weights.path)
    state = dict(weights.state)
    if config.block_size < weights.config.block_size:  # a shorter context needs fewer positions
        state["transformer.wpe.weight"] = state["transformer.wpe.weight"][: config.block_size].clone()
    return Start(config, state, read_tokenizer(weights), weights.path)


def kept_tokenizer(requested: dict, start: Start, named: Iterable[str]) -> dict:
    """The tokenizer settings a run from init_from records: those of the tokenizer its weights learned
    with, which it keeps. Tokenizer settings the command line (or a recipe it chooses) names are refused,
    unless they name that same tokenizer (tokenizer=pretrained with files of the same vocabulary)."""
    asked = sorted(key for key in keys_of(named) if key == "tokenizer" or key.startswith("tokenizer."))
    if not asked:
        return {"kind": "pretrained", "path": str(start.source)}
    have = start.tokenizer.get_vocab(with_added_tokens=True)
    if requested.get("kind") == "pretrained":
        given = load_pretrained(requested.get("path")).get_vocab(with_added_tokens=True)
        if given == have:
            return requested
        raise ConfigError(
            f"tokenizer.path={requested['path']} holds another vocabulary ({len(given):,} tokens) than the one "
            f"init_from={start.source} learned with ({len(have):,} tokens), which the run keeps; leave the "
            "tokenizer settings out"
        )
    key = "tokenizer.kind" if "tokenizer.kind" in asked else asked[0]
    value = requested.get(key.split(".", 1)[1]) if "." in key else requested.get("kind")
    raise ConfigError(
        f"{key}={value} cannot apply with init_from={start.source}: the run keeps the tokenizer its weights "
        f"learned with ({len(have):,} tokens); leave the tokenizer settings out"
    )
