"""`train(settings, job, start)`: the core's training.fit with the shell's parts around it (the trackers, the
progress bar, the stop on a signal, the cluster's plugins, the peak FLOP/s behind MFU), the run folder made
ready before and the result recorded after; `report` says how the run ended."""

from __future__ import annotations

import json
import logging
import re
import shlex
import signal
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

import training.fit
from data.writes import refused_write
from shell.checks import lookup
from shell.errors import USER_ERRORS, ProcessLost, RunWriteError, TrainingDiverged
from shell.folders import RunFolder, process_rank, script
from shell.init_from import Start
from shell.loggers import build_loggers, finish_loggers, log_best_model, start_loggers
from shell.machine import device_peak_flops, precision_words, remember_rate
from shell.progress import progress_callback
from shell.stops import StopOnSignal, Stopped
from shell.sweeps import result_record, summarize
from training.fit import Extras
from training.run_settings import RunSettings, sample_prompts

if TYPE_CHECKING:
    from shell.job import Job

log = logging.getLogger("train")


@dataclass
class RunResult:
    folder: RunFolder
    metrics: dict[str, float] = field(default_factory=dict)
    step: int = 0
    finished: bool = True  # False where a signal stopped the run before its end
    stopped_by: str | None = None  # the stop signal it took while training, early or at its last step
    prompt: str = ""  # the run's first sample prompt, for the generate.py command it suggests
    fallback: str | None = None  # why the run trained on a stand-in text (data.sources.Source.fallback)
    rewritten: bool = False  # its tokenizer's normalizer rewrites the text (tokenizer.allow_normalized)


def train(settings: RunSettings, job: Job, start: Start | None) -> RunResult:
    """Train the run into its folder (ready first: a new run's settings saved, a resumed run's later
    checkpoints set aside), and record how it ended in result.json; an error while it trains is said in one
    line with what is left of the run and how it goes on."""
    folder, first = job.folder, process_rank() == 0
    if first:
        ready(folder, settings)
    quiet_advice()
    loggers = build_loggers(settings.values.get("logger"), folder, settings.resume_step or 0)
    start_loggers(loggers, settings.saved())
    every = settings.trainer.get("val_check_interval")
    stop = StopOnSignal(isinstance(every, int) and not isinstance(every, bool) and every or None)
    bar = [progress_callback(settings.accumulation)] if settings.trainer["enable_progress_bar"] else []
    parts: dict[str, Any] = {}
    extras = Extras(
        loggers=loggers,
        callbacks=[*bar, stop],
        plugins=cluster_plugins(),
        peak_flops=device_peak_flops,
        on_faster=remember_rate,
        before_fit=lambda trainer, module: (
            parts.update(trainer=trainer, module=module) or describe(settings, start, module)
        ),
    )
    try:
        fitted = training.fit.fit(settings, folder.path, start.state if start else None, extras)
        result = result_of(fitted.trainer, fitted.module, settings, folder, stop.name if stop.requested else None)
        if first and lookup(settings.values, "logger.wandb.log_model") is True:
            log_best_model(folder)
    except Stopped as stopped:
        if not stopped.at_checkpoint:
            raise
        result = result_of(parts["trainer"], parts["module"], settings, folder, stopped.args[0], finished=False)
    except Exception as err:
        said = TrainingDiverged(after_divergence(err, folder, settings)) if isinstance(err, TrainingDiverged) else None
        said = said or in_one_line(err, folder)
        if first and folder.has_checkpoint() and isinstance(said, USER_ERRORS):  # (a run kept: how it ended)
            step = parts["trainer"].global_step if "trainer" in parts else 0
            record(folder, settings, RunResult(folder, step=step, finished=False), job.overrides, str(said))
        raise said from None
    finally:
        finish_loggers()
    if first:
        record(folder, settings, result, job.overrides)
    return result


def quiet_advice() -> None:
    """Lightning's advice for other setups (num_workers=0 is the fast choice on a small CPU), its own deprecations,
    and its tips of services to install, out of the run's log."""
    for message in (
        r".*does not have many workers.*",
        r".*GPU available but not used.*",
        r".*exists and is not empty.*",  # the run's own folder
        r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",
        r".*resuming from a checkpoint that ended before the epoch ended.*",  # StepSampler restarts the data order
        r"The number of training batches .* is smaller than the logging interval.*",
    ):
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: "Tip: " not in record.getMessage()
    )


def ready(folder: RunFolder, settings: RunSettings) -> None:
    """A new run's config.yaml and tokenizer.json (never rewritten); a resumed run's checkpoints after the one it
    continues from set aside, and a finished run reopened."""
    if settings.resume_from is None:
        folder.settings_file.write_text(OmegaConf.to_yaml(settings.saved()))
        folder.tokenizer_file.write_text(settings.tokens.tokenizer_json, encoding="utf-8")
        return
    if moved := folder.set_aside_after(settings.resume_step):
        log.warning("resuming from step %d, before the run's newest checkpoint: the %d checkpoint(s) after it are "
                    "moved to %s, and the run goes on from step %d", settings.resume_step, len(moved), moved[0].parent,
                    settings.resume_step)  # fmt: skip
    folder.reopen()


def describe(settings: RunSettings, start: Start | None, module) -> None:
    if process_rank() != 0:
        return
    if start:
        log.info("starting from the weights of %s", start.source)
    config, meta = settings.model, settings.tokens.meta
    data = str(meta.get("source"))
    if copies := meta.get("train_copies"):
        data += f", with {len(copies)} BPE-dropout encodings of its training split (dropout {meta.get('dropout')})"
    words = precision_words(
        settings.trainer["precision"],
        "trainer.precision" in settings.machine_chosen,
        config,
        settings.values["data"]["batch_size"],
    )
    log.info("model: %s parameters (%d layers, %d heads, %d wide, context %d, vocab %d); data: %s; %d tokens per step "
             "= %d sequences x %d tokens x %d device(s) x %d accumulation; precision %s%s",
             f"{module.model.num_parameters():,}", config.n_layer, config.n_head, config.n_embd, config.block_size,
             config.vocab_size, data, settings.tokens_per_step, settings.values["data"]["batch_size"],
             config.block_size, settings.world_size, settings.accumulation, settings.trainer["precision"], words)  # fmt: skip
    if settings.resume_from:
        log.info("resuming from %s (step %d)", settings.resume_from, settings.resume_step)


def cluster_plugins() -> list[Any]:
    """Under SLURM, Lightning's own requeue (SIGUSR1, hpc_ckpt files) is off: the requeued job continues its
    run folder as resume= would (shell.job)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def result_of(
    trainer, module, settings: RunSettings, folder: RunFolder, stopped_by, finished: bool = True
) -> RunResult:
    """What the run reached: its last training and validation values, and the stop signal it took, if any."""
    metrics = {**module.latest_train_values, **module.latest_val_values}
    metrics |= {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    normalized = json.loads(settings.tokens.tokenizer_json).get("normalizer") is not None
    return RunResult(
        folder,
        metrics,
        trainer.global_step,
        finished,
        stopped_by,
        sample_prompts(settings.values)[0],
        settings.tokens.fallback,
        bool(settings.values["tokenizer"].get("allow_normalized")) and normalized,
    )


def record(folder: RunFolder, settings: RunSettings, result: RunResult, overrides: list[str], error: str = "") -> None:
    """result.json, with the command line the run started with (a resume's own beside it) and the error that
    ended it, if one did; the summary of the sweep it is a job of; the latest link."""
    first = folder.first_overrides() if settings.resume_from else None
    entry = result_record(
        folder, first if first is not None else overrides, settings.saved(), result.metrics, result.finished, error
    )
    entry["step"] = result.step  # the optimizer steps it trained, in all
    if settings.resume_from:
        entry["resumed_with"] = overrides
    folder.write_result(entry)
    if settings.resume_from and folder.sweep():
        summarize(folder.sweep())
    if (link := settings.values.get("latest_link")) and folder.last.is_file():
        folder.point_latest(Path(link))


# ---- how it ended ----------------------------------------------------------------------------------------


def report(result: RunResult, job: Job) -> float | None:
    """How the run ended, said by the first process: stopped (with how to continue it, which also ends a sweep:
    exit 130 or 143), or done (its metrics and how to sample from it); returns its final val/bpc."""
    if process_rank() != 0:
        if not result.finished:
            sys.exit(128 + signal.Signals[result.stopped_by])
        return result.metrics.get("val/bpc")
    if not result.finished:
        log.warning("stopped by %s at step %d; checkpoint saved. Continue with: %s", result.stopped_by, result.step,
                    result.folder.continue_command())  # fmt: skip
        job.stop_sweep(signal.Signals[result.stopped_by])
        sys.exit(128 + signal.Signals[result.stopped_by])
    normalized = " (val/bpc of the text as the tokenizer's normalizer rewrites it: tokenizer.allow_normalized)"
    log.info("done: %s%s", describe_metrics(result.metrics), normalized if result.rewritten else "")
    log.info("run folder: %s", result.folder.path)
    if result.fallback:
        log.warning("%s: this model learned the offline pydoc corpus (Python's help texts), not Tiny Shakespeare; set "
                    "data.path=/path/to/input.txt to train on it", result.fallback)  # fmt: skip
    prompt = f" {prompt_option(result.prompt)}" if result.prompt else ""
    log.info(
        "sample from it: python %s --ckpt %s%s", script("generate.py"), shlex.quote(str(result.folder.path)), prompt
    )
    if job.sweep and result.stopped_by:  # taken at the job's last step, which ended it anyway
        log.warning("%s came as the job ended; the sweep stops before its next job", result.stopped_by)
        job.stop_sweep(signal.Signals[result.stopped_by])
        sys.exit(128 + signal.Signals[result.stopped_by])
    return result.metrics.get("val/bpc")


def describe_metrics(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{k} {metrics[k]:.4f}" for k in ("val/loss", "val/bpc", "train/loss") if k in metrics)


def prompt_option(prompt: str) -> str:
    """--prompt and its value as a shell types them (double quotes as the README writes prompts, single where
    they would not do), joined by = where the value starts with -, which argparse would take for an option."""
    quoted = shlex.quote(prompt) if re.search(r'["$`\\!\n]', prompt) else f'"{prompt}"'
    return f"--prompt={quoted}" if prompt.startswith("-") else f"--prompt {quoted}"


def after_divergence(err: TrainingDiverged, folder: RunFolder, settings: RunSettings) -> str:
    """What a diverged run's error says besides what the module saw: what is left of the run, and the command
    that starts it again with half its learning rate."""
    newest = folder.checkpoint_to_resume()
    left = f"the last good weights are in {newest}" if newest else "no checkpoint was written before it"
    lower = f"optim.lr={settings.values['optim']['lr'] / 2:g}"
    command = None if folder.sweep() else folder.start_command(lower)
    again = f"Start it again with a lower learning rate: {command}" if command else f"Lower the learning rate ({lower})"
    return f"{err}; {left}. {again}" + (f" (or {err.instead})" if err.instead else "")


def in_one_line(err: Exception, folder: RunFolder) -> Exception:
    """An error while the run trained, in one line with what is left of the run and how it goes on: a process
    of the run lost, a file that could not be written; any other error as it is."""
    if isinstance(err, USER_ERRORS):
        return err
    line = (str(err).strip().splitlines() or [""])[0]
    if isinstance(err, torch.distributed.DistError) or (isinstance(err, RuntimeError) and "/gloo/" in line):
        said = (
            re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")[0][:200] or type(err).__name__
        )  # without "[.../pair.cc:553] "
        return ProcessLost(
            "another process of this run ended (killed, or by an error of its own, printed above) or stopped "
            f"answering while it trained ({said}); {how_to_go_on(folder)}"
        )
    if (cannot := refused_write(err)) is not None:
        where = cannot.filename or "a file of the run"
        return RunWriteError(f"{cannot}: writing {where} failed while training; " + how_to_go_on(folder, cannot.fix))
    return err


def how_to_go_on(folder: RunFolder, fix: str = "") -> str:
    """What is left of a run an error stopped, and how it goes on: `fix` first, then continue or start again."""
    if folder.has_checkpoint():
        left, command = (
            f"the checkpoints in {folder.checkpoints} are as they were last written",
            f"continue with `{folder.continue_command()}`",
        )
    else:
        again = folder.start_command()
        left, command = "the run has no checkpoint yet", f"start it again{f': {again}' if again else ''}"
    then = f"{fix}, then {command}" if fix else command
    return f"{left}. {then[0].upper()}{then[1:]}"
