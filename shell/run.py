"""`train(cfg, run_dir)`: one training run: settle its settings (shell.settings), build its parts from
them (training.fit), fit, and record the result in its run folder (shell.run_folder). Hydra stays in train.py and
the modules that read its command line (shell.launch and those it uses)."""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

import training.fit
from data.writes import refused_write
from shell import resume
from shell.ctrl_c import block_for_children, unblock_ctrl_c
from shell.errors import USER_ERRORS, ProcessLost, RunWriteError, TrackerError, TrainingDiverged
from shell.flops import device_peak_flops, remember_rate
from shell.init_from import Start
from shell.loggers import build_loggers, finish_loggers
from shell.progress import progress_callback
from shell.run_folder import Claim, RunFolder, claim
from shell.settings import precision_words, resolve, resolve_resumed
from shell.stop import GracefulStop
from shell.sweep import result_record, summarize
from training.fit import Extras, Fitted
from training.module import GPTModule
from training.run_settings import RunSettings, sample_prompts

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    best_checkpoint: Path | None
    last_checkpoint: Path | None
    metrics: dict[str, float] = field(default_factory=dict)
    step: int = 0
    finished: bool = True  # False when a signal stopped the run early
    stopped_by: str | None = None  # the stop signal it took while training (SIGINT, SIGTERM), early or at its last step
    prompt: str = ""  # the run's first sample prompt, for the generate.py command it suggests
    fallback: str | None = None  # why the run trained on a stand-in text (data.sources.Source.fallback)
    rewritten: bool = False  # its tokenizer's normalizer rewrites the text, as tokenizer.allow_normalized allows


def train(
    cfg: DictConfig | dict,
    run_dir: str | os.PathLike,
    extra_callbacks: Sequence[L.Callback] = (),
    named: Iterable[str] = (),
    overrides: Iterable[str] = (),
) -> RunResult:
    """Train as `python train.py` does, from a composed config, into run_dir (resume= in the config
    continues the run there). `named`: the settings the command line gives (dotted keys): init_from
    keeps its checkpoint's other model settings, and a resumed run refuses named ones that contradict
    it; dotted keys such as model.n_layer (a group's key, such as model, names all its settings).
    `overrides`: the command line, recorded in result.json. `extra_callbacks`: more Lightning
    callbacks, after the run's own (Lightning still moves checkpoint callbacks last)."""
    folder = RunFolder(run_dir)
    main_process = rank_zero_only.rank == 0
    requested = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    requested.pop("hydra", None)
    checkpoint = resume.checkpoint_in(requested, folder)
    if checkpoint is not None and main_process:
        folder.check_continuable()
    taken = claim(folder, new=checkpoint is None) if main_process else None
    try:
        settings, start = settle(requested, named, folder, checkpoint, taken, main_process)
        if main_process:
            prepare_folder(folder, settings, checkpoint)
        result = fit(settings, folder, start, extra_callbacks)
        if main_process:
            record(folder, settings, result, list(overrides))
        return result
    except TrainingDiverged as err:
        raise recorded_divergence(err, folder, settings, list(overrides), main_process) from None
    except TrackerError:
        if taken is not None and checkpoint is None:
            taken.take_back()  # it stopped before training: a new run leaves nothing behind
        raise
    except (KeyboardInterrupt, SystemExit) as stop:
        # Ctrl-C outside the training loop (start-up, data preparation; twice in the loop), which Lightning
        # turns into exit(1) inside fit: a new run with no checkpoint yet has nothing to continue and is
        # taken back; train.py says which
        if isinstance(stop, SystemExit) and not isinstance(stop.__context__, KeyboardInterrupt):
            raise
        if taken is not None and checkpoint is None:
            taken.take_back()
        raise KeyboardInterrupt from None
    finally:
        if taken is not None:
            taken.release()


def settle(
    requested: dict,
    named: Iterable[str],
    folder: RunFolder,
    checkpoint: Path | None,
    taken: Claim | None,
    main_process: bool,
) -> tuple[RunSettings, Start | None]:
    """The run's settings, and for a new run where its weights start: a new run's folder checked first;
    a start that is refused takes back the new folder it claimed (`taken`)."""
    try:
        if checkpoint is None and main_process:
            folder.check_new("run_dir")
        return (
            resolve(requested, named) if checkpoint is None else (resolve_resumed(checkpoint, requested, named), None)
        )
    except USER_ERRORS:
        if taken is not None and checkpoint is None:
            taken.take_back()  # a refused start leaves nothing behind
        raise


def prepare_folder(folder: RunFolder, settings: RunSettings, checkpoint: Path | None) -> None:
    """The run folder before training: a new run's settings saved; a resumed run's checkpoints after the
    one it continues from set aside, and a finished run reopened."""
    if checkpoint is None:
        save_settings(folder, settings)
        return
    moved = folder.set_aside_after(settings.resume_step)
    if moved:
        log.warning(
            "resuming from step %d, before the run's newest checkpoint: the %d checkpoint(s) after it "
            "are moved to %s, and the run goes on from step %d",
            settings.resume_step, len(moved), moved[0].parent, settings.resume_step,
        )  # fmt: skip
    folder.reopen()  # a finished run trained further is unfinished until its new end is recorded


def recorded_divergence(
    err: TrainingDiverged, folder: RunFolder, settings: RunSettings, overrides: list[str], main_process: bool
) -> TrainingDiverged:
    """The error a diverged run ends with (after_divergence), recorded in its result.json by the main
    process, as a finished or stopped run's end is."""
    diverged = TrainingDiverged(after_divergence(err, folder, settings))
    if main_process:
        ended = RunResult(folder.path, None, None, finished=False)
        record(folder, settings, ended, overrides, error=str(diverged))
    return diverged


def save_settings(folder: RunFolder, settings: RunSettings) -> None:
    """config.yaml and tokenizer.json: written when a run starts, never rewritten."""
    folder.settings_file.write_text(OmegaConf.to_yaml(settings.saved()))
    folder.tokenizer_file.write_text(settings.tokens.tokenizer_json, encoding="utf-8")


def after_divergence(err: TrainingDiverged, folder: RunFolder, settings: RunSettings) -> str:
    """What a diverged run's error says besides what the module saw: what is left of the run, and the
    command that starts it again with half its learning rate (a resumed run keeps its own)."""
    newest = folder.checkpoint_to_resume()
    left = (
        f"the last good weights are in {newest}"
        if newest
        else f"no checkpoint was written before it (the run's log: {folder.log})"
    )
    lower = f"optim.lr={settings.values['optim']['lr'] / 2:g}"
    command = None if folder.sweep() else folder.new_run_command(lower)
    again = f"Start it again with a lower learning rate: {command}" if command else f"Lower the learning rate ({lower})"
    instead = f" (or {err.instead})" if err.instead else ""
    return f"{err}; {left}. {again}{instead}"


def record(
    folder: RunFolder, settings: RunSettings, result: RunResult, overrides: list[str], error: str | None = None
) -> None:
    """result.json, with the command line the run started with (and a resume's own beside it) and the
    error that ended it, if one did; the summary of the sweep the run is a job of; the latest link."""
    first = folder.first_overrides() if settings.resume_from else None
    entry = result_record(
        folder, first if first is not None else overrides, settings.saved(), result.metrics, result.finished, error
    )
    if settings.resume_from:
        entry["resumed_with"] = overrides
    folder.write_result(entry)
    if settings.resume_from and folder.sweep():
        summarize(folder.sweep())
    link = settings.values.get("latest_link")
    if link and result.last_checkpoint:
        folder.point_latest(Path(link))


# ---- fitting ---------------------------------------------------------------------------------------------


def fit(
    settings: RunSettings, folder: RunFolder, start: Start | None, extra_callbacks: Sequence[L.Callback]
) -> RunResult:
    """The core's training.fit, with the shell's parts around it: the loggers (started before it, finished
    after), the progress bar, the stop on a signal, the cluster's plugins, the CPU's peak FLOP/s; an
    error while it trains said in one line with what is left of the run and how it goes on."""
    quiet_known_warnings()
    loggers = build_loggers(settings.values.get("logger") or {}, folder, settings.resume_step)
    start_loggers(loggers, settings.saved())
    stop = GracefulStop()
    # the bar on a terminal, plain lines in a log file (shell.progress)
    callbacks = [progress_callback(settings.accumulation)] if settings.trainer["enable_progress_bar"] else []
    extras = Extras(
        loggers=loggers,
        callbacks=[*callbacks, stop, *extra_callbacks],
        plugins=cluster_plugins(),
        peak_flops=device_peak_flops,
        on_faster=remember_rate,
        before_fit=lambda trainer, module: before_fit(settings, start, trainer, module),
    )
    try:
        fitted = training.fit.fit(settings, folder.path, start.state if start else None, extras)
    except Exception as err:
        raise in_one_line(err, folder) from None
    finally:
        unblock_ctrl_c()  # (where training never started: see block_for_children)
        finish_loggers(loggers)
    return result_of(fitted, settings, folder, stop)


def before_fit(settings: RunSettings, start: Start | None, trainer: L.Trainer, module: GPTModule) -> None:
    if start:
        log.info("starting from the weights of %s", start.source)
    describe_run(settings, module)
    block_for_children(trainer)  # (a Ctrl-C as the processes of a ddp launch start: shell.ctrl_c)


def in_one_line(err: Exception, folder: RunFolder) -> Exception:
    """An error while the run trained, said in one line with what is left of the run and how it goes on (a
    process of the run lost, a file that could not be written), where it does not say so in its own words."""
    if isinstance(err, USER_ERRORS):
        return err  # (a diverged run, a tracker that failed)
    if (why := lost_touch(err)) is not None:
        return ProcessLost(
            "another process of this run ended (killed, or by an error of its own, printed above) or stopped "
            f"answering while it trained ({why}); {how_to_go_on(folder)}"
        )
    if (cannot := refused_write(err)) is not None:
        return RunWriteError(
            f"{cannot}: writing {cannot.filename or 'a file of the run'} failed while training; "
            + how_to_go_on(folder, cannot.fix)
        )
    return err


def result_of(fitted: Fitted, settings: RunSettings, folder: RunFolder, stop: GracefulStop) -> RunResult:
    """What the run reached: its last training and validation values, its checkpoints, and the stop
    signal it took, if any (which stopped it before its end, but at its last step)."""
    trainer, module = fitted.trainer, fitted.module
    metrics = {**module.latest_train_values, **module.latest_val_values}
    metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1})
    return RunResult(
        run_dir=folder.path,
        best_checkpoint=Path(fitted.best.best_model_path) if fitted.best.best_model_path else None,
        last_checkpoint=folder.last if folder.last.is_file() else None,
        metrics=metrics,
        step=trainer.global_step,
        finished=stop.stopped_at is None,
        stopped_by=stop.requested,
        prompt=sample_prompts(settings.values)[0],
        fallback=settings.tokens.fallback,
        rewritten=bool(settings.values["tokenizer"].get("allow_normalized"))
        and json.loads(settings.tokens.tokenizer_json).get("normalizer") is not None,
    )


def how_to_go_on(folder: RunFolder, fix: str = "") -> str:
    """What is left of a run stopped by an error while it trained, and how it goes on: `fix` (what to
    do first), then the command that continues it or starts it again."""
    if folder.has_checkpoint():
        left = f"the checkpoints in {folder.checkpoints} are as they were last written"
        command = f"continue with `{folder.continue_command()}`"
    else:
        left, command = "the run has no checkpoint yet", f"start it again{folder.start_again() or ''}"
    then = f"{fix}, then {command}" if fix else command
    return f"{left}. {then[0].upper()}{then[1:]}"


def lost_touch(err: BaseException) -> str | None:
    """What the communication between a run's processes said, in a few words, where err is its failure:
    another process ended (killed, or stopped by an error of its own) or stopped answering. gloo (CPUs)
    raises a RuntimeError naming its source file, NCCL (GPUs) a torch.distributed.DistError. None for
    any other error."""
    line = (str(err).strip().splitlines() or [""])[0]
    if not isinstance(err, torch.distributed.DistError) and not (isinstance(err, RuntimeError) and "/gloo/" in line):
        return None
    said = re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")[0]  # without gloo's "[.../pair.cc:553] "
    return said[:200] or type(err).__name__


def start_loggers(loggers: list, saved: dict) -> None:
    """Each tracker records the run's settings, which starts its log (wandb.init for wandb): a tracker
    that cannot start (online, with no network) stops the run before it trains, in one line."""
    for logger in loggers:
        try:
            logger.log_hyperparams(saved)
        except Exception as err:
            if type(err).__module__.split(".")[0] != "wandb":
                raise
            raise TrackerError(
                f"wandb could not start the run's log ({str(err).splitlines()[0][:300]}); check the network and "
                "your wandb login, or log offline with logger.wandb.mode=offline (upload later with `wandb sync`)"
            ) from None


def describe_run(settings: RunSettings, module: GPTModule) -> None:
    config = settings.model
    log.info(
        "model: %s parameters (%d layers, %d heads, %d wide, context %d, vocab %d); data: %s; "
        "%d tokens per step = %d sequences x %d tokens x %d device(s) x %d accumulation; precision %s%s",
        f"{module.model.num_parameters():,}",
        config.n_layer,
        config.n_head,
        config.n_embd,
        config.block_size,
        config.vocab_size,
        data_words(settings.tokens.meta),
        settings.tokens_per_step,
        settings.values["data"]["batch_size"],
        config.block_size,
        settings.world_size,
        settings.accumulation,
        settings.trainer["precision"],
        precision_words(settings),
    )
    if settings.resume_from:
        log.info("resuming from %s (step %d)", settings.resume_from, settings.resume_step)


def data_words(meta: dict[str, Any]) -> str:
    """The run's text, and its BPE-dropout encodings if it has them."""
    copies = meta.get("train_copies")
    if not copies:
        return str(meta.get("source"))
    return f"{meta.get('source')}, with {len(copies)} BPE-dropout encodings of its training split (dropout {meta.get('dropout')})"


def describe_metrics(metrics: dict[str, Any]) -> str:
    keys = ("val/loss", "val/bpc", "train/loss")
    return ", ".join(f"{k} {metrics[k]:.4f}" for k in keys if k in metrics)


def cluster_plugins() -> list[Any]:
    """Under SLURM, Lightning's own requeue (on SIGUSR1, an hpc_ckpt file and `scontrol requeue`) is
    off: a stop checkpoints through GracefulStop (SIGTERM), and the requeued job continues its run
    folder through resume (see train.py)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def quiet_known_warnings() -> None:
    """Silence warnings that are advice for other setups, not problems of this one."""
    for message in (
        r".*does not have many workers.*",  # num_workers=0 is the fast choice on a small CPU
        r".*GPU available but not used.*",
        r"Experiment logs directory .* exists and is not empty.*",  # the CSV log shares the run folder
        r"Checkpoint directory .* exists and is not empty.*",  # a resumed run's own checkpoints
        r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",  # inside Lightning, with newer torch
        r".*resuming from a checkpoint that ended before the epoch ended.*",  # StepSampler restarts the data order
        r"The number of training batches .* is smaller than the logging interval.*",  # a run logs its last step's values
    ):
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
        lambda record: "litlogger" not in record.getMessage()
    )
