"""What a setting may be: one table (SPEC) of kinds, ranges and choices, checked in one pass over a composed
config, every problem of a command line said together, one `error:` line each (the values themselves live in
configs/). Lightning's other Trainer arguments are checked against its signature, and by a Trainer built as the
run builds it (`probe_trainer`)."""

from __future__ import annotations

import copy
import inspect
import math
import os
import tempfile
import types
import typing
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from data.files import FORMAT_CHOICES
from data.sources import DOCUMENT_UNITS, SOURCES, TEXT_ERRORS
from data.tokenizer import TOKENIZERS, bpe_vocab_size_problem
from model import ConfigError, GPTConfig
from training.optim import OPTIMIZERS, SCHEDULES

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class SettingError(ValueError):
    """A setting that cannot work; the message names it and says how to fix it (`several`: one line each)."""

    @classmethod
    def several(cls, problems: list[str]) -> SettingError:
        return cls("\nerror: ".join(dict.fromkeys(problems)))  # printed after "error: ", as one problem is


def shown(value: Any) -> str:
    """A value as it is written on the command line: 'text', true, null, 0.001."""
    if value is None:
        return "null"
    return repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def plain(config: Any) -> dict[str, Any]:
    """A composed config as plain values, interpolations resolved, without Hydra's own settings."""
    return OmegaConf.to_container(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"]), resolve=True)


# ---- the kinds of value: each a check(key, value) that returns what is wrong, or None -----------------------


@dataclass(frozen=True)
class Number:
    whole: bool = False
    min: float | None = None  # at least
    above: float | None = None  # more than
    max: float | None = None  # at most
    below: float | None = None  # less than
    also: tuple = ()  # a value accepted outside the range, and what it means: (-1, "with trainer.max_time")
    optional: bool = False

    def __call__(self, key: str, value: Any) -> str | None:
        if value is None and self.optional:
            return None
        kind = "a whole number" if self.whole else "a number"
        if not is_number(value):
            return f"{key} must be {kind}, got {shown(value)}"
        if not math.isfinite(value):
            return f"{key} must be a finite number, got {value}"
        if self.whole and not float(value).is_integer():
            return f"{key} must be a whole number, got {value}"
        if self.also and value == self.also[0]:
            return None
        extra = f" (or {self.also[0]} {self.also[1]})" if self.also else ""
        for limit, fails, words in (
            (self.min, lambda b: value < b, "at least"),
            (self.above, lambda b: value <= b, "above"),
            (self.max, lambda b: value > b, "at most"),
            (self.below, lambda b: value >= b, "below"),
        ):
            if limit is not None and fails(limit):
                bound = int(limit) if float(limit).is_integer() else f"{limit:g}"
                return f"{key} must be {words} {bound}{extra}, got {value}"
        return None


def choice(*values: Any):
    def check(key: str, value: Any) -> str | None:
        if value not in values or isinstance(value, bool):
            return f"{key} must be one of {', '.join(map(str, values))}, got {shown(value)}"
        return None

    return check


def text(optional: bool = False, path: str = "", most: int | None = None, without: str = ""):
    """Text; a `path` is never empty (an unset shell variable, data.path=$DATA): `path` says what to do instead."""

    def check(key: str, value: Any) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            return f"{key} must be text, got {shown(value)}"
        if path and not value.strip():
            return f"{key} is empty (an unset shell variable?): {path}"
        if most is not None and not 1 <= len(value) <= most:
            return f"{key} must be 1 to {most} characters, got {shown(value)}"
        if found := sorted({c for c in value if c in without}):
            return f"{key} cannot hold {' '.join(found)}, got {shown(value)}"
        return None

    return check


def flag(optional: bool = False):
    def check(key: str, value: Any) -> str | None:
        if isinstance(value, bool) or (value is None and optional):
            return None
        return f"{key} must be {'true, false or null' if optional else 'true or false'}, got {shown(value)}"

    return check


def list_of(item, length: int | None = None, optional: bool = False):
    def check(key: str, value: Any) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, list) or (length is not None and len(value) != length):
            count = f"{length} " if length else ""
            return f"{key} must be a list of {count}values, e.g. {key}=[...], got {shown(value)}"
        return next(filter(None, (item(f"{key}[{i}]", v) for i, v in enumerate(value))), None)

    return check


def time_span(key: str, value: Any) -> str | None:
    """trainer.max_time: dd:hh:mm:ss, or days/hours/minutes/seconds; null for none."""
    if value is None:
        return None
    try:
        seconds = seconds_of(value, key)
    except SettingError as err:
        return str(err)
    return None if seconds > 0 else f"{key} must be a time above zero, got {shown(value)}"


def seconds_of(max_time: Any, key: str = "trainer.max_time") -> float:
    """A time limit ("dd:hh:mm:ss", or a dict of days/hours/minutes/seconds) in seconds."""
    hint = f"{key} must be dd:hh:mm:ss (e.g. 00:00:01:15 for 75 seconds)"
    if isinstance(max_time, dict):
        units = {"days", "hours", "minutes", "seconds"}
        if set(max_time) <= units and all(is_number(v) and math.isfinite(v) and v >= 0 for v in max_time.values()):
            return timedelta(**max_time).total_seconds()
        raise SettingError(f"{hint} or days/hours/minutes/seconds, got {max_time}")
    parts = str(max_time).split(":")
    if isinstance(max_time, bool) or len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
        raise SettingError(f"{hint}, got {shown(max_time)}")
    days, hours, minutes, seconds = (int(p) for p in parts)
    return timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds).total_seconds()


def as_max_time(max_time: Any) -> str:
    """A time limit as trainer.max_time is written on the command line: dd:hh:mm:ss."""
    s = int(seconds_of(max_time))
    return f"{s // 86400:02d}:{s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def validation_every(key: str, value: Any) -> str | None:
    """trainer.val_check_interval: a whole number of steps, or a time."""
    if is_number(value) and math.isfinite(value) and float(value).is_integer() and value >= 1:
        return None
    if isinstance(value, str | dict):
        return time_span(key, value)
    return f"{key} must be a whole number of steps (at least 1) or a time (dd:hh:mm:ss), got {shown(value)}"


def validation_batches(key: str, value: Any) -> str | None:
    """trainer.limit_val_batches: batches, a fraction of the validation split, or null for all of it."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    if value == 0 and not isinstance(value, bool):
        return (
            f"{key}=0 turns validation off, but val/loss, val/bpc and best.ckpt need it; "
            "use at least 1 (batches), a fraction such as 0.1, or null for all"
        )
    if isinstance(value, float) and math.isfinite(value) and 0 < value <= 1:
        return None
    return f"{key} must be a whole number of batches (at least 1), a fraction in (0, 1], or null, got {shown(value)}"


def no_settings(key: str, value: Any) -> str | None:
    return None if value == {} else f"{key} takes no settings, got {shown(value)}"


WANDB_MODES = ("auto", "online", "offline", "disabled")
COUNT_LIMIT = 2**31 - 1  # counts beyond this are typos, and overflow the sizes torch and numpy take
STEPS = Number(whole=True, min=1, max=COUNT_LIMIT)
SEED = Number(whole=True, min=0, below=2**32)
PATH = "give a path, or leave it out"

# Every setting but the model's (GPTConfig checks those) and Lightning's other Trainer arguments.
SPEC: dict[str, Any] = {
    "seed": SEED,
    "resume": text(optional=True, path="give the run to continue (resume=outputs/DATE/TIME), or leave resume= out"),
    "runs_root": text(path="give a folder, e.g. runs_root=outputs"),
    "latest_link": text(optional=True, path="give a path, or latest_link=null for no link"),
    "init_from": text(optional=True, path=PATH),
    "tokens_per_step": Number(whole=True, min=1, optional=True),
    "compile": flag(optional=True),
    "checkpoint.every_n_steps": STEPS,
    "checkpoint.keep": STEPS,
    "samples.enabled": flag(),
    "samples.prompts": list_of(text(), optional=True),
    "samples.max_new_tokens": Number(whole=True, min=1, max=10_000),  # at every validation: longer with generate.py
    "samples.temperature": Number(min=0),
    "samples.top_k": Number(whole=True, min=1, optional=True),
    "samples.seed": SEED,
    "optim.name": choice(*OPTIMIZERS),
    "optim.momentum": Number(min=0, below=1),
    "optim.lr": Number(above=0),
    "optim.weight_decay": Number(min=0),
    "optim.betas": list_of(Number(min=0, below=1), length=2),
    "optim.warmup_steps": Number(whole=True, min=0),
    "optim.schedule": choice(*SCHEDULES),
    "optim.min_lr_ratio": Number(min=0, max=1),
    "optim.max_nonfinite_in_a_row": STEPS,
    "tokenizer.kind": choice(*TOKENIZERS),
    "tokenizer.vocab_size": Number(whole=True, max=COUNT_LIMIT),  # its least: data.tokenizer (BPE)
    "tokenizer.max_train_chars": STEPS,
    "tokenizer.path": text(path="give a path"),
    "tokenizer.dropout": Number(min=0, below=1),
    "tokenizer.dropout_copies": Number(whole=True, min=1, max=64),  # each a copy of train.bin on disk
    "tokenizer.allow_normalized": flag(),
    "tokenizer.dropout_any_size": flag(),
    "data.source": choice(*SOURCES),
    "data.path": text(optional=True, path=PATH),
    "data.url": text(optional=True),
    "data.local_copies": list_of(text(path="give a path")),
    "data.cache_dir": text(path="give a folder (TINYGPT2_CACHE, when set, gives it)"),
    "data.val_fraction": Number(above=0, below=1),
    "data.num_proc": Number(whole=True, min=1, optional=True),
    "data.shard_chars": Number(whole=True, min=1, optional=True),
    "data.batch_size": STEPS,
    "data.num_workers": Number(whole=True, min=0),
    "data.sample_prompts": list_of(text(), optional=True),
    "data.format": choice(*FORMAT_CHOICES),
    "data.one_document_per": choice(*DOCUMENT_UNITS),
    "data.text_column": text(),
    "data.errors": choice(*TEXT_ERRORS),
    "data.val_path": text(optional=True, path=PATH),
    "data.name": text(),
    "data.config": text(optional=True),
    "data.split": text(),
    "data.val_split": text(optional=True),
    "data.revision": text(optional=True),
    "data.streaming": flag(),
    # wandb's own rules, checked before anything starts: they fail only once its run is being created
    "logger.wandb.project": text(most=128, without="/\\#?%:"),
    "logger.wandb.name": text(optional=True),
    "logger.wandb.group": text(optional=True),
    "logger.wandb.tags": list_of(text(most=64)),
    "logger.wandb.mode": choice(*WANDB_MODES),
    "logger.wandb.log_model": flag(),
    "logger.csv": no_settings,
    "logger.tensorboard": no_settings,
    "trainer.max_steps": Number(whole=True, min=1, also=(-1, "with trainer.max_time")),
    "trainer.max_time": time_span,
    "trainer.max_epochs": Number(whole=True, min=1, also=(-1, "for no limit"), optional=True),
    "trainer.val_check_interval": validation_every,
    "trainer.limit_val_batches": validation_batches,
    "trainer.log_every_n_steps": STEPS,
    "trainer.gradient_clip_val": Number(min=0, optional=True),
    "trainer.accumulate_grad_batches": STEPS,
    "trainer.num_sanity_val_steps": Number(whole=True, min=-1),
    "trainer.num_nodes": STEPS,
}

# Settings a run cannot do without (`~key` may not remove them), and what a "???" of one needs.
REQUIRED = (
    *("seed", "compile", "tokens_per_step", "checkpoint.every_n_steps", "checkpoint.keep"),
    *(f"samples.{k}" for k in ("enabled", "max_new_tokens", "temperature", "top_k", "seed")),
    *(f"optim.{k}" for k in ("lr", "weight_decay", "betas", "warmup_steps", "schedule", "min_lr_ratio")),
    "optim.max_nonfinite_in_a_row",
    *(f"model.{k}" for k in ("n_layer", "n_head", "n_embd", "block_size")),
    *("tokenizer.kind", "data.source", "data.batch_size", "data.cache_dir", "data.val_fraction"),
    *(f"trainer.{k}" for k in ("max_steps", "max_time", "strategy", "enable_progress_bar", "val_check_interval")),
)
REQUIRED_HINTS = {
    "data.path": "data=text needs data.path: a file, a folder or a glob of .txt, .jsonl, .csv or .parquet files",
    "data.name": "data=hub needs data.name: a Hugging Face Hub dataset (e.g. roneneldan/TinyStories) or a local "
    "dataset folder",
    "tokenizer.path": "tokenizer=pretrained needs tokenizer.path: a tokenizer.json, or a folder with one (or GPT-2's "
    "vocab.json + merges.txt)",
}

# Trainer arguments the run sets itself, and what to use instead.
OWN_TRAINER_ARGUMENTS = {
    "logger": "choose trackers with logger=wandb|tensorboard|csv|none",
    "callbacks": "tinygpt2 sets the callbacks",
    "plugins": "tinygpt2 sets the checkpoint plugin",
    "enable_checkpointing": "checkpoints are always written; checkpoint.every_n_steps sets how often",
    "default_root_dir": "the run folder is hydra.run.dir",
    "use_distributed_sampler": "the data module shards batches across processes itself",
    "limit_train_batches": "it would end training before trainer.max_steps with the schedule unfinished; for fewer "
    "steps, set trainer.max_steps instead",
    "fast_dev_run": "it runs a batch or two with checkpoints and loggers off; try a setup with debug=default instead",
    "overfit_batches": "it would train on a few batches while the schedule and data order assume the whole run",
    "min_steps": "a run trains exactly trainer.max_steps steps, and would stop validating past them; raise "
    "trainer.max_steps",
    "min_epochs": "a run is one pass of trainer.max_steps batches, and would stop validating past it; raise "
    "trainer.max_steps",
    "check_val_every_n_epoch": "a run is one pass of trainer.max_steps batches; validate every N steps with "
    "trainer.val_check_interval=N",
}

# Settings that name local files (or lists of them): made absolute, so a run continues from any folder.
PATH_KEYS = ("data.path", "data.val_path", "data.local_copies", "data.cache_dir", "tokenizer.path", "init_from")
PATH_KEYS += ("runs_root", "latest_link")
WHOLE_MODEL_SETTINGS = tuple(f.name for f in fields(GPTConfig) if f.type in (int, "int"))


# ---- one pass over a config ------------------------------------------------------------------------------


def check_values(values: dict[str, Any], choices: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every setting of a composed config (plain values) checked: against SPEC, the model against GPTConfig,
    Lightning's arguments against its signature, then the settings that go together; every problem said at once.
    Returns a copy with whole numbers given as 1e3 or 5.0 made ints. `choices`: each group's choice."""
    bpe = lookup(values, "tokenizer.kind") == "bpe"
    missing = [key for key in [*REQUIRED, *(["tokenizer.vocab_size"] if bpe else [])] if lookup(values, key) is ABSENT]
    if missing:
        raise SettingError.several(
            [
                f"{key} is missing, and a run needs it; give it a value ({key}=...) instead of removing it"
                for key in missing
            ]
        )
    values, choices = copy.deepcopy(values), choices or {}
    strays = [key for key, _ in leaves(values) if stray(key, choices)]
    problems = [unknown_setting(key, choices) for key in strays]
    problems += [
        p for key, value in list(leaves(values)) if key not in strays and (p := check_value(values, key, value))
    ]
    problems += [f"unknown logger '{name}'; use logger=wandb, tensorboard, csv or none (or a list of them)"
                 for name in values.get("logger") or {} if name not in ("wandb", "tensorboard", "csv")]  # fmt: skip
    problems += list(changed_kinds(values, choices))
    model = values.get("model") or {}
    for name in WHOLE_MODEL_SETTINGS:  # model.n_embd=1e3 is 1000, as for every other whole-number setting
        if isinstance(model.get(name), float) and model[name].is_integer():
            model[name] = int(model[name])
    try:
        GPTConfig.from_dict({**model, "vocab_size": model.get("vocab_size") or 50257})  # the tokenizer's may come later
    except ConfigError as err:
        problems.append(str(err))
    if not problems:  # settings that go together, each known to be of its kind
        problems += list(problems_together(values))
    if problems:
        raise SettingError.several(problems)
    return values


def check_value(values: dict[str, Any], key: str, value: Any) -> str | None:
    """What is wrong with one setting, or None; a whole number given as 1e3 is made an int in values."""
    if value == "???":
        return REQUIRED_HINTS.get(key, f"{key} must be given: it has no default; add {key}=...")
    if key in SPEC:
        problem = SPEC[key](key, value)
        if problem is None and getattr(SPEC[key], "whole", False) and isinstance(value, float):
            put(values, key, int(value))
        return problem
    if key.startswith("trainer."):
        return trainer_argument_problem(key.split(".", 1)[1], value)
    if inner := [name for name in SPEC if name.startswith(key + ".")]:  # logger.wandb=offline
        names = ", ".join(inner[:3]) + (", ..." if len(inner) > 3 else "")
        how = " (loggers are chosen with logger=NAME, a list, or logger=none)" if key.startswith("logger.") else ""
        return f"{key} holds settings ({names}), not one value; set one of them{how}"
    if not key.startswith("model."):
        return unknown_setting(key)
    return None


def leaves(values: dict[str, Any], prefix: str = ""):
    """(dotted key, value) for every setting; a key SPEC names is one value, whatever it holds."""
    for name, value in values.items():
        key = f"{prefix}{name}"
        if key in SPEC or not isinstance(value, dict):
            yield key, value
        else:  # a group of settings (an empty one, logger=none, holds nothing)
            yield from leaves(value, key + ".")


# The setting that says what each choice of a group is: changed alone, it would keep the other choice's settings.
KIND_SETTINGS = {"data": "source", "tokenizer": "kind"}


def stray(key: str, choices: dict[str, Any]) -> bool:
    """A setting of data or tokenizer that the group's choice has not (+data.split=train beside data=shakespeare)."""
    group, _, name = key.partition(".")
    chosen = choices.get(group)
    if (
        group not in KIND_SETTINGS
        or not isinstance(chosen, str)
        or not (CONFIG_DIR / group / f"{chosen}.yaml").is_file()
    ):
        return False
    return lookup(settings_of(group, chosen), name) is ABSENT


def changed_kinds(values: dict[str, Any], choices: dict[str, Any]):
    """data.source=pydoc beside data=shakespeare's settings: refused for the choice, which brings its own."""
    for group, field in KIND_SETTINGS.items():
        chosen, given = choices.get(group), lookup(values, f"{group}.{field}")
        made = settings_of(group, chosen).get(field) if chosen else ABSENT
        if made is not ABSENT and given != made:
            instead = f"{group}={given}" if (CONFIG_DIR / group / f"{given}.yaml").is_file() else f"{group}=NAME"
            yield (
                f"{group}.{field}={given} would change the kind of {group}={chosen} and keep its settings; choose the "
                f"{group} itself instead: {instead}"
            )


def problems_together(values: dict[str, Any]):
    """Settings that are each fine but cannot work, or would silently train wrongly, together: one line each."""
    trainer, optim, tokenizer = values["trainer"], values["optim"], values["tokenizer"]
    if trainer["max_steps"] == -1 and not trainer.get("max_time"):
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
    if optim.get("name") == "muon" and str(trainer.get("precision")).startswith("16"):  # unscaled twice: a crash
        yield "optim=muon does not work with float16's gradient scaling; use trainer.precision=bf16-mixed or 32-true"
    if values.get("tokens_per_step") is not None and (trainer.get("accumulate_grad_batches") or 1) != 1:
        yield "set either tokens_per_step or trainer.accumulate_grad_batches, not both"
    if tokenizer["kind"] == "pretrained" and not tokenizer.get("path"):
        yield REQUIRED_HINTS["tokenizer.path"]
    if tokenizer["kind"] == "bpe" and (problem := bpe_vocab_size_problem(tokenizer["vocab_size"])):
        yield problem  # said before the text is read, not after
    wandb = (values.get("logger") or {}).get("wandb")
    if wandb and wandb_mode(wandb["mode"]) == "online" and not wandb_credentials_present():
        # online asked for by WANDB_MODE: unsetting it works for a resumed run too, which keeps its logger.wandb.mode
        offline = "with logger.wandb.mode=offline" if wandb["mode"] == "online" else "by unsetting WANDB_MODE"
        yield (
            "wandb logs online only with an account on this machine: run `wandb login` (or set WANDB_API_KEY), "
            f"or log offline {offline} and upload later with `wandb sync`"
        )


# ---- the settings configs/ offers ------------------------------------------------------------------------


def choices_of(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def settings_of(group: str, name: str) -> dict[str, Any]:
    """What configs/<group>/<name>.yaml sets ({} where there is no such file)."""
    file = CONFIG_DIR / group / f"{name}.yaml"
    values = OmegaConf.to_container(OmegaConf.load(file)) if file.is_file() else {}
    return values if isinstance(values, dict) else {}


def unknown_setting(key: str, choices: dict[str, Any] | None = None, close_to: list[str] = ()) -> str:
    """Why key is not a setting, and what to type instead: the one meant, or the choice of its group that has it."""
    import difflib

    group, _, name = key.partition(".")
    if group == "logger" and name and "." not in name:
        if name in choices_of("logger"):
            return (f"unknown setting '{key}': the loggers chosen do not include {name}; choose loggers with "
                    f"logger=NAME or a list, e.g. logger=[csv,{name}]")  # fmt: skip
        return (
            f"unknown setting '{key}': {name} is no logger; choose loggers with logger=NAME or a list of: "
            + ", ".join(choices_of("logger"))
        )
    made = (choices or {}).get(group)
    having = [c for c in choices_of(group) if lookup(settings_of(group, c), name) is not ABSENT] if name else []
    if isinstance(made, str) and having and made not in having:
        names = " or ".join(f"{group}={c}" for c in having)
        return (f"unknown setting '{key}': {group}={made} has no such setting, {names} has; choose {names} to use "
                "it, or leave it out")  # fmt: skip
    close = difflib.get_close_matches(key, [*close_to, *SPEC], n=1, cutoff=0.75)
    if not close and group == "trainer":
        close = difflib.get_close_matches(name, list(trainer_parameters()), n=1, cutoff=0.75)
        close = [f"trainer.{c}" for c in close]
    hint = f" (did you mean {close[0]}?)" if close and close[0] != key else ""
    return f"unknown setting '{key}'{hint}; check the spelling (python train.py --cfg job lists every setting)"


# ---- Lightning's Trainer arguments -------------------------------------------------------------------------


def trainer_parameters() -> dict[str, Any]:
    """Lightning Trainer's arguments and their annotations."""
    import lightning as L

    hints = typing.get_type_hints(L.Trainer.__init__)
    return {name: hints.get(name, Any) for name in inspect.signature(L.Trainer.__init__).parameters if name != "self"}


def trainer_argument_problem(name: str, value: Any) -> str | None:
    parameters = trainer_parameters()
    if name in OWN_TRAINER_ARGUMENTS and not (name == "check_val_every_n_epoch" and value is None):
        return f"trainer.{name} cannot be set: {OWN_TRAINER_ARGUMENTS[name]}"
    if name not in parameters:
        return unknown_setting(f"trainer.{name}")
    if not fits(value, parameters[name]):
        words = list(dict.fromkeys(described(parameters[name])))
        either = ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]
        return f"trainer.{name} must be {either}, got {shown(value)}"
    return None


def fits(value: Any, annotation: Any) -> bool:
    """Whether a value from the command line or YAML is of an annotated type (no class but the plain ones is)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args and not (isinstance(value, bool) and not any(isinstance(a, bool) for a in args))
    plain = {type(None): value is None, bool: isinstance(value, bool), int: is_number(value) and isinstance(value, int)}
    plain |= {float: is_number(value), str: isinstance(value, str)}
    if annotation in plain:
        return plain[annotation]
    if origin in (list, tuple, dict) or annotation in (list, tuple, dict):
        return isinstance(value, dict if dict in (origin, annotation) else list)
    return False


def described(annotation: Any) -> list[str]:
    """The values an annotation admits, in words: true, false, 'warn', null."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        return [word for a in args for word in described(a)]
    if origin is typing.Literal:
        return [shown(a) for a in args]
    names = {bool: ["true", "false"], int: ["a whole number"], float: ["a number"], str: ["text"], type(None): ["null"]}
    return names.get(
        annotation, ["a list" if list in (origin, annotation) or tuple in (origin, annotation) else "a mapping"]
    )


def probe_trainer(trainer_args: dict[str, Any], strategy: Any, precision: str) -> int:
    """A Trainer built as the run builds it, for Lightning to check its arguments (making nothing); its world size."""
    import logging

    import lightning as L

    if any(word in str(strategy) for word in ("spawn", "fork", "notebook")):
        raise SettingError(
            f"trainer.strategy={strategy} trains in processes made from this one, which a run cannot stop with a "
            "checkpoint nor take its results from; use trainer.strategy=ddp (the same training, each process "
            "started as a command)"
        )
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
        )
    except Exception as err:  # Lightning's own checks, or a package an accelerator or precision needs
        raise SettingError(f"trainer settings: {(str(err).strip().splitlines() or [type(err).__name__])[0]}") from None
    finally:
        quiet.setLevel(level)
    check_launch(trainer)
    return trainer.world_size


def check_launch(trainer: Any) -> None:
    """Machines and processes a launcher started for the run, as many as its settings count."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    environment = getattr(trainer.strategy, "cluster_environment", None)
    told = {"NODE_RANK", "GROUP_RANK"} & os.environ.keys()
    if trainer.num_nodes > 1 and isinstance(environment, LightningEnvironment) and not told:
        raise SettingError(
            f"trainer.num_nodes={trainer.num_nodes} trains on {trainer.num_nodes} machines, but nothing started this "
            "process as one of them: run the same command on each machine under torchrun --nnodes or srun (README: "
            "More than one device or machine), or set NODE_RANK, MASTER_ADDR and MASTER_PORT on each; on one "
            "machine, leave trainer.num_nodes at 1"
        )
    if environment is not None and environment.creates_processes_externally:  # torchrun, srun: they must be counted
        try:
            environment.validate_settings(num_devices=trainer.num_devices, num_nodes=trainer.num_nodes)
        except ValueError:
            names = {"TorchElasticEnvironment": "torchrun", "SLURMEnvironment": "SLURM"}
            launcher, started = names.get(type(environment).__name__, "the launcher"), environment.world_size()
            devices, nodes = trainer.num_devices, trainer.num_nodes
            raise SettingError(
                f"trainer.devices={devices} x trainer.num_nodes={nodes} asks for {devices * nodes} processes, but "
                f"{launcher} started {started}; give trainer.devices as the processes it starts on each machine"
                + (f" (trainer.devices={started // nodes})" if started % nodes == 0 else "")
            ) from None


# the values wandb itself reads from WANDB_MODE, and the mode each means (dryrun and run are old names)
WANDB_ENV_MODES = {"online": "online", "offline": "offline", "disabled": "disabled", "dryrun": "offline"}
WANDB_ENV_MODES |= {"run": "online", "shared": "online"}


def wandb_credentials_present() -> bool:
    """Whether wandb could log in without asking: an API key in the environment or in ~/.netrc."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(requested: str) -> str:
    """`auto`: WANDB_MODE if the user set it, else online with credentials, else offline; never a prompt."""
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode is not None and env_mode not in WANDB_ENV_MODES:  # wandb.init stops on it, whatever it is given
        raise SettingError(
            f"WANDB_MODE={env_mode!r} is not a wandb mode, and wandb reads it whatever logger.wandb.mode says; "
            "set WANDB_MODE to online, offline or disabled, or unset it"
        )
    if requested != "auto":
        return requested
    if env_mode is not None:
        return WANDB_ENV_MODES[env_mode]
    return "online" if wandb_credentials_present() else "offline"


def check_writable(key: str, folder: str) -> None:
    """A folder that can be made and written (it need not exist yet)."""
    existing = nearest_folder(key, folder)
    try:
        tempfile.TemporaryDirectory(dir=existing).cleanup()
    except OSError as err:
        raise SettingError(
            f"{setting_name(key, folder)}: cannot write in {existing} ({err.strerror}); choose a folder you can write to"
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
    """Where a run puts a link to itself: free, or a link already (replaced); never a file or folder of yours."""
    link = Path(path).expanduser().absolute()
    if link.exists() and not link.is_symlink():
        kind = "folder" if link.is_dir() else "file"
        raise SettingError(
            f"{key}={path} is a {kind}, which the run's link to itself would replace; choose another path, "
            f"or {key}=null for no link"
        )
    check_writable(key, str(link.parent))


class Absent:
    def __repr__(self) -> str:
        return "absent"


ABSENT = Absent()  # a setting a config does not have


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


def differing_leaves(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the settings that differ between two nested configs (those present in one only too)."""
    left, right = (a if isinstance(a, dict) else {}), (b if isinstance(b, dict) else {})
    if prefix not in SPEC and (left or right):
        names = dict.fromkeys([*left, *right])
        return [
            k
            for n in names
            for k in differing_leaves(left.get(n, ABSENT), right.get(n, ABSENT), f"{prefix}.{n}".lstrip("."))
        ]
    return [prefix] if a != b or (type(a) is bool) != (type(b) is bool) else []
