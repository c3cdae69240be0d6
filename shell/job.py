"""A training job as train.py runs it under Hydra: the command line checked and the run folder chosen
before Hydra starts (`launch`), then each job Hydra runs (one, or each of a sweep) trained by shell.run in
its folder, and how it ended said: done (with its metrics and how to sample from it), stopped (with how to
continue it), or refused (in one line). Ctrl-C is held while Hydra's own code runs (shell.ctrl_c)."""

from __future__ import annotations

import logging
import math
import os
import re
import shlex
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from shell import resume
from shell.command_line import CommandLineError
from shell.config_groups import named_settings
from shell.ctrl_c import (
    WATCH,
    defer_stop,
    hold_ctrl_c,
    raise_deferred_stop,
    release_ctrl_c,
    report_ctrl_c,
    stopped_by_ctrl_c,
)
from shell.errors import USER_ERRORS, ProcessLost, RunWriteError, TrainingDiverged
from shell.job_logging import log_libraries_to_file, quiet_console_of_other_processes, to_log_file
from shell.launch import Launch
from shell.run_folder import RunFolder, RunFolderError, process_rank, script
from shell.startup import started
from shell.sweep import OBJECTIVE, how_to_continue_sweep, result_record, summarize
from shell.sweep_launch import CONTINUED_SWEEP

if TYPE_CHECKING:
    from shell.run import RunResult

log = logging.getLogger("train")


# ---- before Hydra, and each job --------------------------------------------------------------------------

LAUNCHED: list[Launch] = []  # the command line this process checked (its defaults serve every job)


def launch(main: Callable[[], None]) -> None:
    """train.py's start: check the whole command line and choose the run's folder (refused in one line,
    leaving nothing behind), then hand it to Hydra, which calls `main` once per job. The checks import
    more libraries as they need them, and a KeyboardInterrupt inside a C extension's import breaks it (an
    ImportError, then a fatal error at exit): Ctrl-C is held until the command line is checked, and then
    takes back the folder it claimed."""
    hold_ctrl_c()
    try:
        checked = Launch(sys.argv[1:])
        hydra_args = checked.hydra_args()
        release_ctrl_c()
    except (*USER_ERRORS, CommandLineError) as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        stopped_by_ctrl_c()
    if checked.shown is not None:
        print(checked.shown, end="")
        sys.exit(0)
    LAUNCHED.append(checked)
    sys.argv = [sys.argv[0], *hydra_args]
    try:
        hold_ctrl_c()
        main()
        release_ctrl_c()
    except KeyboardInterrupt:  # while Hydra composed, before a job began (or after the last)
        stopped_by_ctrl_c()


def job(cfg: DictConfig) -> float | None:
    """One job Hydra runs: train it and say how it ended; its final val/bpc, which sweepers minimise."""
    defaults = LAUNCHED[-1].defaults if LAUNCHED else None
    if defaults is None:  # (a job not started by launch)
        defaults = OmegaConf.to_container(hydra.compose("train", overrides=[]), resolve=True)
    release_ctrl_c()  # a Ctrl-C held while Hydra composed this job: raised before the job begins
    raise_deferred_stop()  # and one the job before took at its last step
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    resuming = resume.resumes_a_run(cfg, hydra_cfg.output_subdir)
    where = (run_dir, run_dir / hydra_cfg.output_subdir if resuming else None)
    WATCH.arm(lambda: report_ctrl_c(*where))  # (Ctrl-C while the processes of a ddp launch start)
    try:
        return run_job(cfg, defaults)
    except KeyboardInterrupt:
        stopped_by_ctrl_c(*where)
    finally:
        hold_ctrl_c()  # Hydra's code again, until the next job (or the end)


# ---- the run --------------------------------------------------------------------------------------------


def quoted(text: str) -> str:
    """text as one shell word, in double quotes as the README writes prompts (single where they would not do)."""
    return shlex.quote(text) if re.search(r'["$`\\!\n]', text) else f'"{text}"'


def prompt_option(prompt: str) -> str:
    """--prompt and its value as a shell types them; joined by = where the value starts with -, which
    argparse would otherwise read as an option of its own."""
    return f"--prompt={quoted(prompt)}" if prompt.startswith("-") else f"--prompt {quoted(prompt)}"


def continue_job(cfg: DictConfig, folder: RunFolder) -> float | None:
    """A job of a sweep being continued (python train.py -m resume=SWEEP), before it trains: one that
    finished is kept as it is (its objective returned), a stopped one continues from its checkpoint, and
    what one that stopped before its first checkpoint wrote goes; None where it trains."""
    from shell.run import describe_metrics

    state = folder.continuation()
    if state == "finished":
        metrics = folder.read_result().get("metrics", {})
        record = log.makeRecord(
            log.name, logging.INFO, __file__, 0, "job %s finished before (%s); kept as it is",
            (folder.path.name, describe_metrics(metrics)), None,
        )  # fmt: skip
        for handler in logging.getLogger().handlers:  # on the console alone: the job's train.log stays as it ended
            if not isinstance(handler, logging.FileHandler) and log.isEnabledFor(logging.INFO):
                if record.levelno >= handler.level:
                    handler.handle(record)
        return metrics.get(OBJECTIVE, math.inf)
    if state == "resume":
        resume.continue_from(cfg, folder.checkpoint_to_resume())
    elif state == "again" and process_rank() == 0:
        try:
            folder.clear_start()
        except RunFolderError as err:  # files of someone's own in it: left as they are, and the sweep goes on
            log.error("error: %s", err)
            return math.inf
    return None


def run_job(cfg: DictConfig, defaults: dict) -> float | None:
    """main's work: train the run Hydra composed (`defaults`: the settings with no override), and say how
    it ended."""
    from shell.run import train  # Lightning: loaded once the command line is known to be good

    started()  # the first job of the process: start-up is over (shell.startup)
    log_libraries_to_file()
    quiet_console_of_other_processes()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun and os.environ.get(CONTINUED_SWEEP) == str(RunFolder(hydra_cfg.sweep.dir).path):
        kept = continue_job(cfg, RunFolder(run_dir))
        if kept is not None:
            return kept
    requested = OmegaConf.to_container(cfg, resolve=True)
    named = named_settings([o for o in overrides if not o.startswith("hydra.")], requested, defaults)
    try:
        result = train(cfg, run_dir, named=named, overrides=overrides)
    except USER_ERRORS as err:
        return ended_by_error(err, hydra_cfg, requested, overrides)
    return report_result(result, hydra_cfg)


def ended_by_error(err: Exception, hydra_cfg: DictConfig, requested: dict, overrides: list[str]) -> float:
    """A run that one of USER_ERRORS ended: the process exits saying it, but for a job of a sweep, which
    records it (and returns the worst objective) so that the sweep goes on."""
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if resume.resumes_a_run(requested, hydra_cfg.output_subdir):
        shutil.rmtree(
            run_dir / hydra_cfg.output_subdir, ignore_errors=True
        )  # a refused resume leaves its run as it was
    if not multirun or isinstance(err, RunWriteError):  # a full disk stops a sweep too
        if isinstance(err, ProcessLost) or (isinstance(err, TrainingDiverged) and process_rank() == 0):
            to_log_file(f"error: {err}")  # the run's own log says how it ended
        if process_rank() != 0 and isinstance(err, TrainingDiverged | ProcessLost):
            sys.exit(1)  # every process meets a divergence alike, and another's end is the first's to tell
        sys.exit(f"error: {err}")
    log.error("error: %s", err)  # one job of a sweep: recorded, and the sweep goes on
    if isinstance(err, RunFolderError) or resume.asked(requested):  # a folder this job could not have, or
        return math.inf  # a stopped job of a sweep that could not continue: whatever is there stays
    folder = RunFolder(run_dir)
    if not folder.result_file.is_file():  # (a job that diverged has recorded how)
        run_dir.mkdir(parents=True, exist_ok=True)
        folder.write_result(result_record(folder, overrides, requested, {}, False, str(err)))
    return math.inf


def report_result(result: RunResult, hydra_cfg: DictConfig) -> float | None:
    """How a run that trained ended, said by the first process: stopped (with how to continue it, which
    ends a sweep, and exits 130 or 143), or done (with its metrics and how to sample from it); returns its
    final val/bpc."""
    from shell.run import describe_metrics

    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if process_rank() != 0:
        return result.metrics.get("val/bpc")
    if not result.finished:
        log.warning(
            "stopped by %s at step %d; checkpoint saved. Continue with: %s",
            result.stopped_by,
            result.step,
            RunFolder(run_dir).continue_command(),
        )
        if multirun:
            summarize(Path(hydra_cfg.sweep.dir))
            log.warning("the sweep stops here; %s", how_to_continue_sweep(Path(hydra_cfg.sweep.dir)))
        # 128 + the signal's number, as a stop before training exits (shell.ctrl_c): `train.py && next`,
        # a scheduler or CI must not take a stopped run (or sweep) for a finished one
        sys.exit(128 + signal.Signals[result.stopped_by or "SIGINT"])
    of = " (val/bpc of the text as the tokenizer's normalizer rewrites it: tokenizer.allow_normalized)"
    log.info("done: %s%s", describe_metrics(result.metrics), of if result.rewritten else "")
    log.info("run folder: %s", result.run_dir)
    if result.fallback:
        log.warning(
            "%s: this model learned the offline pydoc corpus (Python's help texts), not Tiny Shakespeare; "
            "set data.path=/path/to/input.txt to train on it",
            result.fallback,
        )
    prompt = f" {prompt_option(result.prompt)}" if result.prompt else ""
    log.info("sample from it: python %s --ckpt %s%s", script("generate.py"), shlex.quote(str(result.run_dir)), prompt)
    if multirun and result.stopped_by:  # taken at the job's last step, which ended it anyway
        log.warning("%s came as the job ended; the sweep stops before its next job", result.stopped_by)
        defer_stop(result.stopped_by)
    return result.metrics.get("val/bpc")
