"""A run's settings, resolved once: the composed config checked in full and made final (model shape
settled with the tokenizer and init_from, global batch and accumulation computed, precision and
strategy chosen) before anything is built. What `RunSettings.saved()` returns is what the run folder's
config.yaml and every checkpoint hold; a resumed run starts from its checkpoint's copy.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

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
from shell import cpu_precision, resume
from shell.checks import (
    ABSENT,
    PATH_KEYS,
    SPEC,
    SettingError,
    as_max_time,
    check_link_place,
    check_values,
    lookup,
    nearest_folder,
    probe_trainer,
    put,
    shown,
    time_budget_seconds,
)
from shell.flops import cpu_flags
from shell.init_from import Start, kept_tokenizer, missing_source, model_keys_in, start_from
from shell.memory import check_fits, process_count_here, this_machine_free, tight_fit
from shell.run_folder import RunFolder, RunFolderError, process_rank, step_of
from training.run_settings import NOT_TRAINER_ARGUMENTS, RunSettings, choose_strategy, sample_prompts

log = logging.getLogger(__name__)

# Settings that say where runs live and which to continue, not what a run is.
LAUNCH_KEYS = (resume.KEY, "runs_root", "latest_link")

# Settings a resumed run may change (a key, or every key under a prefix ending in "."): how long it
# runs, how it checkpoints, validates, samples and reports, and the hardware it runs on (the global
# batch, tokens_per_step, stays, so the accumulation follows the devices).
CHANGEABLE_ON_RESUME = (
    "trainer.max_steps",
    "trainer.max_time",
    "checkpoint.",
    "samples.",
    "trainer.val_check_interval",
    "trainer.limit_val_batches",
    "trainer.log_every_n_steps",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.profiler",
    "logger.wandb.mode",  # online or offline: where the same wandb run goes on logging
    "trainer.accelerator",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.strategy",
    "trainer.precision",
    "compile",
    "data.num_proc",
    "data.num_workers",
    "data.cache_dir",
    "data.shard_chars",
    "data.local_copies",
    "data.url",  # where Tiny Shakespeare is looked for; that it is the same text is checked
)

# Settings whose requested value means "work it out", and so matches whatever the run worked out.
WORKED_OUT = {"model.vocab_size": None, "tokens_per_step": None, "trainer.accumulate_grad_batches": 1}

# Passes over a stand-in corpus (the offline pydoc text that data=shakespeare falls back to) after which
# a run of it stops, without and with BPE-dropout (tokenizer.dropout): more overfit so small a text
# (bench/README.md, "The offline fallback").
FALLBACK_PASSES = 8
FALLBACK_PASSES_BPE_DROPOUT = 14


# Settings that, left null, are chosen for the machine (bf16 and compile on a CUDA GPU; eager on a CPU, in
# bf16 where a short timed probe finds its bf16 instructions train the run's model clearly faster, else
# 32-bit). The saved settings list under this key those a run's command line left to the machine, so
# that a run continued on other hardware (started on a GPU, resumed on a laptop) is given that machine's
# choice.
MACHINE_KEYS = ("trainer.precision", "compile")

# Settings a resume sets itself, beside those a resume may change: where runs live and which to continue,
# what is saved beside the settings, and the accumulation that follows the number of devices.
SET_BY_A_RESUME = (*LAUNCH_KEYS, PREPARED, MACHINE_CHOSEN, "trainer.accumulate_grad_batches")


# ---- checking ----------------------------------------------------------------------------------------


# The CPU flags that name bfloat16 instructions: AMX tiles (Intel Xeon from Sapphire Rapids on) and
# AVX-512 BF16 (AMD EPYC from Zen 4 on, Intel Xeon from Cooper Lake on). Whether they train a model
# faster than 32 bits depends on the processor and the model (bench/precision.py): measured, once for
# a processor and shape (shell.cpu_precision). A CPU without them only converts around fp32 arithmetic.
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


class Machine(NamedTuple):
    """What the choices left to the machine (precision, compile) depend on."""

    cuda: bool  # it has CUDA GPUs
    bf16: bool  # they compute in bfloat16
    triton: bool  # torch.compile can generate GPU kernels (Triton is installed)
    cpu_bf16: bool = False  # its CPU has bfloat16 instructions, which may train a model faster

    @classmethod
    def this(cls) -> Machine:
        cuda = torch.cuda.is_available()
        return cls(
            cuda,
            cuda and torch.cuda.is_bf16_supported(),
            importlib.util.find_spec("triton") is not None,
            any(flag in cpu_flags() for flag in CPU_BF16_FLAGS),
        )


def on_cuda(accelerator: str, machine: Machine) -> bool:
    """Whether trainer.accelerator puts the run on CUDA GPUs (auto does, where there are any)."""
    return accelerator in ("auto", "gpu", "cuda") and machine.cuda


def on_cpu(accelerator: str, machine: Machine) -> bool:
    """Whether trainer.accelerator puts the run on the CPU (auto does, where there is no GPU)."""
    return accelerator == "cpu" or (
        accelerator == "auto" and not machine.cuda and not torch.backends.mps.is_available()
    )


def choose_precision(
    requested: str | int | None,
    accelerator: str = "auto",
    machine: Machine | None = None,
    shape: tuple[GPTConfig, int] | None = None,
) -> str:
    """bf16 mixed precision on GPUs that support it, and on CPUs with bfloat16 instructions that train
    the run's `shape` (its model and batch size) clearly faster so, as a short probe of both finds (once
    for a processor and shape: shell.cpu_precision; without a shape yet, 32-true until it is known);
    full 32-bit elsewhere. An explicit choice wins, but not float16 on a CPU, where Lightning would train
    in bf16 while the run recorded float16."""
    machine = machine or Machine.this()
    if requested and str(requested) in ("16-mixed", "16", "16-true") and on_cpu(accelerator, machine):
        raise SettingError(
            f"trainer.precision={requested} needs a CUDA GPU (float16 has no CPU support); "
            "use trainer.precision=bf16-mixed or 32-true on a CPU"
        )
    if requested:
        return str(requested)
    if on_cuda(accelerator, machine):
        return "bf16-mixed" if machine.bf16 else "32-true"
    if on_cpu(accelerator, machine) and machine.cpu_bf16 and shape is not None:
        return cpu_precision.measured(*shape).precision
    return "32-true"


def precision_words(settings: RunSettings) -> str:
    """Why the run trains in its precision, for its first line: measured on this CPU for this shape,
    chosen for this machine, or nothing where the command line gave it."""
    if "trainer.precision" not in settings.machine_chosen:
        return ""
    found = cpu_precision.known(settings.model, settings.values["data"]["batch_size"])
    if found is not None and found.precision == settings.trainer["precision"]:
        return f" ({found.words()})"
    return " (chosen for this machine)"


def choose_compile(requested: bool | None, accelerator: str = "auto", machine: Machine | None = None) -> bool:
    """torch.compile on CUDA GPUs (with Triton, which it generates kernels with), not on CPUs, where
    compiled steps were only 2-4% faster and compiling costs more than that in a short run; an explicit
    choice wins."""
    if requested is not None:
        return bool(requested)
    machine = machine or Machine.this()
    return on_cuda(accelerator, machine) and machine.triton


def warn(message: str) -> None:
    """A warning about the run's settings, said by the first process only: every process of a
    multi-process run resolves the settings, and the user is to read each warning once."""
    if process_rank() == 0:
        log.warning(message)


def check_fsdp(values: dict[str, Any]) -> None:
    """What trainer.strategy=fsdp cannot do (optim=muon is refused with the other settings that do not
    go together, in shell.checks). Text samples are written by the first process alone, and a
    sharded model computes only with every process taking part: turned off, in one warning line
    (generate.py samples from the checkpoints)."""
    if values["trainer"].get("strategy") != "fsdp":
        return
    if values["samples"]["enabled"]:
        values["samples"]["enabled"] = False
        warn(
            "trainer.strategy=fsdp: no text samples after validation (samples.enabled=false), as the sharded model "
            "runs only on all processes together; sample from the checkpoints with generate.py"
        )


_CHECKED: dict[str, tuple[dict[str, Any], int]] = {}  # what check() found for a config, in this process


def check(values: dict[str, Any], new_run: bool = True) -> tuple[dict[str, Any], int]:
    """Every setting checked, paths made absolute, precision chosen and the world size Lightning would
    use found; nothing is made. Returns (values, world size). For a new run without init_from (which
    settles the shape later) the global batch is checked too. A continued run (not `new_run`) no longer
    needs what init_from named: its weights are in its own checkpoint. train.py checks a command line
    before it makes a folder, then the run resolves it: the same config is checked once per process."""
    key = json.dumps([values, new_run], sort_keys=True, default=str)
    if key not in _CHECKED:
        values = check_values(values)
        init_from = values.get("init_from")
        if new_run and init_from and not Path(init_from).expanduser().exists():
            raise CheckpointError(missing_source(init_from))
        # a folder, not necessarily writable: a shared read-only cache serves the entries it holds
        nearest_folder("data.cache_dir", values["data"]["cache_dir"])
        if values.get("latest_link"):
            check_link_place("latest_link", values["latest_link"])
        for name in PATH_KEYS:
            if lookup(values, name) is not ABSENT:
                put(values, name, absolute(lookup(values, name)))
        trainer = values["trainer"]
        accelerator = str(trainer.get("accelerator", "auto"))
        machine = Machine.this()
        if accelerator in ("gpu", "cuda") and not machine.cuda:
            raise SettingError(
                f"trainer.accelerator={accelerator}: this machine has no CUDA GPU; use trainer.accelerator=cpu or auto"
            )
        if accelerator == "mps" and not torch.backends.mps.is_available():
            raise SettingError(
                "trainer.accelerator=mps: MPS is not available here; use trainer.accelerator=cpu or auto"
            )
        devices = trainer.get("devices", "auto")
        if on_cpu(accelerator, machine) and (devices == -1 or isinstance(devices, list) or "," in str(devices)):
            raise SettingError(
                f"trainer.devices={shown(devices)} is for GPUs (-1: every one; a list: the ones named), and this run "
                "trains on CPUs, where a device is a process: give their number, e.g. trainer.devices=2 (this machine "
                f"has {usable_cores()} CPU cores)"
            )
        # a new run's shape is settled once its tokenizer is (settle_precision); a continued run has its own
        shape = None if new_run else (GPTConfig.from_dict(values["model"]), values["data"]["batch_size"])
        trainer["precision"] = choose_precision(trainer.get("precision"), accelerator, machine, shape)
        values["compile"] = choose_compile(values.get("compile"), accelerator, machine)
        check_fsdp(values)
        world_size = probe_trainer(
            {k: v for k, v in trainer.items() if k not in NOT_TRAINER_ARGUMENTS},
            choose_strategy(trainer.get("strategy", "auto")),
            trainer["precision"],
        )
        if new_run and not values.get("init_from"):
            global_batch(values, world_size)
        _CHECKED[key] = (values, world_size)
    values, world_size = _CHECKED[key]
    return copy.deepcopy(values), world_size


# The most micro-batches per optimizer step (and device) a run may take. GPT-3's and LLaMA's global
# batches, some 4M tokens, cut into micro-batches of a single 64-token sequence are 65,536: no sensible
# run takes more. More is a slip (tokens_per_step=2**30, a figure in bytes), and such a run would only
# seem to hang: a million micro-batches before the weights first change, hours of a tiny model's time.
MAX_ACCUMULATION = 65_536


class TooManyMicroBatches(SettingError):
    """A global batch of more than MAX_ACCUMULATION micro-batches per step."""


def global_batch(values: dict[str, Any], world_size: int) -> tuple[int, int]:
    """(tokens per optimizer step, micro-batches per step and device), from tokens_per_step (the global
    batch, in tokens) or, left null, from trainer.accumulate_grad_batches; the global batch stays the
    same when the number of devices changes. More than MAX_ACCUMULATION micro-batches is refused."""
    batch, block = values["data"]["batch_size"], values["model"]["block_size"]
    micro = batch * block * world_size
    tokens = values.get("tokens_per_step")
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
        raise TooManyMicroBatches(
            f"{given} of data.batch_size x model.block_size x devices = {batch} x {block} x {world_size} = "
            f"{micro:,} tokens per optimizer step, more than the {MAX_ACCUMULATION:,} any sensible run takes (a "
            f"step would seem to hang); use {fix}, or a larger data.batch_size"
        )
    return micro * accumulation, accumulation


# ---- resolving ---------------------------------------------------------------------------------------


def resolve(requested: dict[str, Any], named: Iterable[str] = ()) -> tuple[RunSettings, Start | None]:
    """A new run's settings from the composed config; `named`: the settings the command line gave
    (init_from keeps its checkpoint's shape unless one is named). Also returns what init_from starts from."""
    values, world_size = check(requested)
    start = start_from(OmegaConf.create(values), model_keys_in(named, values["model"]))
    if start:
        values["model"] = start.config.to_dict()  # its shape is the run's shape
        values["tokenizer"] = kept_tokenizer(values["tokenizer"], start, named)  # and its tokenizer the run's
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
    settle_precision(values, requested, model)
    chosen = left_to_the_machine(requested)
    return RunSettings(values, model, tokens, world_size, accumulation, machine_chosen=chosen), start


def settle_precision(values: dict[str, Any], requested: dict[str, Any], model: GPTConfig) -> None:
    """A new run's precision left to the machine, chosen again now that its model's shape is final (on a
    CPU with bfloat16 instructions, the probe times this shape), once the run is past every check: its
    memory was checked in 32 bits, the most a step of it (and the probe) takes."""
    if lookup(requested, "trainer.precision") in (None, ABSENT):
        trainer = values["trainer"]
        shape = (model, values["data"]["batch_size"])
        trainer["precision"] = choose_precision(None, str(trainer.get("accelerator", "auto")), Machine.this(), shape)


def left_to_the_machine(requested: dict[str, Any]) -> tuple[str, ...]:
    """The MACHINE_KEYS a config leaves null, for check() to choose for the machine."""
    return tuple(key for key in MACHINE_KEYS if lookup(requested, key) in (None, ABSENT))


def size_to_fallback(values: dict[str, Any], tokens: TokenCache, named: Iterable[str]) -> None:
    """A run on a stand-in corpus (tokens.fallback says why) is cut to FALLBACK_PASSES passes over its
    training tokens (FALLBACK_PASSES_BPE_DROPOUT when they were also encoded with BPE-dropout, which
    lets a small text be passed over more before it is overfitted), unless the command line sets
    trainer.max_steps, and its samples start from <|endoftext|> unless samples.prompts is given (the
    data's own prompts belong to the text it lacks). Says so in one warning line."""
    if not tokens.fallback:
        return
    trainer, train_tokens = values["trainer"], tokens.meta["train_tokens"]
    passes = FALLBACK_PASSES_BPE_DROPOUT if tokens.meta.get("dropout") else FALLBACK_PASSES
    steps = -(-passes * train_tokens // values["tokens_per_step"])
    planned, steps = trainer["max_steps"], max(steps, values["optim"]["warmup_steps"] + 1)
    cut = "trainer.max_steps" not in set(named) and (planned == -1 or planned > steps)
    if cut:
        trainer["max_steps"] = steps
    if not values["samples"]["prompts"]:
        values["samples"]["prompts"] = [""]
    if cut:
        was = "the time budget" if planned == -1 else f"{planned:,}"
        length = f"for {steps:,} steps ({passes} passes over its {train_tokens:,} training tokens) rather than {was}, as more would overfit it"
    else:
        length = f"for trainer.max_steps={planned:,} as given ({planned * values['tokens_per_step'] / train_tokens:.1f} passes)"
    chars = tokens.meta["train_chars"] + tokens.meta["val_chars"]
    warn(
        f"{tokens.fallback}: training on the offline pydoc corpus ({chars:,} characters of Python's help texts) "
        f"instead, {length}; set data.path=/path/to/input.txt to use a local copy"
    )


def fit_warmup(values: dict[str, Any]) -> None:
    """A warmup as long as the run or longer (trainer.max_steps=20 beside the default 50 warmup steps) is
    shortened to a tenth of the run, said in one line: a short run is what the command line asked for."""
    steps, warmup = values["trainer"]["max_steps"], values["optim"]["warmup_steps"]
    if 0 < steps <= warmup:
        values["optim"]["warmup_steps"] = steps // 10
        if process_rank() == 0:
            log.info(
                "optim.warmup_steps=%d is not shorter than the run's %d step%s: warming up over %d instead",
                warmup, steps, "" if steps == 1 else "s", steps // 10,
            )  # fmt: skip


def resolve_resumed(checkpoint: Path, requested: dict[str, Any], named: Iterable[str]) -> RunSettings:
    """A continued run's settings: its checkpoint's, with what the command line may change applied."""
    values, world_size, step, tokenizer, chosen, changed, saved, made = continue_settings(checkpoint, requested, named)
    if edited := edits_of_the_record(RunFolder(checkpoint.parent.parent), saved, checkpoint):
        warn(edited)
    for key, (was, now) in changed.items():
        warn(
            f"{key}={shown(was)} was chosen for the machine this run started on; on this one it continues "
            f"with {key}={shown(now)} (give {key}={shown(was)} to keep the other)"
        )
    tokens = prepare(values, given=tokenizer if values.get("init_from") else None)
    if tokenizer is not None and tokens.tokenizer_json != tokenizer.to_str():
        warn("the token cache holds another tokenizer than the run's; tokenizing again with the run's own")
        tokens = prepare(values, given=tokenizer)
    if made and tokens.meta.get("encodings_made") != made:
        warn(
            f"the BPE-dropout encodings of the training split in the token cache ({tokens.folder}) were made again "
            "since this run started (its entry was deleted, or this is another cache); the run goes on with these, "
            "which no seed makes equal to the first, so it does not continue bit for bit"
        )
    values["tokens_per_step"], accumulation = global_batch(values, world_size)
    values["trainer"]["accumulate_grad_batches"] = accumulation
    model = GPTConfig.from_dict(values["model"])
    check_sizes(tokens, model.block_size, values["data"])
    check_sample_prompts(values, tokens.tokenizer_json)
    return RunSettings(
        values, model, tokens, world_size, accumulation, resume_from=checkpoint, resume_step=step, machine_chosen=chosen
    )


class Continuation(NamedTuple):
    values: dict[str, Any]
    world_size: int
    step: int  # the checkpoint's
    tokenizer: Tokenizer | None  # the run's own
    chosen: tuple[str, ...]  # the MACHINE_KEYS left to the machine
    changed: dict[str, tuple[Any, Any]]  # of those, the ones whose choice differs here: key -> (then, now)
    saved: dict[str, Any]  # the checkpoint's own settings, before the command line's changes
    encodings_made: str | None  # the BPE-dropout encodings it trained on (data.prepare), if any


def continue_settings(
    checkpoint: Path, requested: dict[str, Any], named: Iterable[str], choices: dict[str, str | None] | None = None
) -> Continuation:
    """The settings a run continues with, checked, before anything is made: its checkpoint's, with the
    named settings that may change taken from the command line (others that differ are refused), with
    steps left to train, on the data it started with, and what was chosen for the machine it started on
    chosen again for this one. `choices`: the config groups the command line chose (data=pydoc), named
    in a refusal of a setting they changed."""
    header = read_run_header(checkpoint)
    saved = dict(header["settings"])
    prepared = saved.pop(PREPARED, None)
    left_before = saved.pop(MACHINE_CHOSEN, None) or []  # runs saved before the list: keep their values
    run = checkpoint.parent.parent
    named = expand(named, requested, saved)
    values = continue_values(saved, requested, named, run, choices or {})
    folder = RunFolder(run)
    finished = folder.is_finished()
    at_its_end = finished and step_of(folder.checkpoint_to_resume()) <= header["step"]  # not an earlier checkpoint
    check_continuation(values, header["step"], finished, saved["trainer"] if at_its_end else None)
    before = {key: lookup(values, key) for key in left_before if key in MACHINE_KEYS and key not in named}
    for key in before:
        put(values, key, None)  # for check() to choose for this machine
    chosen = left_to_the_machine(values)
    values, world_size = check(values, new_run=False)
    changed = {key: (was, lookup(values, key)) for key, was in before.items() if lookup(values, key) != was}
    try:
        global_batch(values, world_size)
    except TooManyMicroBatches:
        raise
    except SettingError:
        batch, block = values["data"]["batch_size"], values["model"]["block_size"]
        raise SettingError(
            f"this run's global batch, tokens_per_step={values['tokens_per_step']}, cannot be shared by {world_size} "
            f"devices: each takes data.batch_size x model.block_size = {batch} x {block} = {batch * block} tokens at "
            "least; continue it on fewer devices"
        ) from None
    tokenizer = Tokenizer.from_str(header["tokenizer"]) if header.get("tokenizer") else None
    if prepared:
        data = OmegaConf.create(values["data"])
        source, key = corpus_key(
            data, OmegaConf.create(values["tokenizer"]), tokenizer if values.get("init_from") else None
        )
        if key != prepared["cache_key"]:
            raise SettingError(
                f"the data of the run being resumed ({run}) has changed since it started ({prepared.get('source')} "
                f"then, {source.label} now: other files, sizes or times); continue it only with the same data, or "
                f"start a new run from its weights with init_from={checkpoint}"
            )
    made = prepared.get("encodings_made") if prepared else None
    return Continuation(values, world_size, header["step"], tokenizer, chosen, changed, saved, made)


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
            f"{checkpoint} carries no run settings, so it cannot be resumed; init_from={checkpoint} "
            "starts a new run from its weights"
        )
    return header


def prepare(values: dict[str, Any], given: Tokenizer | None) -> TokenCache:
    return prepare_corpus(OmegaConf.create(values["data"]), OmegaConf.create(values["tokenizer"]), given)


def check_sample_prompts(values: dict[str, Any], tokenizer_json: str, named: Iterable[str] | None = None) -> None:
    """Refuse now a sample prompt the command line gave that generate.py would refuse, rather than at the
    first validation. A prompt the user did not choose (the data config's own, written for its text, or
    the empty one) never stops a run: it is dropped with one warning line, and without any prompt left the
    samples start from <|endoftext|>, or are turned off. `named`: the settings the command line gave
    (None: a resumed run's own settings, checked when it started)."""
    if not values["samples"]["enabled"]:
        return
    tokenizer = Tokenizer.from_str(tokenizer_json)
    key = "samples.prompts" if values["samples"]["prompts"] else "data.sample_prompts"
    chosen = named is not None and any(name == key or name.startswith((f"{key}.", f"{key}[")) for name in named)
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
    if kept:
        values["samples"]["prompts"] = kept
    elif eot_id(tokenizer) is not None:
        values["samples"]["prompts"] = [""]
    else:
        values["samples"]["enabled"] = False
        warn("no text samples in this run: its tokenizer has no <|endoftext|> to start them from; give "
             "prompts to start them from (samples.prompts='[ROMEO:]')")  # fmt: skip


def check_memory(values: dict[str, Any], model: GPTConfig, world_size: int) -> None:
    """A CPU run whose training step cannot fit in the memory this machine has free is refused (on a
    GPU, the device's own memory decides, and its error says so when it runs out)."""
    trainer = values["trainer"]
    if not on_cpu(str(trainer.get("accelerator", "auto")), Machine.this()):
        return
    nodes = trainer.get("num_nodes") or 1
    processes = process_count_here(world_size, nodes if isinstance(nodes, int) else 1)
    shape = (
        model,
        values["data"]["batch_size"],
        trainer["precision"],
        values["optim"].get("name", "adamw"),
        processes,
        this_machine_free(),
    )
    if problem := check_fits(*shape):
        raise SettingError(problem)
    if tight := tight_fit(*shape):
        warn(tight)
    if processes > (cores := usable_cores()):
        warn(
            f"trainer.devices={processes} starts {processes} training processes on this machine's {cores} CPU cores: "
            f"they take turns on the cores, so the run goes slower than with trainer.devices={cores}"
        )


def final_model(model: dict[str, Any], tokenizer_vocab: int) -> GPTConfig:
    """The model, with vocab_size taken from the tokenizer unless it is set."""
    model = dict(model)
    if model.get("vocab_size") is None:
        model["vocab_size"] = tokenizer_vocab
    elif model["vocab_size"] < tokenizer_vocab:
        raise SettingError(
            f"model.vocab_size={model['vocab_size']} is smaller than the tokenizer's {tokenizer_vocab} tokens; "
            "leave model.vocab_size unset (null) to take the tokenizer's"
        )
    return GPTConfig.from_dict(model)


# ---- continuing a run --------------------------------------------------------------------------------


def continue_values(
    saved: dict[str, Any], requested: dict[str, Any], named: Iterable[str], run: Path, choices: dict[str, str | None]
) -> dict[str, Any]:
    """The saved settings, with the named settings that may change on resume taken from the command
    line. A named setting that contradicts the saved run is refused, naming both values."""
    values = copy.deepcopy(saved)
    named = list(named)
    # loggers chosen (logger=NAME names each setting of the choice): one the run has may be left out of the
    # list; a setting alone (logger.wandb.project=...) keeps the run's own list, not the default one
    if not requested.get("logger") or set(expand(["logger"], requested)) <= set(named):
        named += [key for key in expand(["logger"], saved) if key not in named]
    for key in named:
        if key.split(".")[0] in LAUNCH_KEYS:
            continue
        want, have = lookup(requested, key), lookup(saved, key)
        if changeable(key) and not of_a_tracker_not_chosen(key, values):
            put(values, key, want)
        elif differs(key, want, have):
            raise SettingError(contradiction(key, want, have, saved, requested, run, choices))
    values[resume.KEY] = resume.asked(requested)
    if "latest_link" in named:  # else the link the run has always updated
        values["latest_link"] = requested.get("latest_link")
    if values.get("tokens_per_step") is not None:
        values["trainer"]["accumulate_grad_batches"] = 1  # follows from tokens_per_step and this launch's devices
    return values


def check_continuation(values: dict[str, Any], step: int, finished: bool = True, was: dict | None = None) -> None:
    """A continued run with a step limit must have steps left to train, or, stopped after its last step
    and before its result was recorded (not `finished`), its end left to finish. A run that ended at
    its time limit (the trainer settings it `was` run with, given when it is continued from its end)
    must be given a longer one."""
    for key in ("trainer.max_steps", "trainer.max_time"):  # compared below: a value of another type is named
        if (value := lookup(values, key)) is not ABSENT:
            SPEC[key].check(key, value)
    max_steps = values["trainer"]["max_steps"]
    max_time, max_time_was = values["trainer"].get("max_time"), (was or {}).get("max_time")
    ended_by_time = finished and max_time_was and not 0 < was["max_steps"] <= step
    if ended_by_time and max_time and time_budget_seconds(max_time) <= time_budget_seconds(max_time_was):
        raise SettingError(
            f"the run is finished: it trained for its trainer.max_time={as_max_time(max_time_was)}; give a longer "
            "trainer.max_time to train it further"
        )
    if max_steps == step and not finished:
        log.info("the run trained all its %d steps but stopped before it ended; ending it now", step)
        return
    if 0 < max_steps <= step:
        where = (
            f"finished: it reached trainer.max_steps={max_steps}"
            if max_steps == step
            else f"already at step {step}, past trainer.max_steps={max_steps}"
        )
        raise SettingError(f"the run is {where}; give a larger trainer.max_steps to train it further")


def edits_of_the_record(folder: RunFolder, saved: dict[str, Any], checkpoint: Path) -> str | None:
    """A warning line where the run's config.yaml, which resumes never rewrite, no longer holds the
    settings of the checkpoint being resumed: edited by hand, expecting a change that a resume does not
    read. Settings a resume may change are left out: an earlier resume may have changed them, and
    config.yaml still holds the first value. Also a line where config.yaml cannot be read; None where
    it is missing or agrees."""
    not_read = "config.yaml is a record of how the run began and is not read on resume"
    try:
        written = folder.read_settings()
    except RunFolderError as err:
        return f"{err}; {not_read}: the run continues with its checkpoint's settings"
    if written is None:
        return None
    edited = [
        key
        for key in differing_leaves(written, saved)
        if not changeable(key) and not any(key == own or key.startswith(f"{own}.") for own in SET_BY_A_RESUME)
        if differs(key, lookup(written, key), lookup(saved, key))
    ]
    if not edited:
        return None
    listed = "; ".join(
        f"{key} is {as_written(lookup(written, key))} there and {as_written(lookup(saved, key))} in the run"
        for key in edited[:3]
    )
    more = f"; and {len(edited) - 3} more" if len(edited) > 3 else ""
    return (
        f"{folder.settings_file} differs from the run being resumed ({listed}{more}): {not_read}, and these "
        "settings cannot change on resume, so the run continues with its own; to train with them, start a new "
        f"run with them on the command line (init_from={checkpoint} starts it from this run's weights)"
    )


def as_written(value: Any) -> str:
    return "not set" if value is ABSENT else shown(value)


def matches(requested: dict[str, Any], saved: dict[str, Any], named: Iterable[str]) -> bool:
    """Whether a run's saved settings are those this command line asks for (for resume=auto): every
    setting but those a resume may change; a run from init_from takes its unnamed model and tokenizer
    settings from there."""
    named = set(named)
    saved = {k: v for k, v in saved.items() if k not in (PREPARED, MACHINE_CHOSEN)}
    for key in differing_leaves(requested, saved):
        if key.split(".")[0] in LAUNCH_KEYS or changeable(key):
            continue
        from_weights = key.startswith(("model.", "tokenizer.")) and key not in named
        if from_weights and saved.get("init_from") and requested.get("init_from"):
            continue
        if differs(key, lookup(requested, key), lookup(saved, key)):
            return False
    return True


def named_leaves(overrides: Iterable[str], requested: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    """The settings a command line gives, as dotted keys: the keys it names (a group, such as
    model=baby, names each of its settings), and every setting whose value differs from the defaults
    (what experiment=... sets)."""
    keys = set(differing_leaves(requested, defaults))
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra.") or key.split(".")[0] in ("experiment", "debug", "hparams_search"):
            continue
        keys |= set(expand([key], requested, defaults))
    return sorted(keys)


def expand(named: Iterable[str], *configs: dict[str, Any]) -> list[str]:
    """Dotted keys (or key=value overrides), a group's key replaced by each of its settings in any of
    the configs."""
    keys = []
    for item in named:
        key = item.split("=", 1)[0].lstrip("+~")
        leaves = {leaf for config in configs for leaf in differing_leaves(lookup(config, key), ABSENT, key)}
        keys += sorted(leaves) or [key]
    return list(dict.fromkeys(keys))


def of_a_tracker_not_chosen(key: str, values: dict[str, Any]) -> bool:
    """A setting of a logger the run does not log with (logger.wandb.mode of a run logging to csv alone):
    the command line's logger=csv names it, as it names every logger setting of the default."""
    return key.startswith("logger.") and key.split(".")[1] not in (values.get("logger") or {})


def changeable(key: str) -> bool:
    return any(key == c or (c.endswith(".") and key.startswith(c)) for c in CHANGEABLE_ON_RESUME)


def differs(key: str, want: Any, have: Any) -> bool:
    if key in WORKED_OUT and want == WORKED_OUT[key] and not isinstance(want, bool):
        return False
    if key in PATH_KEYS:
        want, have = absolute(want), absolute(have)
    return want != have or (type(want) is bool) != (type(have) is bool)


def contradiction(
    key: str,
    want: Any,
    have: Any,
    saved: dict[str, Any],
    requested: dict[str, Any],
    run: Path,
    choices: dict[str, str | None] | None = None,
) -> str:
    chosen, had = set(requested.get("logger") or {}), set(saved.get("logger") or {})
    tracker = key.split(".")[1] if key.startswith("logger.") else None
    group = key.split(".")[0]
    # a tracker added or dropped; a setting of one the run has (logger.wandb.project) is named itself
    if (key == "logger" or (tracker and tracker not in chosen & had)) and chosen != had:
        given, key, have = f"logger={logger_choice(requested)}", "logger", logger_choice(saved)
    elif group != "logger" and chosen_for(key, choices or {}):  # data=pydoc: the choice typed, and what it changes
        makes = f"leaves {key} unset" if want is ABSENT else f"sets {key}={shown(want)}"
        given = f"{group}={choices[group]} (which {makes})"
        have = "not set" if have is ABSENT else shown(have)
    else:
        given = f"~{key}" if want is ABSENT else f"{key}={shown(want)}"
        have = "not set" if have is ABSENT else shown(have)
    return (
        f"{given} contradicts the run being resumed ({run}), whose {key} is {have}; leave it out to continue "
        "the run as it was, or start a new run without resume= (README: Interrupted runs, and resuming)"
    )


def chosen_for(key: str, choices: dict[str, str | None]) -> bool:
    """Whether key got its value from a group choice of the command line (config_groups.group_choices),
    not from a setting of its own key (or of a key above it) typed beside the choice."""
    parts = key.split(".")
    typed = any(choices.get(".".join(parts[:n]), "") is None for n in range(2, len(parts) + 1))
    return bool(choices.get(parts[0])) and not typed


def logger_choice(values: dict[str, Any]) -> str:
    names = list(values.get("logger") or {})
    return ("[" + ",".join(names) + "]" if len(names) > 1 else names[0]) if names else "none"


# ---- nested settings ---------------------------------------------------------------------------------


def differing_leaves(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys of the settings that differ between two nested configs (present in one only included)."""
    if isinstance(a, dict) and isinstance(b, dict) and prefix not in SPEC:
        found = []
        for name in dict.fromkeys([*a, *b]):
            key = f"{prefix}.{name}" if prefix else name
            if key == "hydra":
                continue
            found += differing_leaves(a.get(name, ABSENT), b.get(name, ABSENT), key)
        return found
    if isinstance(a, dict) and b is ABSENT and prefix not in SPEC and a:
        return differing_leaves(a, {}, prefix)
    if isinstance(b, dict) and a is ABSENT and prefix not in SPEC and b:
        return differing_leaves({}, b, prefix)
    return [prefix] if a != b or (type(a) is bool) != (type(b) is bool) else []


def absolute(value: Any) -> Any:
    """A local path (or a list of them) made absolute, ~ expanded; other values (none, a URL) as they are."""
    if isinstance(value, list):
        return [absolute(item) for item in value]
    if not isinstance(value, str) or not value or value == "???" or "://" in value:
        return value
    return os.path.abspath(os.path.expanduser(value))
