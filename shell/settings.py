"""A run's settings, settled once: the composed config checked in full (shell.checks) and made final (the
model's shape settled with the tokenizer and init_from, the global batch and accumulation worked out, the
precision and strategy chosen, the data prepared) before the run trains. A resumed run starts from its
checkpoint's settings, with what the command line may change. `RunSettings.saved()` is what config.yaml
and every checkpoint hold."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer

from checkpoint import MACHINE_CHOSEN, PREPARED, CheckpointError, DamagedCheckpoint, check_sums, read_header
from data import DataError
from data.cache import TokenCache, discard
from data.prepare import check_sizes, corpus_key, prepare_corpus, unknown_tokens, usable_cores
from data.tokenizer import eot_id
from generation.session import PromptError, encode_prompt
from model import ConfigError, GPTConfig
from shell.checks import (
    ABSENT,
    CONFIG_DIR,
    PATH_KEYS,
    SPEC,
    SettingError,
    as_max_time,
    check_link_place,
    check_values,
    differing_leaves,
    lookup,
    nearest_folder,
    probe_trainer,
    put,
    seconds_of,
    settings_of,
    shown,
)
from shell.folders import RunFolder, process_rank, step_of
from shell.init_from import Start, kept_tokenizer, missing_source, start_from
from shell.machine import Machine, choose_compile, choose_precision
from shell.memory import check_fits, process_count_here, this_machine_free, tight_fit
from training.run_settings import NOT_TRAINER_ARGUMENTS, RunSettings, sample_prompts

log = logging.getLogger(__name__)

# Settings that say where runs live and which to continue, not what a run is.
LAUNCH_KEYS = ("resume", "runs_root", "latest_link")
# Settings a resumed run may change (a key, or every key under a prefix ending in "."): how long it runs, how
# it checkpoints, validates, samples and reports, the hardware (the global batch, tokens_per_step, stays, so
# the accumulation follows the devices), how the data is read and where wandb logs.
CHANGEABLE_ON_RESUME = ("trainer.max_steps", "trainer.max_time", "checkpoint.", "samples.", "compile")
CHANGEABLE_ON_RESUME += tuple(f"trainer.{k}" for k in ("val_check_interval", "limit_val_batches", "log_every_n_steps"))
CHANGEABLE_ON_RESUME += tuple(f"trainer.{k}" for k in ("enable_progress_bar", "enable_model_summary", "profiler"))
CHANGEABLE_ON_RESUME += tuple(f"trainer.{k}" for k in ("accelerator", "devices", "num_nodes", "strategy", "precision"))
CHANGEABLE_ON_RESUME += tuple(f"data.{k}" for k in ("num_proc", "num_workers", "cache_dir", "shard_chars"))
CHANGEABLE_ON_RESUME += ("data.local_copies", "data.url", "logger.wandb.mode")  # (that it is the same text is checked)
# Settings whose requested value means "work it out", and so matches whatever the run worked out.
WORKED_OUT = {"model.vocab_size": None, "tokens_per_step": None, "trainer.accumulate_grad_batches": 1}
# Settings that, left null, are chosen for the machine; the saved settings list those a run's command line left
# to it (MACHINE_CHOSEN), so that a run continued on other hardware is given that machine's choice.
MACHINE_KEYS = ("trainer.precision", "compile")
# Passes over a stand-in corpus (the offline pydoc text data=shakespeare falls back to) after which a run of
# it stops, without and with BPE-dropout: more overfit so small a text (bench/README.md, "The offline fallback").
FALLBACK_PASSES, FALLBACK_PASSES_BPE_DROPOUT = 8, 14
# The most micro-batches per optimizer step and device: GPT-3's 3.2M-token batch in 64-token micro-batches is
# 50,000. More is a slip (tokens_per_step=2**30, a figure in bytes): a run that would only seem to hang.
MAX_ACCUMULATION = 65_536


class RunFinished(SettingError):
    """A run resumed without steps or time left to train: finished."""


def warn(message: str) -> None:
    """A warning about the run's settings, said by the first process only (every process settles them)."""
    if process_rank() == 0:
        log.warning(message)


# ---- the settings a command line names ---------------------------------------------------------------------


def named_settings(overrides: Iterable[str], requested: dict[str, Any]) -> list[str]:
    """The settings a command line gives, as dotted keys: those it names (a group's choice, model=baby, names
    each of its settings), and those the recipes it chooses set (experiment=..., debug=...)."""
    named: set[str] = set()
    for override in overrides:
        key, _, choice = override.lstrip("+~").partition("=")
        if key in ("experiment", "debug", "hparams_search") and (CONFIG_DIR / key / f"{choice}.yaml").is_file():
            recipe = {k: v for k, v in settings_of(key, choice).items() if k != "hydra"}
            groups = [next(iter(d)).split("/")[-1] for d in recipe.pop("defaults", []) if isinstance(d, dict)]
            named |= {k for item in [*groups, *differing_leaves(recipe, ABSENT)] for k in expand(item, requested)}
        elif not key.startswith("hydra."):
            named |= set(expand(key, requested))
    return sorted(named)


def expand(key: str, values: dict[str, Any]) -> list[str]:
    """A dotted key, or, for a group's key, each of its settings in `values`."""
    return differing_leaves(lookup(values, key), ABSENT, key) or [key]


# ---- a new run --------------------------------------------------------------------------------------------


def check(values: dict[str, Any], choices: dict[str, Any], new_run: bool = True) -> tuple[dict[str, Any], int]:
    """Every setting checked, paths made absolute, precision and compile chosen for the machine and the world
    size Lightning would use found; nothing is made. For a new run without init_from (whose weights settle the
    shape later) the global batch is checked too. Returns (values, world size)."""
    values = check_values(values, choices)
    if new_run and values.get("init_from") and not Path(values["init_from"]).expanduser().exists():
        raise CheckpointError(missing_source(values["init_from"]))
    nearest_folder("data.cache_dir", values["data"]["cache_dir"])  # a shared read-only cache serves what it holds
    if values.get("latest_link"):
        check_link_place("latest_link", values["latest_link"])
    for key in PATH_KEYS:
        if (value := lookup(values, key)) is not ABSENT:
            put(values, key, absolute(value))
    trainer, machine = values["trainer"], Machine.this()
    accelerator, devices = str(trainer.get("accelerator", "auto")), trainer.get("devices", "auto")
    if accelerator in ("gpu", "cuda") and not machine.cuda:
        raise SettingError(
            f"trainer.accelerator={accelerator}: this machine has no CUDA GPU; use trainer.accelerator=cpu or auto"
        )
    if accelerator == "mps" and not torch.backends.mps.is_available():
        raise SettingError("trainer.accelerator=mps: MPS is not available here; use trainer.accelerator=cpu or auto")
    if machine.on_cpu(accelerator) and (devices == -1 or isinstance(devices, list) or "," in str(devices)):
        raise SettingError(
            f"trainer.devices={shown(devices)} is for GPUs (-1: every one; a list: the ones named), and this run "
            "trains on CPUs, where a device is a process: give their number, e.g. trainer.devices=2 (this machine "
            f"has {usable_cores()} CPU cores)"
        )
    shape = None if new_run else (GPTConfig.from_dict(values["model"]), values["data"]["batch_size"])
    trainer["precision"] = choose_precision(trainer.get("precision"), accelerator, machine, shape)
    values["compile"] = choose_compile(values.get("compile"), accelerator, machine)
    if trainer.get("strategy") == "fsdp" and values["samples"]["enabled"]:  # the sharded model runs on all at once
        values["samples"]["enabled"] = False
        warn("trainer.strategy=fsdp: no text samples after validation (samples.enabled=false), as the sharded model "
             "runs only on all processes together; sample from the checkpoints with generate.py")  # fmt: skip
    strategy = "ddp" if trainer.get("strategy") == "fsdp" else trainer.get("strategy", "auto")  # the same processes
    arguments = {k: v for k, v in trainer.items() if k not in NOT_TRAINER_ARGUMENTS}
    world_size = probe_trainer(arguments, strategy, trainer["precision"])
    if new_run and not values.get("init_from"):
        global_batch(values, world_size)
    return values, world_size


def settle_new(
    requested: dict[str, Any], named: list[str], choices: dict[str, Any]
) -> tuple[RunSettings, Start | None]:
    """A new run's settings, and what init_from starts it from (its shape and tokenizer are the run's)."""
    values, world_size = check(requested, choices)
    asked = {key.split(".", 1)[1] for key in named if key.startswith("model.")}
    start = start_from(OmegaConf.create(values), asked)
    if start:
        values["model"] = start.config.to_dict()
        values["tokenizer"] = kept_tokenizer(values["tokenizer"], start, named)
    tokens = prepare(values, given=start.tokenizer if start else None)
    try:
        model = final_model(values["model"], tokens.meta["vocab_size"])
        values["model"] = model.to_dict()
        check_sizes(tokens, model.block_size, values["data"])
        values["tokens_per_step"], accumulation = global_batch(values, world_size)
        check_memory(values, model, world_size)
        size_to_fallback(values, tokens, named)
        fit_warmup(values)
        check_sample_prompts(values, tokens.tokenizer_json, named)
    except (SettingError, ConfigError, DataError):
        if tokens.made_now:  # refused: the entry made for it goes too
            discard(tokens)
        raise
    if unknown := unknown_tokens(tokens):
        warn(unknown)
    values["trainer"]["accumulate_grad_batches"] = accumulation
    chosen = tuple(key for key in MACHINE_KEYS if lookup(requested, key) in (None, ABSENT))
    if "trainer.precision" in chosen:  # now that the shape is final (on a CPU with bf16, timed for it)
        trainer = values["trainer"]
        shape = (model, values["data"]["batch_size"])
        trainer["precision"] = choose_precision(None, str(trainer.get("accelerator", "auto")), Machine.this(), shape)
    return RunSettings(values, model, tokens, world_size, accumulation, machine_chosen=chosen), start


def global_batch(values: dict[str, Any], world_size: int) -> tuple[int, int]:
    """(tokens per optimizer step, micro-batches per step and device), from tokens_per_step (the global batch in
    tokens, the same on any number of devices) or, left null, trainer.accumulate_grad_batches."""
    batch, block = values["data"]["batch_size"], values["model"]["block_size"]
    micro, tokens = batch * block * world_size, values.get("tokens_per_step")
    if tokens is None:
        accumulation = values["trainer"].get("accumulate_grad_batches") or 1
        given = f"trainer.accumulate_grad_batches={accumulation} is {accumulation:,} micro-batches"
        fix = f"trainer.accumulate_grad_batches={MAX_ACCUMULATION} or less"
    elif tokens < micro or tokens % micro:
        raise SettingError(
            f"tokens_per_step={tokens} is not a multiple of data.batch_size x model.block_size x devices = "
            f"{batch} x {block} x {world_size} = {micro}; use e.g. {max(1, round(tokens / micro)) * micro}"
        )
    else:
        accumulation = tokens // micro
        given = f"tokens_per_step={tokens} is {accumulation:,} micro-batches"
        fix = f"tokens_per_step={MAX_ACCUMULATION * micro} or less (the global batch in tokens)"
    if accumulation > MAX_ACCUMULATION:
        raise SettingError(
            f"{given} of data.batch_size x model.block_size x devices = {batch} x {block} x {world_size} = {micro:,} "
            f"tokens per optimizer step, more than the {MAX_ACCUMULATION:,} any sensible run takes (a step would "
            f"seem to hang); use {fix}, or a larger data.batch_size"
        )
    return micro * accumulation, accumulation


def final_model(model: dict[str, Any], tokenizer_vocab: int) -> GPTConfig:
    """The model, with vocab_size the tokenizer's unless it is set."""
    if model.get("vocab_size") is not None and model["vocab_size"] < tokenizer_vocab:
        raise SettingError(
            f"model.vocab_size={model['vocab_size']} is smaller than the tokenizer's {tokenizer_vocab} tokens; "
            "leave model.vocab_size unset (null) to take the tokenizer's"
        )
    return GPTConfig.from_dict({**model, "vocab_size": model.get("vocab_size") or tokenizer_vocab})


def check_memory(values: dict[str, Any], model: GPTConfig, world_size: int) -> None:
    """A CPU run whose training step cannot fit in the memory free here is refused (a GPU's own error says so)."""
    trainer = values["trainer"]
    if not Machine.this().on_cpu(str(trainer.get("accelerator", "auto"))):
        return
    processes = process_count_here(world_size, trainer.get("num_nodes") or 1)
    shape = (model, values["data"]["batch_size"], trainer["precision"], values["optim"].get("name", "adamw"), processes)
    if problem := check_fits(*shape, this_machine_free()):
        raise SettingError(problem)
    if tight := tight_fit(*shape, this_machine_free()):
        warn(tight)
    if processes > (cores := usable_cores()):
        warn(f"trainer.devices={processes} starts {processes} training processes on this machine's {cores} CPU cores: "
             f"they take turns on the cores, so the run goes slower than with trainer.devices={cores}")  # fmt: skip


def size_to_fallback(values: dict[str, Any], tokens: TokenCache, named: Iterable[str]) -> None:
    """A run on a stand-in corpus (tokens.fallback says why) is cut to FALLBACK_PASSES over its training tokens
    unless the command line sets trainer.max_steps, and its samples start from <|endoftext|> (the data's own
    prompts belong to the text it lacks); said in one warning line."""
    if not tokens.fallback:
        return
    trainer, train_tokens = values["trainer"], tokens.meta["train_tokens"]
    passes = FALLBACK_PASSES_BPE_DROPOUT if tokens.meta.get("dropout") else FALLBACK_PASSES
    planned, steps = (
        trainer["max_steps"],
        max(-(-passes * train_tokens // values["tokens_per_step"]), values["optim"]["warmup_steps"] + 1),
    )
    cut = "trainer.max_steps" not in named and (planned == -1 or planned > steps)
    values["samples"]["prompts"] = values["samples"]["prompts"] or [""]
    if cut:
        trainer["max_steps"] = steps
        was = "the time budget" if planned == -1 else f"{planned:,}"
        length = f"for {steps:,} steps ({passes} passes over its {train_tokens:,} training tokens) rather than {was}, as more would overfit it"
    else:
        length = f"for trainer.max_steps={planned:,} as given ({planned * values['tokens_per_step'] / train_tokens:.1f} passes)"
    chars = tokens.meta["train_chars"] + tokens.meta["val_chars"]
    warn(f"{tokens.fallback}: training on the offline pydoc corpus ({chars:,} characters of Python's help texts) "
         f"instead, {length}; set data.path=/path/to/input.txt to use a local copy")  # fmt: skip


def fit_warmup(values: dict[str, Any]) -> None:
    """A warmup as long as the run or longer (trainer.max_steps=20 beside the default 50) is shortened to a tenth
    of the run, said in one line: a short run is what the command line asked for."""
    steps, warmup = values["trainer"]["max_steps"], values["optim"]["warmup_steps"]
    if 0 < steps <= warmup:
        values["optim"]["warmup_steps"] = steps // 10
        if process_rank() == 0:
            log.info("optim.warmup_steps=%d is not shorter than the run's %d step%s: warming up over %d instead",
                     warmup, steps, "" if steps == 1 else "s", steps // 10)  # fmt: skip


def check_sample_prompts(values: dict[str, Any], tokenizer_json: str, named: Iterable[str] | None = None) -> None:
    """A sample prompt the command line gave that generate.py would refuse is refused now, not at the first
    validation; one the user did not choose (the data's own) is dropped with one warning line, and with none
    left the samples start from <|endoftext|>, or are turned off. `named`: None for a resumed run."""
    if not values["samples"]["enabled"]:
        return
    tokenizer = Tokenizer.from_str(tokenizer_json)
    key = "samples.prompts" if values["samples"]["prompts"] else "data.sample_prompts"
    chosen = any(name == key or name.startswith(f"{key}.") for name in named or ())
    kept = []
    for prompt in sample_prompts(values):
        try:
            encode_prompt(tokenizer, prompt, eot_id(tokenizer))
            kept.append(prompt)
        except PromptError as err:
            if chosen and prompt:  # (an empty prompt is no choice: data=text's, for one)
                raise SettingError(f"{key}: {prompt!r} cannot be a sample prompt: {err}") from None
            if prompt:
                warn(f"{key}: the text samples leave out {prompt!r}, which this tokenizer cannot encode ({err})")
    if kept == sample_prompts(values):
        return
    if kept or eot_id(tokenizer) is not None:
        values["samples"]["prompts"] = kept or [""]
    else:
        values["samples"]["enabled"] = False
        warn("no text samples in this run: its tokenizer has no <|endoftext|> to start them from; give prompts to "
             "start them from (samples.prompts='[ROMEO:]')")  # fmt: skip


def prepare(values: dict[str, Any], given: Tokenizer | None) -> TokenCache:
    return prepare_corpus(OmegaConf.create(values["data"]), OmegaConf.create(values["tokenizer"]), given)


def absolute(value: Any) -> Any:
    """A local path (or a list of them) made absolute, ~ expanded; other values (none, a URL) as they are."""
    if isinstance(value, list):
        return [absolute(item) for item in value]
    if not isinstance(value, str) or not value or value == "???" or "://" in value:
        return value
    return os.path.abspath(os.path.expanduser(value))


# ---- a resumed run ----------------------------------------------------------------------------------------


def settle_resumed(checkpoint: Path, requested: dict[str, Any], named: list[str], overrides: list[str]) -> RunSettings:
    """A resumed run's settings: its checkpoint's, with the named settings that may change taken from the command
    line (any other that differs is refused, naming both values), checked, with steps left to train, on the data
    it started with, and what was chosen for the machine it started on chosen again for this one."""
    header = read_run_header(checkpoint)
    saved = dict(header["settings"])
    prepared = saved.pop(PREPARED, None) or {}
    left_before = saved.pop(MACHINE_CHOSEN, None) or []  # runs saved before the list keep their values
    run = RunFolder(checkpoint.parent.parent)
    values = continue_values(saved, requested, named, run.path, typed_choices(overrides))
    at_its_end = run.is_finished() and step_of(run.checkpoint_to_resume()) <= header["step"]
    check_continuation(values, header["step"], run.is_finished(), saved["trainer"] if at_its_end else None)
    before = {key: lookup(values, key) for key in left_before if key in MACHINE_KEYS and key not in named}
    for key in before:
        put(values, key, None)  # for check() to choose for this machine
    chosen = tuple(key for key in MACHINE_KEYS if lookup(values, key) is None)
    values, world_size = check(values, {}, new_run=False)  # (the run's own choices, not the command line's)
    for key, was in before.items():
        if (now := lookup(values, key)) != was:
            warn(f"{key}={shown(was)} was chosen for the machine this run started on; on this one it continues "
                 f"with {key}={shown(now)} (give {key}={shown(was)} to keep the other)")  # fmt: skip
    try:
        values["tokens_per_step"], accumulation = global_batch(values, world_size)
    except SettingError as err:
        if "more than the" in str(err):
            raise
        batch, block = values["data"]["batch_size"], values["model"]["block_size"]
        raise SettingError(
            f"this run's global batch, tokens_per_step={values['tokens_per_step']}, cannot be shared by {world_size} "
            f"devices: each takes data.batch_size x model.block_size = {batch} x {block} = {batch * block} tokens at "
            "least; continue it on fewer devices"
        ) from None
    values["trainer"]["accumulate_grad_batches"] = accumulation
    tokens = prepare_as_before(values, header, prepared, checkpoint)
    model = GPTConfig.from_dict(values["model"])
    check_sizes(tokens, model.block_size, values["data"])
    check_sample_prompts(values, tokens.tokenizer_json)
    return RunSettings(values, model, tokens, world_size, accumulation, checkpoint, header["step"], chosen)


def prepare_as_before(values: dict[str, Any], header: dict, prepared: dict, checkpoint: Path) -> TokenCache:
    """A resumed run's tokens: of the same data as when it started (refused otherwise), with its own tokenizer."""
    tokenizer = Tokenizer.from_str(header["tokenizer"]) if header.get("tokenizer") else None
    if prepared:
        data, their = OmegaConf.create(values["data"]), OmegaConf.create(values["tokenizer"])
        source, key = corpus_key(data, their, tokenizer if values.get("init_from") else None)
        if key != prepared["cache_key"]:
            raise SettingError(
                f"the data of the run being resumed ({checkpoint.parent.parent}) has changed since it started "
                f"({prepared.get('source')} then, {source.label} now: other files, sizes or times); continue it only "
                f"with the same data, or start a new run from its weights with init_from={checkpoint}"
            )
    tokens = prepare(values, given=tokenizer if values.get("init_from") else None)
    if tokenizer is not None and tokens.tokenizer_json != tokenizer.to_str():
        warn("the token cache holds another tokenizer than the run's; tokenizing again with the run's own")
        tokens = prepare(values, given=tokenizer)
    if prepared.get("encodings_made") and tokens.meta.get("encodings_made") != prepared["encodings_made"]:
        warn(f"the BPE-dropout encodings of the training split in the token cache ({tokens.folder}) were made again "
             "since this run started (its entry was deleted, or this is another cache); the run goes on with these, "
             "which no seed makes equal to the first, so it does not continue bit for bit")  # fmt: skip
    return tokens


def read_run_header(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's step, settings and tokenizer, for continuing its run."""
    try:
        check_sums(checkpoint)  # its tensors too: Lightning's loader, which reads them next, checks nothing
        header = read_header(checkpoint)
    except DamagedCheckpoint as err:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: it is truncated or corrupted{f' ({err.detail})' if err.detail else ''}; "
            "pass an earlier checkpoint of the run, e.g. resume=<run>/checkpoints/step-NNNNNN.ckpt"
        ) from None
    if not header["settings"]:
        raise CheckpointError(
            f"{checkpoint} carries no run settings, so it cannot be resumed; init_from={checkpoint} starts a new run "
            "from its weights"
        )
    return header


def continue_values(
    saved: dict[str, Any], requested: dict[str, Any], named: Iterable[str], run: Path, choices: dict[str, Any]
) -> dict[str, Any]:
    """The saved settings, with the named settings that may change on resume taken from the command line; a named
    setting that contradicts the saved run is refused, naming both values."""
    values, named = copy.deepcopy(saved), list(named)
    # loggers chosen (logger=NAME names each setting of the choice): one the run has may be left out of the
    # list; a setting alone (logger.wandb.project=...) keeps the run's own list
    if not requested.get("logger") or set(expand("logger", requested)) <= set(named):
        named += [key for key in expand("logger", saved) if key not in named]
    for key in named:
        if key.split(".")[0] in LAUNCH_KEYS:
            continue
        want, have = lookup(requested, key), lookup(saved, key)
        if changeable(key) and not (
            key.startswith("logger.") and key.split(".")[1] not in (values.get("logger") or {})
        ):
            put(values, key, want)
        elif differs(key, want, have) and not shortened(key, requested, saved):
            raise SettingError(contradiction(key, want, have, saved, requested, run, choices))
    values["resume"] = requested.get("resume")
    if "latest_link" in named:  # else the link the run has always updated
        values["latest_link"] = requested.get("latest_link")
    if values.get("tokens_per_step") is not None:
        values["trainer"]["accumulate_grad_batches"] = 1  # follows from tokens_per_step and this launch's devices
    return values


def check_continuation(values: dict[str, Any], step: int, finished: bool, was: dict | None = None) -> None:
    """A continued run must have steps left to train (or, stopped after its last step before its end was
    recorded, its end to finish); one that ended at its time limit (the trainer settings it `was` run with)
    needs a longer one."""
    for key in ("trainer.max_steps", "trainer.max_time"):  # compared below: a value of another kind is named
        if (problem := SPEC[key](key, lookup(values, key))) is not None:
            raise SettingError(problem)
    max_steps, max_time = values["trainer"]["max_steps"], values["trainer"].get("max_time")
    by_time = finished and was and was.get("max_time") and not 0 < was["max_steps"] <= step
    if by_time and max_time and seconds_of(max_time) <= seconds_of(was["max_time"]):
        raise RunFinished(
            f"the run is finished: it trained for its trainer.max_time={as_max_time(was['max_time'])}; give a longer "
            "trainer.max_time to train it further"
        )
    if max_steps == step and not finished:
        log.info("the run trained all its %d steps but stopped before it ended; ending it now", step)
    elif 0 < max_steps <= step:
        where = (
            f"finished: it reached trainer.max_steps={max_steps}"
            if max_steps == step
            else f"already at step {step}, past trainer.max_steps={max_steps}"
        )
        finished_here = RunFinished if max_steps == step else SettingError
        raise finished_here(f"the run is {where}; give a larger trainer.max_steps to train it further")


def matches(requested: dict[str, Any], saved: dict[str, Any], named: Iterable[str]) -> bool:
    """Whether a run's saved settings are those a command line asks for (resume=auto), but for those a resume may
    change; a run from init_from takes its unnamed model and tokenizer settings from there."""
    saved = {k: v for k, v in saved.items() if k not in (PREPARED, MACHINE_CHOSEN)}
    for key in differing_leaves(requested, saved):
        if key.split(".")[0] in LAUNCH_KEYS or key == "hydra" or key.startswith("hydra.") or changeable(key):
            continue
        if (
            key.startswith(("model.", "tokenizer."))
            and key not in named
            and saved.get("init_from")
            and requested.get("init_from")
        ):
            continue
        if key in MACHINE_KEYS and lookup(requested, key) is None:
            continue
        if differs(key, lookup(requested, key), lookup(saved, key)) and not shortened(key, requested, saved):
            return False
    return True


def shortened(key: str, requested: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Whether the run saved the requested optim.warmup_steps as fit_warmup shortened it to fit its steps."""
    steps, want = lookup(saved, "trainer.max_steps"), lookup(requested, key)
    if key != "optim.warmup_steps" or not isinstance(want, int) or not isinstance(steps, int):
        return False
    return 0 < steps <= want and lookup(saved, key) == steps // 10


def changeable(key: str) -> bool:
    return any(key == c or (c.endswith(".") and key.startswith(c)) for c in CHANGEABLE_ON_RESUME)


def differs(key: str, want: Any, have: Any) -> bool:
    if key in WORKED_OUT and want == WORKED_OUT[key] and not isinstance(want, bool):
        return False
    if key in PATH_KEYS:
        want, have = absolute(want), absolute(have)
    return want != have or (type(want) is bool) != (type(have) is bool)


def typed_choices(overrides: Iterable[str]) -> dict[str, str | None]:
    """The config groups a command line chooses (data=pydoc), and the settings it types by their own key beside
    a group it chooses (data.batch_size=16: None): what a refusal names for a setting."""
    given = [o.lstrip("+").split("=", 1) for o in overrides if "=" in o and not o.startswith("~")]
    chosen = {group: choice for group, choice in given if (CONFIG_DIR / group).is_dir()}
    return {**chosen, **{key: None for key, _ in given if "." in key and key.split(".")[0] in chosen}}


def contradiction(key: str, want: Any, have: Any, saved: dict, requested: dict, run: Path, choices: dict) -> str:
    """The refusal of a setting that contradicts the run being resumed, naming what the command line typed
    (`choices`: typed_choices)."""
    chosen, had = set(requested.get("logger") or {}), set(saved.get("logger") or {})
    tracker, group = key.split(".")[1] if key.startswith("logger.") else None, key.split(".")[0]
    typed = any(choices.get(".".join(key.split(".")[:n]), "") is None for n in range(2, key.count(".") + 2))
    as_written = "not set" if have is ABSENT else shown(have)
    if (key == "logger" or (tracker and tracker not in chosen & had)) and chosen != had:
        given, key, as_written = f"logger={logger_choice(requested)}", "logger", logger_choice(saved)
    elif group != "logger" and choices.get(group) and not typed:  # data=pydoc: the choice typed, and what it sets
        given = f"{group}={choices[group]} (which {f'leaves {key} unset' if want is ABSENT else f'sets {key}={shown(want)}'})"
    else:
        given = f"~{key}" if want is ABSENT else f"{key}={shown(want)}"
    return (
        f"{given} contradicts the run being resumed ({run}), whose {key} is {as_written}; leave it out to continue "
        "the run as it was, or start a new run without resume= (README: Interrupted runs, and resuming)"
    )


def logger_choice(values: dict[str, Any]) -> str:
    names = list(values.get("logger") or {})
    return ("[" + ",".join(names) + "]" if len(names) > 1 else names[0]) if names else "none"
