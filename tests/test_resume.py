"""resume= and what it decides: a run continued by its folder, by a checkpoint or found by its settings
(resume=auto); the settings that may change beside it and the exact refusal of those that may not; runs
finished by their steps or their time; a hand-edited config.yaml (not read); checkpoints superseded, damaged or replaced
by a folder; a run started on a GPU continued on a CPU; the commands a run prints, run as printed; one process
per run (its lock); the folders a run goes into, of any name; and the folders a SLURM_JOB job or a torchrun launch
names, continued when its scheduler restarts it.

Every command runs in this process (train_here): the real command line, Hydra, the shell's callbacks and
Lightning's fit. What only a process shows (a kill, a signal's exit status, DDP) is in test_stops.py."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from shell.checks import SettingError
from shell.errors import RunFolderError
from shell.folders import RunFolder, new_folder
from shell.settings import check_continuation, contradiction
from tests.common import (
    ROOT,
    SLURM_JOB,
    TINY_OVERRIDES,
    assert_bit_equal,
    compose_config,
    flipped_copy,
    passes_the_checks,
    paste_into_bash,
    printed_after,
    refused,
    runs_under,
    sample_steps,
    snapshot,
    train_as_printed,
    train_here,
    train_losses,
    validations,
)

STEPS = 12  # a run of a real (tiny) size: model, learning rate, length and logger all differ from the defaults
STOPPED_AT = 7  # the step a Ctrl-C stopped the run at: step files 2, 4, 6 and 7, best.ckpt of step 4
JOSE = "josé, a=b"  # the quick start in /home/josé, a=b/...: an accent, a comma and =
ODD = "it's [1] {x} (y) $HOME ü日, a=b \\ end "  # a quote, brackets, $, a backslash, a space at its end


def run_args(small_text: Path, *extra: str) -> list[str]:
    return [
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "optim.lr=2e-3",
        f"trainer.max_steps={STEPS}",
        "trainer.val_check_interval=4",
        "checkpoint.every_n_steps=2",
        "checkpoint.keep=20",
        *extra,
    ]


def stopped_by_ctrl_c(args: list[str], run: Path, at: int = STOPPED_AT) -> Path:
    """The run of args in folder `run`, stopped by Ctrl-C at step `at` (with its checkpoint)."""
    ran = train_here(*args, f"hydra.run.dir={run}", cwd=run.parent, env={"TINYGPT2_FAILPOINT": f"sigint:{at}"})
    assert ran.returncode == 130, ran.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_text) -> Path:
    """The run, never stopped."""
    run = tmp_path_factory.mktemp("reference") / "run"
    ran = train_here(*run_args(small_text), f"hydra.run.dir={run}", cwd=run.parent)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, small_text) -> Path:
    """The run stopped at step 7, as it was left: tests continue a copy of it (copy_of)."""
    return stopped_by_ctrl_c(run_args(small_text), tmp_path_factory.mktemp("stopped") / "run")


@pytest.fixture(scope="module")
def listed(tmp_path_factory, small_text) -> Path:
    """The run with two trackers (logger=[tensorboard,csv]), stopped at step 7."""
    return stopped_by_ctrl_c(
        run_args(small_text, "logger=[tensorboard,csv]"), tmp_path_factory.mktemp("listed") / "run"
    )


def copy_of(run: Path, to: Path) -> Path:
    """A copy of a run folder to continue (its links kept as links, as a moved folder keeps them)."""
    to.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(run, to, symlinks=True)
    return to


def refused_beside(run: Path, *args: str) -> str:
    """train.py's one-line refusal of a command that names `run`, run from an empty folder: nothing is made there,
    and the run is as it was but for its lock (taken as the command starts) and the last line of its log, which
    may say how the command ended (`error: ...`)."""
    elsewhere = run.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    log = run / "train.log"
    logged_before = log.read_text() if log.is_file() else ""
    before = snapshot(run)
    line = refused(*args, cwd=elsewhere)
    unlogged = {k: v for k, v in before.items() if not k.endswith(("/.lock", "/.hydra", "train.log"))}
    assert {k: v for k, v in snapshot(run).items() if not k.endswith(("/.lock", "/.hydra", "train.log"))} == unlogged
    logged = log.read_text()[len(logged_before) :] if log.is_file() else ""
    assert logged == "" or (logged.count("\n") == 1 and logged.rstrip().endswith(f"error: {line}")), logged
    return line


def warnings_of(ran) -> list[str]:
    """The warning lines a command logged, without their time and logger."""
    return [line.split(" - ", 1)[-1] for line in (ran.stdout + ran.stderr).splitlines() if "[WARNING]" in line]


def last_checkpoint(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def result_of(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


# ---- what a resume may change, and what it may not ------------------------------------------------------------


def contradicting(run: Path) -> dict[str, str]:
    """Settings beside resume= that contradict the run, and what their refusal says."""
    return {
        "logger=wandb": "logger=wandb contradicts the run being resumed",
        "logger=[wandb,csv]": "logger=[wandb,csv] contradicts",
        "logger=none": f"logger=none contradicts the run being resumed ({run}), whose logger is csv;",
        "optim.lr=1e-2": "optim.lr=0.01 contradicts",
        "seed=7": "seed=7 contradicts",
        "model=nano": "model=nano (which sets model.n_embd=192) contradicts",  # the choice typed, and what it sets
        "optim=muon": "optim=muon (which sets optim.",
        "data=text": "data=text (which sets data.",  # not data.errors='strict', which the user never typed
        # a setting typed beside its group's choice is named itself, not blamed on the choice
        "data=pydoc data.batch_size=16": "data.batch_size=16 contradicts the run being resumed",
        "optim=adamw optim.lr=0.5": "optim.lr=0.5 contradicts the run being resumed",
        "experiment=shakespeare_char_cpu": "contradicts the run being resumed",
        "experiment=shakespeare_75s": "contradicts the run being resumed",  # even where it sets the defaults
        "tokenizer.vocab_size=400": "tokenizer.vocab_size=400 contradicts",
        "data=pydoc": f"data=pydoc (which sets data.batch_size=32) contradicts the run being resumed ({run}), whose "
        "data.batch_size is 8;",  # the choice's own batch, where the run was given 8
        "tokens_per_step=512": "tokens_per_step=512 contradicts",
        "trainer.max_steps=5": f"the run is already at step {STOPPED_AT}, past trainer.max_steps=5; give a larger "
        "trainer.max_steps",
        # the limits a continued run is compared against, of another type: named, where they were a TypeError
        "trainer.max_steps=abc": "trainer.max_steps must be a whole number, got 'abc'",
        "trainer.max_steps=null": "trainer.max_steps must be a whole number, got null",
        "trainer.max_time=abc": "trainer.max_time must be dd:hh:mm:ss (e.g. 00:00:01:15 for 75 seconds), got 'abc'",
        "trainer.strategy=ddp trainer.devices=2 trainer.accelerator=cpu": "this run's global batch, tokens_per_step=256, "
        "cannot be shared by 2 devices: each takes data.batch_size x model.block_size = 8 x 32 = 256 tokens at least",
    }


def with_settings(run: Path, change) -> Path:
    """The run's checkpoints with their saved settings changed by `change` (as another machine or command line
    would have saved them)."""
    for path in (run / "checkpoints").glob("*.ckpt"):
        if path.is_symlink():
            continue
        state = torch.load(path, weights_only=True)
        change(state["tinygpt2"]["config"])
        torch.save(state, path)
    return run


@pytest.mark.slow
def test_a_contradicting_setting_beside_resume_is_refused(stopped, listed, small_text, tmp_path):
    run = copy_of(stopped, tmp_path / "run")
    assert refused_beside(run, f"resume={run}", "model.n_layer=4") == (
        f"model.n_layer=4 contradicts the run being resumed ({run}), whose model.n_layer is 2; leave it out to "
        "continue the run as it was, or start a new run without resume= (README: Interrupted runs, and resuming)"
    )
    for overrides, message in contradicting(run).items():
        assert message in refused_beside(run, f"resume={run}", *overrides.split()), overrides
    assert "holds no run" in refused(f"resume={tmp_path / 'elsewhere'}", cwd=tmp_path / "elsewhere")
    assert refused_beside(run, f"resume={run / 'config.yaml'}") == (
        f"resume={run / 'config.yaml'} is a file of a run, not a checkpoint; give the run folder: resume={run}"
    )
    passes_the_checks(f"resume={run / 'checkpoints'}")  # the checkpoints folder names the run too
    # the same trackers, one of their settings changed: that setting is named, not the choice
    saved, requested = (
        {"logger": {"wandb": {"name": "orig"}, "csv": {}}},
        {"logger": {"csv": {}, "wandb": {"name": "b"}}},
    )
    assert contradiction("logger.wandb.name", "b", "orig", saved, requested, run, {}).startswith(
        f"logger.wandb.name='b' contradicts the run being resumed ({run}), whose logger.wandb.name is 'orig';"
    )

    # of a run's list of loggers, one left out: refused too, not trained on without it
    two = copy_of(listed, tmp_path / "listed")
    assert refused_beside(two, f"resume={two}", "logger=csv").startswith(
        f"logger=csv contradicts the run being resumed ({two}), whose logger is [tensorboard,csv]"
    )
    # a setting of a tracker the run has, given alone: checked against the run's own trackers, not the default
    # list (which was refused as if logger=[wandb,csv] had been given); where wandb logs may change
    wandb = OmegaConf.to_container(compose_config("logger=wandb").logger.wandb)
    tracked = with_settings(
        copy_of(listed, tmp_path / "tracked"), lambda saved: saved.update(logger={"wandb": wandb, **saved["logger"]})
    )
    assert refused_beside(tracked, f"resume={tracked}", "logger.wandb.project=other").startswith(
        f"logger.wandb.project='other' contradicts the run being resumed ({tracked}), whose logger.wandb.project is "
        "'tinygpt2'; leave it out"
    )
    # (mode offline, the advice of a wandb that cannot reach its server, is as changeable as mode disabled)
    accepted = train_here(f"resume={tracked}", "logger.wandb.project=tinygpt2", "logger.wandb.mode=disabled")
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    assert list(last_checkpoint(tracked)["tinygpt2"]["config"]["logger"]) == ["wandb", "tensorboard", "csv"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [
        ["trainer.max_steps=20", "checkpoint.keep=3", "checkpoint.every_n_steps=5", "samples.enabled=false"],
        [
            "trainer.devices=1",
            "trainer.accelerator=cpu",
            "trainer.enable_progress_bar=true",
            "trainer.log_every_n_steps=5",
        ],
        ["every original setting repeated"],
    ],
    ids=["length and checkpoints", "hardware and reports", "the run's own"],
)
def test_settings_a_resume_may_change_are_taken(changes, stopped, small_text, tmp_path):
    run = copy_of(stopped, tmp_path / "run")
    if changes == ["every original setting repeated"]:
        changes = run_args(small_text)
    resumed = train_here(f"resume={run}", *changes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    saved = last_checkpoint(run)["tinygpt2"]["config"]
    given = dict(change.split("=", 1) for change in changes)  # (the last of a key given twice)
    for key, value in given.items():
        if key.startswith(("trainer.max_steps", "checkpoint.", "samples.", "trainer.log_every")):
            section, name = key.split(".")
            assert str(saved[section][name]).lower() == value.lower(), key
    assert last_checkpoint(run)["global_step"] == saved["trainer"]["max_steps"]


@pytest.mark.slow
def test_a_file_of_the_run_replaced_by_a_folder_or_back_is_named_before_anything_changes(listed, tmp_path):
    """Each ended in a traceback once the run had been reopened (its result.json rewritten, a resume record
    added), or as it trained on."""
    run = copy_of(listed, tmp_path / "run")
    shutil.rmtree(run / "tensorboard")
    (run / "tensorboard").touch()
    assert refused_beside(run, f"resume={run}") == (
        f"cannot continue {run}: {run / 'tensorboard'} is a file, where the run keeps its own tensorboard; restore "
        "it, or move it aside, then run this again"
    )
    (run / "tensorboard").unlink()  # moved aside, as the message says: the run makes a new one
    for name in ("metrics.csv", "samples.md", "train.log", "checkpoints/best.ckpt"):
        replaced = run / name
        moved = replaced.rename(tmp_path / "aside")
        replaced.mkdir()
        assert refused_beside(run, f"resume={run}") == (
            f"cannot continue {run}: {replaced} is a folder, where the run keeps its own {replaced.name}; restore it, "
            "or move it aside, then run this again"
        )
        replaced.rmdir()
        moved.rename(replaced)
    assert train_as_printed(RunFolder(run).continue_command(), tmp_path).returncode == 0
    assert (run / "tensorboard").is_dir() and result_of(run)["finished"]


@pytest.mark.slow
def test_a_resumed_run_may_run_longer_and_keeps_its_first_settings_file(stopped, tmp_path):
    run = copy_of(stopped, tmp_path / "run")
    settings = (run / "config.yaml").read_bytes()
    resumed = train_here(f"resume={run}", "trainer.max_steps=16", "checkpoint.every_n_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last = last_checkpoint(run)
    assert last["global_step"] == 16 and last["tinygpt2"]["config"]["trainer"]["max_steps"] == 16
    assert (run / "config.yaml").read_bytes() == settings  # the settings it started with, never rewritten
    assert yaml.safe_load(settings)["trainer"]["max_steps"] == STEPS
    assert refused_beside(run, f"resume={run}") == (  # its newest checkpoint knows it was extended
        "the run is finished: it reached trainer.max_steps=16; give a larger trainer.max_steps to train it further"
    )


@pytest.mark.slow
def test_a_hand_edited_or_broken_config_yaml_is_not_read_and_the_run_keeps_its_own_settings(stopped, tmp_path):
    """config.yaml is a record of how the run began: an edit of it changes nothing, a broken one stops nothing."""
    run = copy_of(stopped, tmp_path / "run")
    text = (run / "config.yaml").read_text()
    edited = text.replace("lr: 0.002", "lr: 0.001").replace(f"max_steps: {STEPS}", "max_steps: 14")
    assert edited.count("0.001") == text.count("0.001") + 1 and "max_steps: 14" in edited
    (run / "config.yaml").write_text(edited)
    resumed = train_here(f"resume={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last = last_checkpoint(run)
    assert last["global_step"] == STEPS and last["tinygpt2"]["config"]["optim"]["lr"] == 2e-3
    assert (run / "config.yaml").read_text() == edited  # still as the user left it

    (run / "config.yaml").write_text(text + "optim: [0.1\n")
    resumed = train_here(f"resume={run}", "trainer.max_steps=18")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert last_checkpoint(run)["global_step"] == 18
    assert not [line for line in warnings_of(resumed) if "config.yaml" in line]


# ---- finished runs ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_that_ended_at_its_time_limit_is_finished_until_given_a_longer_one(small_text, tmp_path):
    args = run_args(
        small_text, "trainer.max_steps=-1", "trainer.max_time=00:00:00:02", "trainer.val_check_interval=1000"
    )
    run = tmp_path / "run"
    ended = train_here(*args, f"hydra.run.dir={run}")
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert refused_beside(run, f"resume={run}") == (  # as written, it would stop at once
        "the run is finished: it trained for its trainer.max_time=00:00:00:02; give a longer trainer.max_time to "
        "train it further"
    )
    assert "give a longer trainer.max_time" in refused_beside(run, f"resume={run}", "trainer.max_time=00:00:00:01")
    assert "give a longer trainer.max_time" in refused_beside(run, f"resume={run}", "trainer.max_steps=100000")
    earlier = sorted((run / "checkpoints").glob("step-*.ckpt"))[0]  # back to an earlier step: time is left from there
    assert train_here(f"resume={earlier}").returncode == 0
    longer = train_here(f"resume={run}", "trainer.max_time=00:00:00:03")
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert result_of(run)["finished"] and result_of(run)["config"]["trainer"]["max_time"] == "00:00:00:03"


def test_a_run_with_both_limits_is_finished_by_the_one_it_reached():
    was = {"max_steps": 16, "max_time": "00:00:01:00"}
    longer = {"trainer": {**was, "max_steps": 20}}
    check_continuation(longer, 16, True, was)  # ended at its last step: more steps train it further
    with pytest.raises(SettingError, match=r"trained for its trainer.max_time=00:00:01:00; give a longer"):
        check_continuation(longer, 10, True, was)  # ended by its time at step 10: more steps alone would stop at once
    check_continuation({"trainer": {**was, "max_time": {"minutes": 2}}}, 10, True, was)
    check_continuation(longer, 10, False, was)  # stopped before its end (Ctrl-C): continues as it is


@pytest.mark.slow
def test_a_run_ended_and_trained_further_twice_logs_each_validation_at_the_step_it_follows(small_text, tmp_path):
    """Ends that fall between validations (6 and 12, validating every 5): each end validates, and every
    validation is logged at the step it follows, minus one (Lightning's numbering), across the resumes."""
    run = tmp_path / "run"
    args = run_args(small_text, "trainer.max_steps=6", "trainer.val_check_interval=5")
    first = train_here(*args, f"hydra.run.dir={run}")
    assert first.returncode == 0, first.stderr[-3000:]
    for steps in (12, 18):
        further = train_here(f"resume={run}", f"trainer.max_steps={steps}")
        assert further.returncode == 0, further.stderr[-3000:]
    after = [5, 6, 10, 12, 15, 18]  # the steps validated after
    assert list(validations(run)) == [step - 1 for step in after]
    assert sample_steps(run) == [step - 1 for step in after for _ in range(2)]  # two prompts each


# ---- the checkpoint a resume continues from ----------------------------------------------------------------


@pytest.mark.slow
def test_a_newest_checkpoint_cut_short_is_passed_over_with_a_warning(stopped, reference, tmp_path):
    run = copy_of(stopped, tmp_path / "run")
    newest = run / "checkpoints" / f"step-{STOPPED_AT:06d}.ckpt"
    with open(newest, "r+b") as file:  # a copy that stopped part way
        file.truncate(newest.stat().st_size // 2)
    resumed = train_here(f"resume={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"{newest} cannot be read (cut short or damaged); passed over" in said
    assert f"continuing from {run / 'checkpoints' / 'step-000006.ckpt'}, the newest checkpoint that can be read" in said
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    assert train_losses(run) == train_losses(reference)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "bytes flipped in a tensor"])
def test_resuming_from_a_truncated_checkpoint_says_so(damage, reference, tmp_path):
    run = tmp_path / "run"
    broken = run / "checkpoints" / "step-000004.ckpt"
    broken.parent.mkdir(parents=True)
    saved = reference / "checkpoints" / "step-000004.ckpt"
    if damage == "truncated":
        broken.write_bytes(saved.read_bytes()[: saved.stat().st_size // 3])
    else:  # which torch.load reads without complaint, as other numbers
        flipped_copy(saved, broken, "/data/0")
    damaged = broken.read_bytes()
    (tmp_path / "elsewhere").mkdir()
    line = refused(f"hydra.run.dir={run}", f"resume={broken}", cwd=tmp_path / "elsewhere")
    assert line.startswith(f"cannot resume from {broken}: it is truncated or corrupted"), line
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000004.ckpt"] and broken.read_bytes() == damaged


@pytest.mark.slow
def test_resuming_from_an_earlier_checkpoint_sets_the_later_ones_aside(stopped, tmp_path):
    """resume= at an earlier checkpoint starts a new history from there; a later resume= of the run must
    continue that one, not the checkpoints the first history left."""
    run = copy_of(stopped, tmp_path / "run")  # step files 2, 4, 6 and 7; best.ckpt of step 4
    earlier = run / "checkpoints" / "step-000002.ckpt"
    longer = train_here(f"resume={earlier}", "trainer.max_steps=20", env={"TINYGPT2_FAILPOINT": "sigint:5"})
    assert longer.returncode == 130, longer.stderr[-3000:]
    aside = run / "checkpoints" / "superseded"
    assert f"moved to {aside}" in longer.stdout + longer.stderr
    assert sorted(p.name for p in aside.iterdir()) == [
        "best.ckpt", "step-000004.ckpt", "step-000006.ckpt", f"step-{STOPPED_AT:06d}.ckpt"
    ]  # fmt: skip
    resumed = train_here(f"resume={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run / 'checkpoints' / 'step-000005.ckpt'} (step 5)" in resumed.stdout  # the new history's
    assert last_checkpoint(run)["global_step"] == 20


@pytest.mark.slow
def test_old_periodic_checkpoints_are_pruned(small_text, tmp_path):
    run = tmp_path / "run"
    ran = train_here(*run_args(small_text, "checkpoint.keep=2", "trainer.max_steps=10"), f"hydra.run.dir={run}")
    assert ran.returncode == 0, ran.stderr[-3000:]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["best.ckpt", "last.ckpt", "step-000008.ckpt", "step-000010.ckpt"]


@pytest.mark.slow
def test_best_checkpoint_state_saved_in_a_moved_run_folder_is_kept_and_moved_with_it(reference, tmp_path):
    """A run folder copied or moved, then resumed: the best score saved is kept (Lightning's own callback forgot
    it under another folder, so the first validation after replaced best.ckpt whatever it scored), and best.ckpt
    is written in the folder the run is in now, which the state saved does not name."""
    from training.checkpoints import BestCheckpoint

    saved = torch.load(reference / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]
    moved_to = tmp_path / "moved" / "checkpoints"
    best = BestCheckpoint(moved_to)
    state = saved[best.state_key]
    assert list(state) == ["score"] and state["score"] is not None  # no path of the folder it was saved in
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        best.load_state_dict(state)
    assert best.score == state["score"] and best.path == moved_to / "best.ckpt"


@pytest.mark.slow
def test_a_run_started_on_a_gpu_continues_on_a_cpu_with_the_cpus_choices(stopped, tmp_path):
    # the precision given on the command line (trainer.precision=32-true), compile left to the machine
    run = copy_of(stopped, tmp_path / "run")
    assert yaml.safe_load((run / "config.yaml").read_text())["chosen_for_the_machine"] == ["compile"]
    with_settings(run, lambda saved: saved.update(compile=True))  # what the same command saves on a CUDA GPU
    resumed = train_here(f"resume={run}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [line for line in warnings_of(resumed) if "was chosen for" in line] == [
        "compile=true was chosen for the machine this run started on; on this one it continues with compile=false "
        "(give compile=true to keep the other)"
    ]
    settings = last_checkpoint(run)["tinygpt2"]["config"]
    assert settings["compile"] is False and settings["trainer"]["precision"] == "32-true"  # given: kept
    assert settings["chosen_for_the_machine"] == ["compile"]  # and chosen again on the next machine


@pytest.mark.slow
def test_a_fine_tune_resumes_after_the_checkpoint_it_started_from_is_gone(small_text, reference, tmp_path):
    source = copy_of(reference, tmp_path / "source")  # any run with a checkpoint to start from
    args = [*(a for a in run_args(small_text) if not a.startswith(("model.", "tokenizer."))), f"init_from={source}"]
    tuned = stopped_by_ctrl_c(args, tmp_path / "tuned")
    source.rename(tmp_path / "moved")
    resumed = train_here(f"resume={tuned}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert last_checkpoint(tuned)["global_step"] == STEPS


# ---- resume=auto ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_resume_auto_continues_the_run_with_these_settings_from_any_folder(stopped, small_text, tmp_path):
    runs = tmp_path / "runs"
    fast = copy_of(stopped, runs / "2026-01-01" / "10-00-00")  # lr 2e-3
    slow = stopped_by_ctrl_c(run_args(small_text, "optim.lr=1e-3"), runs / "2026-01-01" / "09-00-00")
    (runs / "latest").symlink_to(slow)  # as an earlier command would have left it: a link, not a run of its own
    asked = [*run_args(small_text), f"runs_root={runs}", f"latest_link={runs}/latest", "resume=auto"]

    elsewhere = tmp_path / "elsewhere"  # relative defaults (data.local_copies) name other files here
    elsewhere.mkdir()
    continued = train_here(*asked, cwd=elsewhere)
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert runs_under(runs) == sorted([slow, fast])
    assert result_of(fast)["finished"] and result_of(fast)["run_dir"] == str(fast)
    assert not result_of(slow)["finished"]
    assert not any(elsewhere.iterdir())

    other = train_here(*asked, "optim.lr=5e-3", cwd=elsewhere)  # other settings: nothing to continue, a new run
    assert other.returncode == 0, other.stderr[-3000:]
    (new,) = set(runs_under(runs)) - {slow, fast}
    said = f"resume=auto: no unfinished run under {runs} has these settings; starting a new run in {new}"
    assert other.stdout.splitlines().count(said) == 1, other.stdout[-3000:]


@pytest.mark.slow
def test_resume_auto_continues_a_run_whose_warmup_was_shortened_to_fit(small_text, tmp_path):
    """trainer.max_steps=10 beside the default optim.warmup_steps=50: the run warms up over 1 step, and saves
    that; the same command with resume= or resume=auto must continue it (resume=auto started a new run, and
    resume= refused optim.warmup_steps as a contradiction: a known defect)."""
    args = [a for a in TINY_OVERRIDES if not a.startswith("optim.warmup_steps=")]
    args += [f"data.path={small_text}", "trainer.max_steps=10", "checkpoint.every_n_steps=5"]
    stopped = train_here(*args, env={"TINYGPT2_FAILPOINT": "sigint:7"})
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    (run,) = runs_under(tmp_path / "outputs")
    assert last_checkpoint(run)["tinygpt2"]["config"]["optim"]["warmup_steps"] == 1
    again = train_here(*args, f"resume={run}", env={"TINYGPT2_FAILPOINT": "sigint:8"})
    assert again.returncode == 130, again.stderr[-3000:]
    continued = train_here(*args, "resume=auto")
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert runs_under(tmp_path / "outputs") == [run] and result_of(run)["finished"]
    assert f"resuming from {run / 'checkpoints' / 'step-000008.ckpt'} (step 8)" in continued.stdout


# ---- the commands a run prints ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["-ROMEO:", 'it\'s "$HOME"!'])
def test_the_printed_sample_command_works_for_a_prompt_a_shell_or_argparse_would_misread(
    prompt, small_text, tmp_path, capsys
):
    """The line train.py ends with samples from its first sample prompt: one that starts with - (an option to
    argparse) or holds quotes and $ (the shell's) is written so that pasting it gives generate.py that prompt."""
    import generate

    ran = train_here(*run_args(small_text, "trainer.max_steps=2", f"samples.prompts=[{prompt!r}]"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    sample = printed_after("sample from it: ", ran.stdout + ran.stderr)
    words = shlex.split(sample)
    assert words[:2] == ["python", str(ROOT / "generate.py")]
    capsys.readouterr()
    assert generate.main([*words[2:], "--max-new-tokens", "4", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith(prompt)
    if "$" in prompt:  # and pasted into a shell, as printed (generate.py as a process)
        pasted = paste_into_bash(sample + " --max-new-tokens 4 --seed 1", tmp_path)
        assert pasted.returncode == 0 and pasted.stdout.startswith(prompt), pasted.stderr[-3000:]


def without_checkpoints(run: Path, keep: tuple[str, ...]) -> Path:
    """The run folder as a kill before its first checkpoint leaves it: only the files named in keep."""
    for entry in list(run.iterdir()):
        if entry.name not in keep:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    return run


STARTED = ("config.yaml", "tokenizer.json", ".hydra", "train.log", ".lock")  # a run killed at its first step
PREPARING = (".hydra", "train.log", ".lock")  # a run killed while it prepared its data


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_names_the_command_that_starts_it_again(small_text, tmp_path):
    ran = train_here(*run_args(small_text, "trainer.max_steps=2", "samples.prompts=[ROMEO:,'a b']"))  # a value to quote
    assert ran.returncode == 0, ran.stderr[-3000:]
    (run,) = runs_under(tmp_path / "outputs")
    without_checkpoints(run, STARTED)
    line = refused_beside(run, f"resume={run}")
    assert line.startswith(f"{run} has no checkpoint to resume from"), line
    again = train_as_printed(line.split("start it again as a new run: ", 1)[1], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    (new,) = set(runs_under(tmp_path / "outputs")) - {run}
    assert yaml.safe_load((new / "config.yaml").read_text())["samples"]["prompts"] == ["ROMEO:", "a b"]


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["at its first step", "while it prepared its data"])
def test_the_start_again_command_of_a_run_given_relative_paths_works_from_another_folder(killed, small_text, tmp_path):
    started = tmp_path / "my project"
    (started / "texts").mkdir(parents=True)
    shutil.copy(small_text, started / "texts" / "input.txt")
    args = [a for a in run_args(small_text, "trainer.max_steps=2") if not a.startswith("data.path=")]
    ran = train_here(*args, "data.path=texts/input.txt", cwd=started)
    assert ran.returncode == 0, ran.stderr[-3000:]
    (run,) = runs_under(started / "outputs")
    without_checkpoints(run, STARTED if killed == "at its first step" else PREPARING)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    line = refused(f"resume={run}", cwd=elsewhere)
    again = train_as_printed(line.split("start it again as a new run: ", 1)[1], elsewhere)
    assert again.returncode == 0, again.stderr[-3000:]
    (new,) = runs_under(elsewhere / "outputs")
    assert yaml.safe_load((new / "config.yaml").read_text())["data"]["path"] == str(started / "texts" / "input.txt")


@pytest.mark.slow
def test_trainer_takes_any_lightning_argument(small_text, tmp_path):
    run = tmp_path / "run"
    args = ["trainer.max_steps=3", "optim.warmup_steps=1", "trainer.deterministic=true", "trainer.profiler=simple"]
    ran = train_here(*TINY_OVERRIDES, f"data.path={small_text}", *args, f"hydra.run.dir={run}")
    assert ran.returncode == 0, ran.stderr[-3000:]
    trainer = last_checkpoint(run)["tinygpt2"]["config"]["trainer"]
    assert trainer["deterministic"] is True and trainer["profiler"] == "simple"
    assert "FIT Profiler Report" in (run / "train.log").read_text()  # (Lightning's own lines go to the run's log)


# ---- one process per run: its lock ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_process_on_a_running_run_is_refused(stopped, small_text, held_elsewhere, tmp_path):
    hold, let_go = held_elsewhere
    run = copy_of(stopped, tmp_path / "runs" / "2026-01-01" / "09-00-00")
    pid = hold(run)
    assert f"run {run} is being trained by process {pid} on " in refused_beside(run, f"resume={run}")
    here = tmp_path / "here"  # (an empty folder, which the refusals leave empty)
    here.mkdir()
    assert f"{run} is a run being trained by process {pid} on " in refused(
        *run_args(small_text), f"hydra.run.dir={run}", cwd=here
    )
    assert f"resume=auto: the run with these settings, {run}, is being trained by process {pid} on " in refused(
        *run_args(small_text), f"runs_root={tmp_path / 'runs'}", "resume=auto", cwd=here
    )
    let_go()  # the lock is free once its process has ended
    resumed = train_here(f"resume={run}")
    assert resumed.returncode == 0 and result_of(run)["finished"], resumed.stderr[-3000:]


@pytest.mark.slow
def test_a_lock_taken_between_the_check_and_the_start_keeps_the_second_command_out(stopped, tmp_path):
    """Two commands that continue one run at once both find it free, and both take its lock: the one that loses
    the race must stop there, not train the run beside the other. (Held here by this process, whose own lock the
    first look passes over: the moment after the winner has taken the lock.)"""
    run = copy_of(stopped, tmp_path / "run")
    held = RunFolder(run).lock()
    try:
        before = snapshot(run / "checkpoints")
        line = refused(f"resume={run}", cwd=tmp_path)
        assert f"run {run} is being trained by process {os.getpid()} on " in line
        assert snapshot(run / "checkpoints") == before  # nothing trained
    finally:
        os.close(held)


# ---- run folders --------------------------------------------------------------------------------------------------


def test_a_folder_of_the_users_own_files_is_refused_and_left_as_it_was(small_text, tmp_path):
    mine = tmp_path / "project"
    (mine / "src").mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / "src" / "main.py").write_text("print('mine')")
    (mine / "config.yaml").write_text("mine: true\n")
    before = snapshot(mine, itself=False)  # (the folder's own time changes: it is tried for writing)
    (tmp_path / "here").mkdir()
    line = refused(*run_args(small_text), f"hydra.run.dir={mine}", cwd=tmp_path / "here")
    assert "holds files that are not a run's (config.yaml, notes.txt, src)" in line
    with pytest.raises(RunFolderError, match="holds files that are not a run's"):  # the Python API too
        RunFolder(mine).check_new("hydra.run.dir")
    assert snapshot(mine, itself=False) == before and (mine / "config.yaml").read_text() == "mine: true\n"


def test_the_output_folder_of_another_hydra_program_is_refused_and_left_as_it_was(small_text, tmp_path):
    """A folder holding only Hydra's record and a log, as any Hydra program leaves them: not this run's."""
    theirs = tmp_path / "their_app"
    (theirs / ".hydra").mkdir(parents=True)
    (theirs / ".hydra" / "config.yaml").write_text("their: own\n")
    (theirs / "train.log").write_text("their log\n")
    before = snapshot(theirs, itself=False)
    (tmp_path / "here").mkdir()
    line = refused(*run_args(small_text), f"hydra.run.dir={theirs}", cwd=tmp_path / "here")
    assert "holds files that are not a run's (.hydra)" in line  # (train.log: a name a run's own log has too)
    assert snapshot(theirs, itself=False) == before


@pytest.mark.parametrize(
    "record",
    [
        "runs_root: outputs\ntokens_per_step: null\n",  # a start of this run killed before it saved anything
        "model:\n  n_layer: 2\n  n_head",  # being written by another process of the launch (torchrun)
        "",  # made, not yet written
        None,  # .hydra made, its files not yet
    ],
)
def test_hydra_record_of_this_project_in_a_new_run_folder_is_taken_as_its_own(record, tmp_path):
    """A folder holding only Hydra's record and log is refused only where the record is another program's:
    torchrun's other processes write theirs into the shared folder as the first checks it."""
    folder = tmp_path / "run"
    (folder / ".hydra").mkdir(parents=True)
    if record is not None:
        (folder / ".hydra" / "config.yaml").write_text(record)
    (folder / "train.log").write_text("")
    RunFolder(folder).check_new("hydra.run.dir")
    (folder / ".hydra" / "config.yaml").write_text("db:\n  driver: mysql\n")  # another Hydra program's
    with pytest.raises(RunFolderError, match=r"holds files that are not a run's \(\.hydra\)"):
        RunFolder(folder).check_new("hydra.run.dir")


@pytest.mark.slow
def test_two_runs_started_in_the_same_second_get_two_folders(monkeypatch, small_text, tmp_path):
    import shell.folders

    class Frozen:
        @staticmethod
        def now():
            from datetime import datetime

            return datetime(2026, 11, 22, 9, 46, 2)

    monkeypatch.setattr(shell.folders, "datetime", Frozen)
    (first, _), (second, _) = new_folder(tmp_path / "claims"), new_folder(tmp_path / "claims")
    assert first.path.name == "09-46-02" and second.path.name == "09-46-02-2"
    for _ in range(2):
        ran = train_here(*run_args(small_text))
        assert ran.returncode == 0, ran.stderr[-3000:]
    runs = runs_under(tmp_path / "outputs")
    assert [run.name for run in runs] == ["09-46-02", "09-46-02-2"]
    for run in runs:  # each holds one whole run: its own steps, logged once each
        assert sorted(train_losses(run)) == list(range(STEPS))


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["runs_root", "hydra.run.dir"])
def test_a_run_goes_into_any_folder_typed_and_resume_auto_says_it_starts_a_new_run(setting, small_text, tmp_path):
    """runs_root=/tmp/ü日..., hydra.run.dir=... typed as the shell passes them (no quotes of Hydra's); with
    resume=auto and nothing to continue there, one line says what was looked for and that a new run starts."""
    place = tmp_path / ODD / "runs"
    args = run_args(small_text, "trainer.max_steps=2")
    if setting == "runs_root":
        args = [a for a in args if not a.startswith("latest_link=")]  # ${runs_root}/latest, in that folder too
    ran = train_here(*args, f"{setting}={place}", "resume=auto")
    assert ran.returncode == 0, ran.stderr[-3000:]
    (run,) = runs_under(place) if setting == "runs_root" else [place]
    assert result_of(run)["finished"] and result_of(run)["run_dir"] == str(run)
    if setting == "runs_root":
        assert (place / "latest").resolve() == run
        line = f"resume=auto: no unfinished run under {place} has these settings; starting a new run in {run}"
    else:
        line = f"resume=auto: {run} holds no checkpoint to continue from; starting a new run there"
    assert ran.stdout.splitlines().count(line) == 1, ran.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [ODD]
    continued = train_here(f"resume={run}", "trainer.max_steps=4")  # resume= takes it whole, too
    assert continued.returncode == 0 and last_checkpoint(run)["global_step"] == 4, continued.stderr[-3000:]


@pytest.mark.parametrize(
    "folder, args, said",
    [
        (JOSE, ["optim.lr=-1"], "optim.lr must be above 0, got -1"),
        (JOSE, [f"hydra.run.dir={ODD}/run", "optim.lr=-1"], "optim.lr must be above 0, got -1"),
        (JOSE, ["optim.lr=1e-3,-1", f"hydra.sweep.dir={ODD}", "-m"], "optim.lr must be above 0, got -1"),
        (JOSE, [f"resume={ODD}"], f"resume={ODD} does not exist"),
        ("a${x}b", [], "has ${ in its path, which Hydra reads as a reference to a setting"),
        ("a${x}b", ["optim.lr=1e-3,2e-3", "-m"], "has ${ in its path, which Hydra reads as a reference to a setting"),
    ],
)
def test_a_refused_start_in_or_into_such_a_folder_leaves_nothing(folder, args, said, small_text, tmp_path):
    here = tmp_path / folder
    here.mkdir()
    flags = [a for a in args if a.startswith("-")]  # (-m first, as typed)
    assert said in refused(*flags, *run_args(small_text), *(a for a in args if a not in flags), cwd=here)
    assert not any(here.iterdir()) and [p.name for p in tmp_path.iterdir()] == [folder]


# ---- a scheduler's launch: SLURM_JOB, torchrun -------------------------------------------------------------------------


def launched_from(place: Path, small_text: Path) -> list[str]:
    """The run's command line as a scheduler's job runs it, its runs under place/outputs."""
    (place / "here").mkdir(exist_ok=True)  # where it runs: an empty folder, which a refusal leaves empty
    return [*run_args(small_text), f"runs_root={place / 'outputs'}"]


@pytest.mark.slow
def test_a_requeued_slurm_job_continues_its_run(stopped, reference, small_text, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from shell.job import choose_folder

    args, here = launched_from(tmp_path, small_text), tmp_path / "here"
    run = copy_of(stopped, tmp_path / "outputs" / "slurm-4242")  # the job's run, stopped at step 7
    assert f"{run} already holds a run" in refused(*args, cwd=here, env=SLURM_JOB)  # the same job id, not requeued

    for key, value in {**SLURM_JOB, "SLURM_PROCID": "1", "SLURM_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(key, value)  # a requeue, as every task of the job decides it, here the second
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        config = compose("train", overrides=args, return_hydra_config=True)
    assert choose_folder(config) == (RunFolder(run), None, True)
    monkeypatch.undo()

    requeued = train_here(*args, cwd=here, env={**SLURM_JOB, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"this job was restarted by its scheduler: continuing {run}" in requeued.stderr
    assert result_of(run)["finished"]
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    assert not list(run.rglob("hpc_ckpt*"))  # Lightning's own requeue is off


@pytest.mark.slow
def test_a_slurm_job_requeued_before_its_first_checkpoint_starts_again(stopped, reference, small_text, tmp_path):
    args = launched_from(tmp_path, small_text)
    run = without_checkpoints(copy_of(stopped, tmp_path / "outputs" / "slurm-4242"), (*STARTED, "metrics.csv"))
    requeued = train_here(*args, cwd=tmp_path / "here", env={**SLURM_JOB, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert (
        f"this job was restarted by its scheduler: {run} stopped before its first checkpoint, so it starts again"
        in requeued.stderr
    )
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
    assert train_losses(run) == train_losses(reference)  # the first start's rows went with it: each step once


@pytest.mark.slow
def test_a_job_stopped_before_its_first_checkpoint_holding_a_users_file_is_left_as_it_is(stopped, small_text, tmp_path):
    args = launched_from(tmp_path, small_text)
    run = without_checkpoints(copy_of(stopped, tmp_path / "outputs" / "slurm-4242"), STARTED)
    (run / "notes.txt").write_text("mine")
    before = snapshot(run)
    line = refused(*args, cwd=tmp_path / "here", env={**SLURM_JOB, "SLURM_RESTART_COUNT": "1"})
    assert line == (
        f"{run} stopped before its first checkpoint, and holds files that are not a run's (notes.txt); move them out "
        "of it, then run this again to start it there anew"
    )
    assert {k: v for k, v in snapshot(run).items() if not k.endswith(".lock")} == {
        k: v for k, v in before.items() if not k.endswith(".lock")
    }


@pytest.mark.slow
def test_a_torchrun_launch_names_its_run_folder_and_a_restart_continues_it(stopped, reference, small_text, tmp_path):
    """Every process of a torchrun launch composes the config; they agree on outputs/torchrun-<its run id>. A
    launch of the same id is not a new run there; torchrun's restart of its workers continues it."""
    args, here, launch = launched_from(tmp_path, small_text), tmp_path / "here", {"TORCHELASTIC_RUN_ID": "job/7"}
    run = copy_of(stopped, tmp_path / "outputs" / "torchrun-job_7")
    assert f"{run} already holds a run" in refused(*args, cwd=here, env=launch)
    restarted = train_here(*args, cwd=here, env={**launch, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert f"this job was restarted by its scheduler: continuing {run}" in restarted.stderr
    assert_bit_equal(run / "checkpoints" / "last.ckpt", reference / "checkpoints" / "last.ckpt")
