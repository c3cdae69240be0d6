"""Every setting of a run, checked at once before anything is made: kinds, ranges, choices, lists, NaN
and infinities, and the trainer's arguments against Lightning's own. One line per problem, naming the
setting. The values themselves (the defaults) live in configs/; this says only what a value may be.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
import netrc
import os
import tempfile
import types
import typing
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from data.files import FORMAT_CHOICES
from data.sources import DOCUMENT_UNITS, SOURCES, TEXT_ERRORS
from data.tokenizer import TOKENIZERS, bpe_vocab_size_problem
from model import ConfigError, GPTConfig
from training.optim import OPTIMIZERS, SCHEDULES


class SettingError(ValueError):
    """A training setting that cannot work; the message names it and says how to fix it. The problems
    of one command line are reported together (`several`), one `error:` line each."""

    @classmethod
    def several(cls, problems: list[str]) -> SettingError:
        return cls("\nerror: ".join(dict.fromkeys(problems)))  # printed after "error: ", as one problem is


MISSING = "???"  # Hydra's mark for a value that must be given

# ---- kinds of value ----------------------------------------------------------------------------------


def shown(value: Any) -> str:
    """A value as it is written on the command line: 'text', true, null, 0.001."""
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def bound(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Number:
    whole: bool = False
    min: float | None = None  # at least
    above: float | None = None  # more than
    max: float | None = None  # at most
    below: float | None = None  # less than
    also: tuple = ()  # values accepted outside the range (e.g. -1 for "no limit")
    also_means: str = ""  # what they mean, for the message
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        if value is None and self.optional:
            return
        kind = "a whole number" if self.whole else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SettingError(f"{key} must be {kind}, got {shown(value)}")
        if not math.isfinite(value):
            raise SettingError(f"{key} must be a finite number, got {value}")
        if self.whole and not float(value).is_integer():
            raise SettingError(f"{key} must be a whole number, got {value}")
        if value in self.also:
            return
        extra = (
            f" (or {', '.join(map(str, self.also))}{' ' + self.also_means if self.also_means else ''})"
            if self.also
            else ""
        )
        for limit, fails, words in (
            (self.min, lambda b: value < b, "at least"),
            (self.above, lambda b: value <= b, "above"),
            (self.max, lambda b: value > b, "at most"),
            (self.below, lambda b: value >= b, "below"),
        ):
            if limit is not None and fails(limit):
                raise SettingError(f"{key} must be {words} {bound(limit)}{extra}, got {value}")


@dataclass(frozen=True)
class Choice:
    values: tuple

    def check(self, key: str, value: Any) -> None:
        if value not in self.values or isinstance(value, bool):
            raise SettingError(f"{key} must be one of {', '.join(map(str, self.values))}, got {shown(value)}")


@dataclass(frozen=True)
class Text:
    optional: bool = False
    most: int | None = None  # characters at most, and at least one (a tracker's rule for a name)
    without: str = ""  # characters the text may not hold

    def check(self, key: str, value: Any) -> None:
        if value is None and self.optional:
            return
        if not isinstance(value, str):
            raise SettingError(f"{key} must be text, got {shown(value)}")
        if self.most is not None and not 1 <= len(value) <= self.most:
            raise SettingError(f"{key} must be 1 to {self.most} characters, got {shown(value)}")
        if found := sorted({c for c in value if c in self.without}):
            raise SettingError(f"{key} cannot hold {' '.join(found)}, got {shown(value)}")


@dataclass(frozen=True)
class PathText(Text):
    """A path: never empty, which is an unset shell variable (data.path=$DATA), not a place."""

    instead: str = ""  # what to do rather than give it empty

    def check(self, key: str, value: Any) -> None:
        super().check(key, value)
        if isinstance(value, str) and not value.strip():
            instead = self.instead or ("give a path, or leave it out" if self.optional else "give a path")
            raise SettingError(f"{key} is empty (an unset shell variable?): {instead}")


@dataclass(frozen=True)
class Flag:
    optional: bool = False  # null allowed: chosen by the program

    def check(self, key: str, value: Any) -> None:
        if value is None and self.optional:
            return
        if not isinstance(value, bool):
            either = "true, false or null" if self.optional else "true or false"
            raise SettingError(f"{key} must be {either}, got {shown(value)}")


@dataclass(frozen=True)
class ListOf:
    item: Any
    length: int | None = None
    optional: bool = False

    def check(self, key: str, value: Any) -> None:
        if value is None and self.optional:
            return
        count = f"{self.length} " if self.length else ""
        if not isinstance(value, list) or (self.length is not None and len(value) != self.length):
            raise SettingError(f"{key} must be a list of {count}values, e.g. {key}=[...], got {shown(value)}")
        for i, item in enumerate(value):
            self.item.check(f"{key}[{i}]", item)


@dataclass(frozen=True)
class ValidationEvery:
    """trainer.val_check_interval: a number of steps, or a time ("dd:hh:mm:ss")."""

    whole = True  # 1e3 is 1000 steps

    def check(self, key: str, value: Any) -> None:
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and float(value).is_integer()
            and value >= 1
        ):
            return
        if isinstance(value, (str, dict)):
            TimeSpan().check(key, value)
            return
        raise SettingError(
            f"{key} must be a whole number of steps (at least 1) or a time (dd:hh:mm:ss), got {shown(value)}"
        )


@dataclass(frozen=True)
class ValidationBatches:
    """trainer.limit_val_batches: a number of batches, or a fraction of the validation split; none: all of it."""

    def check(self, key: str, value: Any) -> None:
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return
        if value == 0 and not isinstance(value, bool):
            raise SettingError(
                f"{key}=0 turns validation off, but val/loss, val/bpc and best.ckpt need it; "
                "use at least 1 (batches), a fraction such as 0.1, or null for all"
            )
        if not isinstance(value, float) or not math.isfinite(value) or not 0 < value <= 1:
            raise SettingError(
                f"{key} must be a whole number of batches (at least 1), a fraction in (0, 1], or null, got {shown(value)}"
            )


@dataclass(frozen=True)
class TimeSpan:
    """trainer.max_time: "dd:hh:mm:ss", or days/hours/minutes/seconds."""

    optional: bool = True

    def check(self, key: str, value: Any) -> None:
        if value is None:
            return
        if time_budget_seconds(value, key) <= 0:
            raise SettingError(f"{key} must be a time above zero, got {shown(value)}")


@dataclass(frozen=True)
class Devices:
    def check(self, key: str, value: Any) -> None:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or value == -1)):
            return
        if isinstance(value, str) and value.replace(",", "").replace(" ", "").isdigit():
            return
        if (
            isinstance(value, list)
            and value
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        ):
            return
        raise SettingError(
            f"{key} must be a number of devices (1, 2, ..., or -1 for every GPU), auto, or a list of device indices, got {shown(value)}"
        )


def check_writable(key: str, folder: str) -> None:
    """A folder that can be made and written (it need not exist yet)."""
    named, existing = setting_name(key, folder), nearest_folder(key, folder)
    try:
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as err:
        raise SettingError(
            f"{named}: cannot write in {existing} ({err.strerror}); choose a folder you can write to"
        ) from None


def nearest_folder(key: str, folder: str) -> Path:
    """folder, or the nearest of its parents that exists: a folder, not a file."""
    existing = Path(folder).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise SettingError(
            f"{setting_name(key, folder)}: {existing} is a file, not a folder; choose a folder you can write to"
        )
    return existing


def setting_name(key: str, folder: str) -> str:
    if key == "data.cache_dir" and folder == os.environ.get("TINYGPT2_CACHE"):  # what configs/data/*.yaml say
        return f"TINYGPT2_CACHE={folder} (data.cache_dir)"
    return f"{key}={folder}"


def check_link_place(key: str, path: str) -> None:
    """Where a run puts a symlink to itself: free, or a symlink already (it is replaced); never a file or
    folder of the user's, which the link would take the place of."""
    link = Path(path).expanduser().absolute()
    if link.exists() and not link.is_symlink():
        kind = "folder" if link.is_dir() else "file"
        raise SettingError(
            f"{key}={path} is a {kind}, which the run's link to itself would replace; choose another path, "
            f"or {key}=null for no link"
        )
    check_writable(key, str(link.parent))


@dataclass(frozen=True)
class Precision:
    """trainer.precision: null (chosen per device) or a Lightning precision; Lightning checks the name."""

    def check(self, key: str, value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
            raise SettingError(
                f"{key} must be a Lightning precision such as 32-true, bf16-mixed or 16-mixed, got {shown(value)}"
            )


def time_budget_seconds(max_time: Any, key: str = "trainer.max_time") -> float:
    """trainer.max_time ("dd:hh:mm:ss", or a dict of days/hours/minutes/seconds) in seconds."""
    hint = f"{key} must be dd:hh:mm:ss (e.g. 00:00:01:15 for 75 seconds)"
    if isinstance(max_time, dict):
        if not set(max_time) <= {"days", "hours", "minutes", "seconds"} or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for v in max_time.values()
        ):
            raise SettingError(f"{hint} or days/hours/minutes/seconds, got {max_time}")
        return timedelta(**max_time).total_seconds()
    parts = str(max_time).split(":")
    if isinstance(max_time, bool) or len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise SettingError(f"{hint}, got {shown(max_time)}")
    days, hours, minutes, seconds = (int(p) for p in parts)
    return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds).total_seconds()


def as_max_time(max_time: Any) -> str:
    """A time limit written as trainer.max_time is on the command line: dd:hh:mm:ss."""
    seconds = int(time_budget_seconds(max_time))
    return f"{seconds // 86400:02d}:{seconds // 3600 % 24:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


WANDB_MODES = ("auto", "online", "offline", "disabled")
COUNT_LIMIT = 2**31 - 1  # counts beyond this are typos, and overflow the sizes torch and numpy take
STEPS = Number(whole=True, min=1, max=COUNT_LIMIT)
SEED = Number(whole=True, min=0, below=2**32)

# Settings that name local files (or lists of them): made absolute, so a run continues from any folder.
PATH_KEYS = (
    "data.path",
    "data.val_path",
    "data.local_copies",
    "data.cache_dir",
    "tokenizer.path",
    "init_from",
    "runs_root",
    "latest_link",
)

SPEC: dict[str, Any] = {
    "seed": SEED,
    "resume": Text(optional=True),
    "runs_root": Text(),  # (empty: shell.launch.check_places)
    "latest_link": PathText(optional=True, instead="give a path, or latest_link=null for no link"),
    "init_from": PathText(optional=True),
    "tokens_per_step": Number(whole=True, min=1, optional=True),
    "compile": Flag(optional=True),
    "checkpoint.every_n_steps": STEPS,
    "checkpoint.keep": STEPS,
    "samples.enabled": Flag(),
    "samples.prompts": ListOf(Text(), optional=True),
    "samples.max_new_tokens": Number(whole=True, min=1, max=10_000),  # at every validation: longer with generate.py
    "samples.temperature": Number(min=0),
    "samples.top_k": Number(whole=True, min=1, optional=True),
    "samples.seed": SEED,
    "optim.name": Choice(tuple(OPTIMIZERS)),
    "optim.momentum": Number(min=0, below=1),
    "optim.lr": Number(above=0),
    "optim.weight_decay": Number(min=0),
    "optim.betas": ListOf(Number(min=0, below=1), length=2),
    "optim.warmup_steps": Number(whole=True, min=0),
    "optim.schedule": Choice(tuple(SCHEDULES)),
    "optim.min_lr_ratio": Number(min=0, max=1),
    "optim.max_nonfinite_in_a_row": STEPS,
    "tokenizer.kind": Choice(tuple(TOKENIZERS)),
    "tokenizer.vocab_size": Number(whole=True, max=COUNT_LIMIT),  # its least: data.tokenizer (BPE)
    "tokenizer.max_train_chars": STEPS,
    "tokenizer.path": PathText(),
    "tokenizer.dropout": Number(min=0, below=1),
    "tokenizer.dropout_copies": Number(whole=True, min=1, max=64),  # each a copy of train.bin on disk
    "tokenizer.allow_normalized": Flag(),  # train on the text as a pretrained tokenizer's normalizer rewrites it
    "tokenizer.dropout_any_size": Flag(),
    "data.source": Choice(tuple(SOURCES)),
    "data.path": PathText(optional=True),
    "data.url": Text(optional=True),
    "data.local_copies": ListOf(PathText()),
    "data.cache_dir": PathText(instead="give a folder (TINYGPT2_CACHE, when set, gives it)"),
    "data.val_fraction": Number(above=0, below=1),
    "data.num_proc": Number(whole=True, min=1, optional=True),
    "data.shard_chars": Number(whole=True, min=1, optional=True),
    "data.batch_size": STEPS,
    "data.num_workers": Number(whole=True, min=0),
    "data.sample_prompts": ListOf(Text(), optional=True),
    "data.format": Choice(FORMAT_CHOICES),
    "data.one_document_per": Choice(DOCUMENT_UNITS),
    "data.text_column": Text(),
    "data.errors": Choice(TEXT_ERRORS),
    "data.val_path": PathText(optional=True),
    "data.name": Text(),
    "data.config": Text(optional=True),
    "data.split": Text(),
    "data.val_split": Text(optional=True),
    "data.revision": Text(optional=True),
    "data.streaming": Flag(),
    # wandb's own rules, checked before anything starts: they fail only once its run is being created
    "logger.wandb.project": Text(most=128, without="/\\#?%:"),
    "logger.wandb.name": Text(optional=True),
    "logger.wandb.group": Text(optional=True),
    "logger.wandb.tags": ListOf(Text(most=64)),
    "logger.wandb.mode": Choice(WANDB_MODES),
    "logger.wandb.log_model": Flag(),
    "logger.csv": dict,
    "logger.tensorboard": dict,
    "trainer.max_steps": Number(whole=True, min=1, also=(-1,), also_means="with trainer.max_time"),
    "trainer.max_time": TimeSpan(),
    "trainer.max_epochs": Number(whole=True, min=1, also=(-1,), also_means="for no limit", optional=True),
    "trainer.val_check_interval": ValidationEvery(),
    "trainer.check_val_every_n_epoch": Number(whole=True, min=1, optional=True),
    "trainer.limit_val_batches": ValidationBatches(),
    "trainer.log_every_n_steps": STEPS,
    "trainer.gradient_clip_val": Number(min=0, optional=True),
    "trainer.accumulate_grad_batches": STEPS,
    "trainer.enable_progress_bar": Flag(),
    "trainer.enable_model_summary": Flag(),
    "trainer.num_sanity_val_steps": Number(whole=True, min=-1),
    "trainer.accelerator": Text(),
    "trainer.strategy": Text(),
    "trainer.devices": Devices(),
    "trainer.num_nodes": STEPS,
    "trainer.precision": Precision(),
}

# What a value of "???" needs, for the settings that have no default.
REQUIRED_HINTS = {
    "data.path": "data=text needs data.path: a file, a folder or a glob of .txt, .jsonl, .csv or .parquet files",
    "data.name": "data=hub needs data.name: a Hugging Face Hub dataset (e.g. roneneldan/TinyStories) or a local dataset folder",
    "tokenizer.path": "tokenizer=pretrained needs tokenizer.path: a tokenizer.json, or a folder with one (or GPT-2's vocab.json + merges.txt)",
}

# Trainer arguments tinygpt2 sets itself, and what to use instead.
OWN_TRAINER_ARGUMENTS = {
    "logger": "choose trackers with logger=wandb|tensorboard|csv|none",
    "callbacks": "tinygpt2 sets the callbacks",
    "plugins": "tinygpt2 sets the checkpoint plugin",
    "enable_checkpointing": "checkpoints are always written; checkpoint.every_n_steps sets how often",
    "default_root_dir": "the run folder is hydra.run.dir",
    "use_distributed_sampler": "the data module shards batches across processes itself",
    "limit_train_batches": "it would end training before trainer.max_steps with the schedule unfinished; for fewer steps, set trainer.max_steps instead",
    "fast_dev_run": "it runs a batch or two with checkpoints and loggers off; try a setup with debug=default instead",
    "overfit_batches": "it would train on a few batches while the schedule and data order assume the whole run",
    "min_steps": "a run trains exactly trainer.max_steps steps, and would stop validating past them; raise trainer.max_steps",
    "min_epochs": "a run is one pass of trainer.max_steps batches, and would stop validating past it; raise trainer.max_steps",
}


# ---- the check ---------------------------------------------------------------------------------------


# Settings a run cannot do without (a command line may not remove them with ~key).
REQUIRED = (
    "seed",
    "compile",
    "tokens_per_step",
    "checkpoint.every_n_steps",
    "checkpoint.keep",
    "samples.enabled",
    "samples.max_new_tokens",
    "samples.temperature",
    "samples.top_k",
    "samples.seed",
    "optim.lr",
    "optim.weight_decay",
    "optim.betas",
    "optim.warmup_steps",
    "optim.schedule",
    "optim.min_lr_ratio",
    "optim.max_nonfinite_in_a_row",
    "model.n_layer",
    "model.n_head",
    "model.n_embd",
    "model.block_size",
    "tokenizer.kind",
    "data.source",
    "data.batch_size",
    "data.cache_dir",
    "data.val_fraction",
    "trainer.max_steps",
    "trainer.max_time",
    "trainer.strategy",
    "trainer.enable_progress_bar",
    "trainer.val_check_interval",
)


def check_values(values: dict[str, Any]) -> dict[str, Any]:
    """Check every setting of a composed config (a plain dict, interpolations resolved) against SPEC and
    Lightning's own types, then the settings that go together; every problem is reported at once.
    Returns a copy with whole numbers given as 1e3 or 5.0 made ints."""
    needed = [*REQUIRED, *(["tokenizer.vocab_size"] if lookup(values, "tokenizer.kind") == "bpe" else [])]
    missing = [key for key in needed if lookup(values, key) is ABSENT]
    if missing:
        raise SettingError.several(
            [
                f"{key} is missing, and a run needs it; give it a value ({key}=...) instead of removing it"
                for key in missing
            ]
        )
    values = copy.deepcopy(values)
    problems = [problem for key, value in list(leaves(values)) if (problem := check_value(values, key, value))]
    problems += [f"unknown logger '{name}'; use logger=wandb, tensorboard, csv or none (or a list of them)"
                 for name in values.get("logger") or {} if name not in ("wandb", "tensorboard", "csv")]  # fmt: skip
    model = values.get("model") or {}
    for name in WHOLE_MODEL_SETTINGS:  # model.n_embd=1e3 is 1000, as for every other whole-number setting
        if isinstance(model.get(name), float) and model[name].is_integer():
            model[name] = int(model[name])
    try:
        check_model(model)
    except ConfigError as err:
        problems.append(str(err))
    if not problems:  # settings that go together, each known to be of its kind
        problems += list(problems_together(values))
    if problems:
        raise SettingError.several(problems)
    return values


def check_value(values: dict[str, Any], key: str, value: Any) -> str | None:
    """What is wrong with one setting, or None; a whole number given as 1e3 is made an int in values."""
    if value == MISSING:
        return REQUIRED_HINTS.get(key, f"{key} must be given: it has no default; add {key}=...")
    spec = SPEC.get(key)
    try:
        if spec is dict:
            if not isinstance(value, dict) or value:
                return f"{key} takes no settings, got {shown(value)}"
        elif spec is not None:
            spec.check(key, value)
            if getattr(spec, "whole", False) and isinstance(value, float):
                put(values, key, int(value))
        elif key.startswith("trainer."):
            check_trainer_argument(key.split(".", 1)[1], value)
        elif inner := [name for name in SPEC if name.startswith(key + ".")]:  # logger.wandb=offline
            names = ", ".join(inner[:3]) + (", ..." if len(inner) > 3 else "")
            choose = (
                " (loggers are chosen with logger=NAME, a list, or logger=none)" if key.startswith("logger.") else ""
            )
            return f"{key} holds settings ({names}), not one value; set one of them{choose}"
        elif not key.startswith("model."):
            return f"unknown setting '{key}'; check the spelling (python train.py --cfg job lists every setting)"
    except SettingError as err:
        return str(err)
    return None


def leaves(values: dict[str, Any], prefix: str = ""):
    """(dotted key, value) for every setting; a key the spec names is one value, whatever it holds."""
    for name, value in values.items():
        key = f"{prefix}{name}"
        if key == "hydra":
            continue
        if key in SPEC or not isinstance(value, dict):
            yield key, value
        else:  # a group of settings (an empty one, e.g. logger=none, holds nothing to check)
            yield from leaves(value, key + ".")


class _Absent:
    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()  # a setting a config does not have


def lookup(values: Any, key: str) -> Any:
    """The value at a dotted key, or ABSENT."""
    for name in key.split("."):
        if not isinstance(values, dict) or name not in values:
            return ABSENT
        values = values[name]
    return values


def put(values: dict[str, Any], key: str, value: Any) -> None:
    """Set the value at a dotted key (ABSENT removes it)."""
    *path, last = key.split(".")
    for name in path:
        values = values.setdefault(name, {})
    if value is ABSENT:
        values.pop(last, None)
    else:
        values[last] = value


WHOLE_MODEL_SETTINGS = tuple(f.name for f in fields(GPTConfig) if f.type in (int, "int"))


def check_model(model: dict[str, Any]) -> None:
    """The model's shape, checked by GPTConfig itself; vocab_size may still be left to the tokenizer."""
    if model.get("vocab_size") is None:
        model = {**model, "vocab_size": 50257}
    GPTConfig.from_dict(model)


# the values wandb itself reads from WANDB_MODE, and the mode each means (dryrun and run are old names)
WANDB_ENV_MODES = {
    "online": "online",
    "offline": "offline",
    "disabled": "disabled",
    "dryrun": "offline",
    "run": "online",
    "shared": "online",
}


def wandb_credentials_present() -> bool:
    """True when wandb could log in without asking: an API key in the environment or in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    netrc_file = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(netrc_file).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(requested: str) -> str:
    """`auto`: WANDB_MODE if the user set it, else online with credentials, else offline; never a prompt."""
    if requested not in WANDB_MODES:
        raise ValueError(f"logger.wandb.mode must be one of {WANDB_MODES}, got {requested!r}")
    env_mode = os.environ.get("WANDB_MODE")
    # wandb.init stops on a value it does not know, whatever mode it is given
    if env_mode is not None and env_mode not in WANDB_ENV_MODES:
        raise SettingError(
            f"WANDB_MODE={env_mode!r} is not a wandb mode, and wandb reads it whatever logger.wandb.mode says; "
            "set WANDB_MODE to online, offline or disabled, or unset it"
        )
    if requested != "auto":
        return requested
    if env_mode is not None:
        return WANDB_ENV_MODES[env_mode]
    return "online" if wandb_credentials_present() else "offline"


def problems_together(values: dict[str, Any]):
    """Settings that are each fine but cannot work, or would silently train wrongly, together: one line each."""
    trainer, optim = values.get("trainer") or {}, values.get("optim") or {}
    if trainer.get("max_steps") == -1 and not trainer.get("max_time"):
        yield "trainer.max_steps=-1 needs a time limit: set trainer.max_time=00:00:05:00 (dd:hh:mm:ss)"
    if optim.get("name") == "adamw" and "momentum" in optim:  # optim=muon optim.name=adamw: it would be ignored
        yield (
            "optim.momentum is Muon's setting, and AdamW has none (its momentum is optim.betas): for AdamW choose "
            "the group optim=adamw and leave optim.momentum out; for Muon choose optim=muon"
        )
    if optim.get("name") == "muon" and optim.get("momentum") is None:
        yield "optim.name=muon needs optim.momentum; choose the group instead: optim=muon"
    if optim.get("name") == "muon" and trainer.get("strategy") == "fsdp":  # FSDP cannot gather two optimizers' state
        yield (
            "optim=muon does not work with trainer.strategy=fsdp (its checkpoint cannot gather the state of its "
            "two optimizers); use optim=adamw, or trainer.strategy=ddp"
        )
    if optim.get("name") == "muon" and str(trainer.get("precision")).startswith("16"):  # (unscaled twice: a crash)
        yield "optim=muon does not work with float16's gradient scaling; use trainer.precision=bf16-mixed or 32-true"
    if trainer.get("check_val_every_n_epoch") is not None:
        yield (
            "trainer.check_val_every_n_epoch cannot be set: a run is one pass of trainer.max_steps batches; "
            "validate every N steps with trainer.val_check_interval=N"
        )
    if values.get("tokens_per_step") is not None and (trainer.get("accumulate_grad_batches") or 1) != 1:
        yield "set either tokens_per_step or trainer.accumulate_grad_batches, not both"
    yield from problems_of_data_and_trackers(values)


def problems_of_data_and_trackers(values: dict[str, Any]):
    tokenizer = values.get("tokenizer") or {}
    if tokenizer.get("kind") == "pretrained" and not tokenizer.get("path"):
        yield REQUIRED_HINTS["tokenizer.path"]
    if tokenizer.get("kind") == "bpe" and isinstance(tokenizer.get("vocab_size"), int):
        if problem := bpe_vocab_size_problem(tokenizer["vocab_size"]):  # said before the text is read, not after
            yield problem
    wandb = (values.get("logger") or {}).get("wandb")
    if wandb and wandb_mode(wandb["mode"]) == "online" and not wandb_credentials_present():
        # online asked for by WANDB_MODE: unsetting it works for a resumed run too, which keeps its logger.wandb.mode
        offline = "with logger.wandb.mode=offline" if wandb["mode"] == "online" else "by unsetting WANDB_MODE"
        yield (
            "wandb logs online only with an account on this machine: run `wandb login` (or set WANDB_API_KEY), "
            f"or log offline {offline} and upload later with `wandb sync`"
        )


# ---- any other Lightning Trainer argument --------------------------------------------------------------


@functools.cache
def trainer_parameters() -> dict[str, Any]:
    """Lightning Trainer's arguments and their annotations."""
    import lightning as L

    hints = typing.get_type_hints(L.Trainer.__init__)
    return {name: hints.get(name, Any) for name in inspect.signature(L.Trainer.__init__).parameters if name != "self"}


def check_trainer_argument(name: str, value: Any) -> None:
    parameters = trainer_parameters()
    if name not in parameters:
        raise SettingError(unknown_trainer_setting(name, parameters))
    if name in OWN_TRAINER_ARGUMENTS:
        raise SettingError(f"trainer.{name} cannot be set: {OWN_TRAINER_ARGUMENTS[name]}")
    if not fits(value, parameters[name]):
        raise SettingError(f"trainer.{name} must be {describe(parameters[name])}, got {shown(value)}")


def unknown_trainer_setting(name: str, parameters) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(parameters), n=1)
    hint = f"did you mean trainer.{close[0]}? " if close else ""
    return f"unknown setting 'trainer.{name}'; {hint}check the spelling (python train.py --cfg job lists every setting)"


def fits(value: Any, annotation: Any) -> bool:
    """Whether a value from the command line or YAML is of an annotated type (classes other than the
    plain ones cannot come from there, so they do not fit)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args and not (isinstance(value, bool) and not any(isinstance(a, bool) for a in args))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple) or annotation in (list, tuple):
        return isinstance(value, list)
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    return False


def describe(annotation: Any) -> str:
    """The values an annotation admits, in words: "true, false, 'warn' or null"."""
    words = list(dict.fromkeys(alternatives(annotation)))
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else (words or ["a value"])[0]


def alternatives(annotation: Any) -> list[str]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        return [word for a in args for word in alternatives(a)]
    if origin is typing.Literal:
        return [shown(a) for a in args]
    if origin in (list, tuple) or annotation in (list, tuple):
        return ["a list"]
    if origin is dict or annotation is dict:
        return ["a mapping"]
    names = {bool: ["true", "false"], int: ["a whole number"], float: ["a number"], str: ["text"], type(None): ["null"]}
    return names.get(annotation, [])


def probe_trainer(trainer_args: dict[str, Any], strategy: Any, precision: str) -> int:
    """Build a Lightning Trainer from the arguments, as the run will, to let Lightning check them
    (it makes no folder and starts no process); returns the world size it would train on."""
    import lightning as L

    quiet = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        trainer = L.Trainer(
            **{**trainer_args, "enable_progress_bar": False, "enable_model_summary": False},
            strategy=strategy,
            precision=precision,
            logger=False,
            enable_checkpointing=False,
            callbacks=[],
        )
    except Exception as err:  # Lightning's own checks of trainer.*, or a package an accelerator or precision needs
        raise SettingError(f"trainer settings: {(str(err).strip().splitlines() or [type(err).__name__])[0]}") from None
    finally:
        quiet.setLevel(level)
    check_nodes(trainer)
    check_launched(trainer)
    check_launcher(trainer, strategy)
    return trainer.world_size


def check_launched(trainer: Any) -> None:
    """Processes a launcher started (torchrun, SLURM's srun) train as they are: trainer.devices and
    trainer.num_nodes must count them, or each would end in Lightning's ValueError as it began training."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is None or not environment.creates_processes_externally:
        return
    try:
        environment.validate_settings(num_devices=trainer.num_devices, num_nodes=trainer.num_nodes)
    except ValueError:
        launcher = {"TorchElasticEnvironment": "torchrun", "SLURMEnvironment": "SLURM"}.get(
            type(environment).__name__, "the launcher"
        )
        devices, nodes, started = trainer.num_devices, trainer.num_nodes, environment.world_size()
        raise SettingError(
            f"trainer.devices={devices} x trainer.num_nodes={nodes} asks for {devices * nodes} processes, but "
            f"{launcher} started {started}; give trainer.devices as the processes it starts on each machine"
            + (f" (trainer.devices={started // nodes})" if started % nodes == 0 else "")
        ) from None


def check_launcher(trainer: Any, strategy: Any) -> None:
    """A strategy whose processes Python's multiprocessing makes from this one (ddp_spawn, ddp_fork,
    ddp_notebook) trains in them alone: this process would see none of it (a Ctrl-C would end them with
    no checkpoint, and the run's result would lack its training values). Refused for ddp, which starts
    each process as a command of its own, with the same training."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    if isinstance(trainer.strategy.launcher, _MultiProcessingLauncher):
        raise SettingError(
            f"trainer.strategy={strategy} trains in processes made from this one, which a run cannot stop with a "
            "checkpoint nor take its results from; use trainer.strategy=ddp (the same training, each process "
            "started as a command)"
        )


def check_nodes(trainer: Any) -> None:
    """trainer.num_nodes above 1 in a process no launcher told which machine it is (torchrun, SLURM, or
    NODE_RANK by hand) would wait for the other machines' processes for ever: refused."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    told = {"NODE_RANK", "GROUP_RANK"} & os.environ.keys()
    if trainer.num_nodes > 1 and type(environment).__name__ == "LightningEnvironment" and not told:
        raise SettingError(
            f"trainer.num_nodes={trainer.num_nodes} trains on {trainer.num_nodes} machines, but nothing started this "
            "process as one of them: run the same command on each machine under torchrun --nnodes or srun "
            "(README: More than one device or machine), or set NODE_RANK, MASTER_ADDR and MASTER_PORT on each; "
            "on one machine, leave trainer.num_nodes at 1"
        )
