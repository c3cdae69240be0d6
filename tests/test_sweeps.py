"""Sweeps (`python train.py -m optim.lr=1e-3,3e-3`) and searches (`-m hparams_search=optuna`): every swept
value checked before the first job, the summary that names the best job, a job that fails recorded while the
sweep goes on, a stopped sweep continued in its folder (-m resume=SWEEP) each job from where it stood, what
cannot be continued refused in one line, one process per sweep folder, a search on the project's own sweeper
whose study a storage keeps, and a SLURM_JOB job's sweep continued when the job is requeued.

Every command runs in this process (train_here): Hydra's launcher runs the jobs one after another in it, as in
a process of train.py. A signal that stops a sweep is sent by tests/faults as a job's step begins."""

from __future__ import annotations

import csv
import fcntl
import json
import os
import shlex
import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from shell.sweeps import SEARCH_OF_TRIAL, how_to_continue
from tests.common import (
    ROOT,
    SLURM_JOB,
    TINY_OVERRIDES,
    assert_bit_equal,
    printed_after,
    refused,
    snapshot,
    train_as_printed,
    train_here,
)

JOSE = "josé, a=b"  # the quick start in /home/josé, a=b/...: an accent, a comma and =
ODD = "it's [1] {x} (y) $HOME ü日, a=b \\ end "  # a quote, brackets, $, a backslash, a space at its end
SEARCH = ["-m", "hparams_search=optuna", "hydra.sweeper.storage=sqlite:///search.db"]


def sweep_args(small_text: Path, *extra: str) -> list[str]:
    """A job of the sweeps here: 6 steps, validated after steps 3 and 6, a checkpoint every 2 (all kept)."""
    return [*TINY_OVERRIDES, f"data.path={small_text}", "checkpoint.every_n_steps=2", "checkpoint.keep=20", *extra]


def search_args(small_text: Path, *extra: str) -> list[str]:
    """A search's trial: the tiny run, its steps the limit, not the search's time budget."""
    return [*TINY_OVERRIDES, f"data.path={small_text}", "trainer.max_time=null", "optim.warmup_steps=0", *extra]


@pytest.fixture(scope="module")
def job_reference(tmp_path_factory, small_text) -> Path:
    """A run of the sweeps' settings with trainer.max_steps=10, never stopped: a job of the same settings ends
    bit for bit as it, however often it was stopped and continued."""
    run = tmp_path_factory.mktemp("reference") / "run"
    ran = train_here(*sweep_args(small_text, "trainer.max_steps=10"), f"hydra.run.dir={run}", cwd=run.parent)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory, small_text) -> tuple[Path, str]:
    """A sweep of two learning rates that ran to its end, and what it logged; tests change copies of it."""
    sweep = tmp_path_factory.mktemp("finished") / "sweep"
    ran = train_here("-m", *sweep_args(small_text), "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}", cwd=sweep.parent)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return sweep, ran.stdout + ran.stderr


def rows_of(sweep: Path, *columns: str) -> list[tuple[str, ...]]:
    with open(sweep / "summary.csv", newline="") as file:
        return [tuple(row[c] for c in columns) for row in csv.DictReader(file)]


def kept_as_it_was(job: Path) -> dict:
    """What a finished job of a continued sweep keeps as it was: all but Hydra's record of the command (written
    again), its lock and its log (which says it was kept)."""
    return {k: v for k, v in snapshot(job).items() if "/.hydra" not in k and not k.endswith(("/.lock", "train.log"))}


# ---- a sweep's start: every value checked, a folder of its own -------------------------------------------------


def test_every_swept_value_is_checked_before_the_first_job(small_text, tmp_path):
    args = ["-m", *sweep_args(small_text)]
    assert refused(*args, "optim.lr=1e-3,-1") == "optim.lr=1e-3,-1: optim.lr must be above 0, got -1"
    assert refused(*args, "optim.lr=interval(1e-3,1e-2)").startswith(
        "optim.lr=interval(1e-3,1e-2) is a range to search, which only a search samples: add hparams_search=optuna"
    )
    assert refused(*args, "trainer.max_steps=range(5,1)").startswith(
        "trainer.max_steps=range(5,1) gives no values to sweep"
    )
    assert "hydra.sweep.subdir=a,b" in refused(*args, "hydra.sweep.subdir=a,b")  # (Hydra's own refusal)
    several = train_here(*args, "optim.lr=1e-3,-1", "model.n_layer=2,0")  # each problem in a line of its own
    assert several.returncode == 1 and "Traceback" not in several.stderr
    assert several.stderr.strip().splitlines() == [
        "error: optim.lr=1e-3,-1: optim.lr must be above 0, got -1",
        "error: model.n_layer=2,0: model.n_layer must be a whole number of at least 1, got 0",
    ]
    assert not any(tmp_path.iterdir())  # no sweep folder: no job ran


@pytest.mark.slow
def test_a_sweep_summarizes_its_jobs_and_names_the_best(finished_sweep):
    sweep, said = finished_sweep
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    summary = json.loads((sweep / "summary.json").read_text())
    bpcs = {Path(r["run_dir"]).name: r["metrics"]["val/bpc"] for r in summary["runs"]}
    best = min(bpcs, key=bpcs.get)
    assert summary["best"]["run"] == best and summary["best"]["val/bpc"] == min(bpcs.values())
    with open(sweep / "summary.csv", newline="") as file:
        header = next(csv.reader(file))
    assert header == ["run", "optim.lr", "val/bpc", "val/loss", "val/perplexity", "train/loss", "finished", "best"]
    assert rows_of(sweep, "run", "optim.lr", "finished", "best") == [
        ("0", "0.001", "true", "*" if best == "0" else ""),
        ("1", "0.003", "true", "*" if best == "1" else ""),
    ]
    assert f"sweep summary: {sweep / 'summary.csv'}" in said
    assert "  0  optim.lr=0.001  val/bpc " in said and "  1  optim.lr=0.003  val/bpc " in said
    lr = "0.001" if best == "0" else "0.003"
    assert f"best: {best} (optim.lr={lr}), val/bpc {bpcs[best]:.4f}" in said


@pytest.mark.slow
def test_a_sweep_records_its_diverged_jobs_and_goes_on_and_fails_when_none_finished(small_text, tmp_path):
    sweep = tmp_path / "sweep"
    extra = ("optim.max_nonfinite_in_a_row=3", "checkpoint.every_n_steps=50", f"hydra.sweep.dir={sweep}")
    ran = train_here(
        "-m", *sweep_args(small_text, *extra), "optim.lr=1e-3,2e-3", env={"TINYGPT2_FAILPOINT": "nan:1-10"}
    )
    assert ran.returncode == 1 and "Traceback" not in ran.stderr  # a script's `&& next step` stops here
    assert "no job of the sweep finished" in ran.stdout + ran.stderr
    rows = rows_of(sweep, "optim.lr", "best", "finished")  # both jobs ran, each recorded with its error
    assert [row[:2] for row in rows] == [("0.001", ""), ("0.002", "")]
    assert all(row[2].startswith("training diverged: 3 steps in a row") for row in rows), rows


# ---- a stopped sweep, continued ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_sweep_stopped_by_ctrl_c_and_its_job_continued_as_printed(small_text, tmp_path):
    args = ["-m", *sweep_args(small_text), "optim.lr=1e-3,3e-3"]
    stopped = train_here(*args, env={"TINYGPT2_FAILPOINT": "sigint:4"})
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 130, said[-3000:]  # a stopped sweep is not a finished one
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert not (sweep / "1").exists()  # the sweep stopped with the job under way
    assert rows_of(sweep, "run", "optim.lr", "finished", "best") == [("0", "0.001", "false", "")]
    job = printed_after("Continue with: ", said)
    assert job == f"python {ROOT / 'train.py'} resume={sweep / '0'}"
    rest = printed_after("the rest, with: ", said)
    assert rest == f"python {ROOT / 'train.py'} -m resume={sweep}"

    resumed = train_as_printed(job + " trainer.max_steps=8", tmp_path)  # the job alone, given more steps
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rows_of(sweep, "run", "optim.lr", "finished", "best", "resumed with") == [
        ("0", "0.001", "true", "*", "trainer.max_steps=8")  # brought up to date by the continued job
    ]
    result = json.loads((sweep / "0" / "result.json").read_text())
    assert "optim.lr=0.001" in result["overrides"] and "trainer.max_steps=8" not in result["overrides"]
    assert any(o.startswith("resume=") for o in result["resumed_with"])

    kept = kept_as_it_was(sweep / "0")
    continued = train_as_printed(rest, tmp_path)
    said = continued.stdout + continued.stderr
    assert continued.returncode == 0, said[-3000:]
    assert "job 0 finished before (" in said and "; kept as it is" in said
    assert kept_as_it_was(sweep / "0") == kept
    assert rows_of(sweep, "run", "optim.lr", "trainer.max_steps", "finished", "resumed with") == [
        ("0", "0.001", "8", "true", "trainer.max_steps=8"),
        ("1", "0.003", "6", "true", ""),  # the job that never ran has run
    ]
    best = json.loads((sweep / "summary.json").read_text())["best"]["run"]
    described = {"0": "optim.lr=0.001 trainer.max_steps=8", "1": "optim.lr=0.003 trainer.max_steps=6"}
    assert "  0  optim.lr=0.001 trainer.max_steps=8  val/bpc" in said and f"best: {best} ({described[best]})" in said


@pytest.mark.slow
def test_a_stopped_sweep_continues_in_its_folder_each_job_from_where_it_stood(small_text, job_reference, tmp_path):
    """-m resume=SWEEP: a job that finished is kept, the stopped one continues from its checkpoint (ending bit
    for bit as a run never stopped), the one that never ran runs; from any folder, in the folder it began in."""
    lengths = "trainer.max_steps=6,10,14"  # job 0 finishes before step 7, job 1 is stopped at it, job 2 waits
    stopped = train_here("-m", *sweep_args(small_text), lengths, env={"TINYGPT2_FAILPOINT": "sigint:7"})
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    kept = kept_as_it_was(sweep / "0")

    elsewhere = tmp_path / "elsewhere"  # continued from another folder, it runs where it was started
    elsewhere.mkdir()
    continued = train_here("-m", f"resume={sweep}", cwd=elsewhere)
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert kept_as_it_was(sweep / "0") == kept
    assert_bit_equal(sweep / "1" / "checkpoints" / "last.ckpt", job_reference / "checkpoints" / "last.ckpt")
    assert rows_of(sweep, "run", "trainer.max_steps", "finished") == [
        ("0", "6", "true"), ("1", "10", "true"), ("2", "14", "true"),
    ]  # fmt: skip
    assert not any(elsewhere.iterdir())


@pytest.mark.slow
def test_a_continued_sweep_takes_no_settings_of_its_own_and_what_cannot_continue_is_refused(finished_sweep, tmp_path):
    """A setting beside -m resume=SWEEP (a job continues with settings of its own alone), a job's folder for the
    sweep's, a sweep whose folder of origin is gone, a record cut short, resume=auto, a folder that is not there:
    each in one line, nothing made."""
    sweep = tmp_path / "sweep"
    shutil.copytree(finished_sweep[0], sweep, symlinks=True)
    here = tmp_path / "here"
    here.mkdir()
    assert refused("-m", f"resume={sweep}", "optim.lr=1", cwd=here).startswith(
        f"-m resume={sweep} continues the sweep with its own command line; leave out optim.lr=1"
    )
    assert refused("-m", f"resume={sweep / '1'}", cwd=here).startswith(
        f"resume={sweep / '1'} is a run, not a sweep: continue it without -m"
    )
    assert refused("-m", "resume=auto", cwd=here).startswith("resume=auto continues one run: run it without -m")
    assert refused("-m", f"resume={tmp_path / 'nothing'}", cwd=here).startswith(
        f"resume={tmp_path / 'nothing'} does not exist; with -m, resume= continues a sweep"
    )
    record = (sweep / "multirun.yaml").read_text()
    started_in = str(finished_sweep[0].parent)
    (sweep / "multirun.yaml").write_text(record.replace(f"cwd: {started_in}\n", f"cwd: {tmp_path / 'gone'}\n"))
    assert refused("-m", f"resume={sweep}", cwd=here).startswith(
        f"the sweep {sweep} was started in {tmp_path / 'gone'}, which is gone"
    )
    (sweep / "multirun.yaml").write_text("hydra:\n  overrides: [")  # a record cut short
    assert refused("-m", f"resume={sweep}", cwd=here).startswith(
        f"resume={sweep}: {sweep / 'multirun.yaml'} cannot be read"
    )


@pytest.mark.slow
def test_a_finished_sweep_continued_keeps_every_job_as_it_is(finished_sweep, tmp_path):
    sweep = tmp_path / "sweep"
    shutil.copytree(finished_sweep[0], sweep, symlinks=True)
    kept = {job: kept_as_it_was(sweep / job) for job in ("0", "1")}
    continued = train_here("-m", f"resume={sweep}", cwd=tmp_path)
    said = continued.stdout + continued.stderr
    assert continued.returncode == 0, said[-3000:]
    for job in ("0", "1"):
        assert f"job {job} finished before (train/loss " in said
        assert kept_as_it_was(sweep / job) == kept[job]
    assert rows_of(sweep, "run", "finished") == [("0", "true"), ("1", "true")]


@pytest.mark.slow
def test_a_finished_sweep_with_named_job_folders_is_finished_too(small_text, tmp_path):
    """With hydra.sweep.subdir naming each job's folder, -m resume= of a sweep whose every job finished finds
    each job finished, as a numbered one."""
    subdir = "hydra.sweep.subdir=lr${optim.lr}"
    ran = train_here("-m", *sweep_args(small_text), "optim.lr=1e-3,2e-3", subdir)
    assert ran.returncode == 0, ran.stderr[-3000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "lr0.001",
        "lr0.002",
    ]
    continued = train_here("-m", f"resume={sweep}")
    said = continued.stdout + continued.stderr
    assert continued.returncode == 0, said[-3000:]
    assert "job lr0.001 finished before (" in said and "job lr0.002 finished before (" in said
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "lr0.001",
        "lr0.002",
    ]


@pytest.mark.slow
def test_a_sweep_runs_from_a_folder_named_jose_a_b(small_text, tmp_path):
    """The quick start's sweep in /home/josé, a=b/...: the sweep folder under it, named as Hydra's grammar reads
    it (it was refused as a command line Hydra could not read, and its folder left behind)."""
    here = tmp_path / JOSE
    here.mkdir()
    ran = train_here("-m", *sweep_args(small_text, "trainer.max_steps=2"), "optim.lr=1e-3,2e-3", cwd=here)
    assert ran.returncode == 0, ran.stderr[-3000:]
    (sweep,) = here.glob("multirun/*/*")
    assert rows_of(sweep, "run", "finished") == [("0", "true"), ("1", "true")]


@pytest.mark.slow
def test_a_sweep_into_such_a_folder_continues_as_printed(small_text, tmp_path):
    here = tmp_path / JOSE
    here.mkdir()
    args = ["-m", *sweep_args(small_text), "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={ODD}"]  # relative to here
    stopped = train_here(*args, cwd=here, env={"TINYGPT2_FAILPOINT": "sigint:4"})  # job 0 stopped at step 4
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    sweep = here / ODD
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"]
    command = printed_after("this job and the rest, with: ", stopped.stdout + stopped.stderr)
    assert shlex.split(command)[-2:] == ["-m", f"resume={sweep}"]
    continued = train_as_printed(command, tmp_path)  # from another folder: it runs where the sweep was started
    assert continued.returncode == 0, continued.stderr[-3000:]
    assert rows_of(sweep, "run", "optim.lr", "finished") == [("0", "0.001", "true"), ("1", "0.002", "true")]
    assert sorted(p.name for p in here.iterdir()) == [ODD]


# ---- one process per sweep folder ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_sweep_into_the_folder_of_one_under_way_is_refused(
    finished_sweep, small_text, held_elsewhere, tmp_path
):
    hold, _ = held_elsewhere
    sweep = tmp_path / "shared"
    shutil.copytree(finished_sweep[0], sweep, symlinks=True)
    pid = hold(sweep)  # as the process running it holds it
    summary = (sweep / "summary.csv").read_bytes()
    here = tmp_path / "here"
    here.mkdir()
    second = refused("-m", *sweep_args(small_text), "optim.lr=5e-3,6e-3", f"hydra.sweep.dir={sweep}", cwd=here)
    assert second.startswith(f"hydra.sweep.dir={sweep} is the folder of a sweep under way (process {pid} ")
    continued = refused("-m", f"resume={sweep}", cwd=here)  # nor continued while it runs, whatever the command line
    assert continued.startswith(f"the sweep {sweep} is under way (process {pid} ")
    assert (sweep / "summary.csv").read_bytes() == summary  # nothing of the second's


# ---- searches -------------------------------------------------------------------------------------------------------


def study_in(folder: Path):
    import optuna

    return optuna.load_study(study_name="tinygpt2", storage=f"sqlite:///{folder / 'search.db'}")


def test_a_search_runs_on_the_projects_sweeper_and_a_current_optuna():
    """The sweeper Hydra chooses for hparams_search=optuna is the project's (hydra-optuna-sweeper, which
    named its sweeper alike, pinned optuna below 3 and SQLAlchemy below 2)."""
    import optuna
    import sqlalchemy
    from hydra import compose, initialize_config_dir

    assert int(optuna.__version__.split(".")[0]) >= 4 and int(sqlalchemy.__version__.split(".")[0]) >= 2
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        sweeper = compose("train", overrides=["hparams_search=optuna"], return_hydra_config=True).hydra.sweeper
    assert sweeper["_target_"] == "hydra_plugins.tinygpt2_optuna.optuna_sweeper.OptunaSweeper"
    assert OmegaConf.to_container(sweeper["sampler"]) == {"_target_": "optuna.samplers.TPESampler", "seed": 1337}
    assert sweeper["study_name"] == "tinygpt2"


def test_the_search_space_reads_hydras_sweep_syntax():
    """choice, range, interval and tag(log, ...) as Optuna's distributions; a later override of a key
    replaces an earlier one (the command line's the config's), and a value given fixes its setting."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from hydra_plugins.tinygpt2_optuna.optuna_sweeper import search_space

    space, fixed = search_space(
        [
            "optim=choice(adamw, muon)",
            "optim.lr=tag(log, interval(1e-3, 1e-2))",
            "model.n_layer=choice(2, 3, 4)",
            "data.batch_size=range(8, 40, 8)",
            "trainer.max_steps=tag(log, range(1, 9))",
            "model.dropout=interval(0.0, 0.15)",
            "model.n_layer=4",  # given on the command line: fixed, out of the search
            "optim.weight_decay=0.0,0.1",  # a command line's sweep joins the search
            "data.path=input.txt",
        ]
    )
    assert space == {
        "optim": CategoricalDistribution(["adamw", "muon"]),
        "optim.lr": FloatDistribution(1e-3, 1e-2, log=True),
        "data.batch_size": IntDistribution(8, 32, step=8),
        "trainer.max_steps": IntDistribution(1, 8, log=True),
        "model.dropout": FloatDistribution(0.0, 0.15),
        "optim.weight_decay": CategoricalDistribution([0.0, 0.1]),
    }
    assert fixed == ["model.n_layer=4", "data.path=input.txt"]


@pytest.fixture(scope="module")
def search(tmp_path_factory, small_text) -> tuple[Path, str]:
    """A search of three trials, its study kept in search.db beside it, and what it logged."""
    where = tmp_path_factory.mktemp("search")
    ran = train_here(
        *SEARCH, "hydra.sweeper.n_trials=3", *search_args(small_text, "trainer.max_steps=range(4,7)"), cwd=where
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    (sweep,) = where.glob("multirun/*/*")
    return sweep, ran.stdout + ran.stderr


@pytest.mark.slow
def test_a_search_of_three_trials_ends_with_its_summary_and_its_best(search):
    """Each trial a run folder of the sweep, its settings drawn from the space (with the command line's sweep of
    trainer.max_steps), the study told each trial's final val/bpc; summary.csv names the best."""
    sweep, said = search
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2"]
    with open(sweep / "summary.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    bpcs = [float(row["val/bpc"]) for row in rows]
    assert len(rows) == 3 and [row["best"] for row in rows].count("*") == 1
    assert float(next(row for row in rows if row["best"] == "*")["val/bpc"]) == min(bpcs)
    searched = set(yaml.safe_load((ROOT / "configs" / "hparams_search" / "optuna.yaml").read_text())["hydra"]["sweeper"]["params"])  # fmt: skip
    fixed = {o.split("=")[0] for o in TINY_OVERRIDES} | {"optim.warmup_steps"}  # given: they leave the search
    assert searched - fixed <= set(rows[0]) and not searched & fixed & set(rows[0])  # each searched one, varied or not
    assert "trainer.max_steps" in rows[0]
    assert "best: " in said and f"sweep summary: {sweep / 'summary.csv'}" in said

    trials = study_in(sweep.parent.parent.parent).trials
    assert [trial.state.name for trial in trials] == ["COMPLETE"] * 3
    assert [trial.value for trial in trials] == pytest.approx(bpcs)  # what each job returned
    runs = json.loads((sweep / "summary.json").read_text())["runs"]
    for trial, run in zip(trials, runs, strict=True):
        assert trial.params["trainer.max_steps"] in (4, 5, 6)
        assert run["config"]["trainer"]["max_steps"] == trial.params["trainer.max_steps"]
        assert run["config"]["optim"]["lr"] == pytest.approx(trial.params["optim.lr"])
    assert len({run["config"]["optim"]["lr"] for run in runs}) == 3  # the search varied the learning rate
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(bpcs))


@pytest.mark.slow
def test_a_search_is_not_continued_in_its_folder_but_by_its_storage(search, tmp_path):
    sweep, _ = search
    (tmp_path / "here").mkdir()
    assert refused("-m", f"resume={sweep}", cwd=tmp_path / "here").startswith(
        f"resume={sweep} is a search, which is not continued in its folder: run it again with the same "
        "hydra.sweeper.storage (sqlite:///search.db) to add trials to its study"
    )
    assert how_to_continue(sweep).startswith(f"the search's trials so far are in {sweep / 'summary.csv'}")


@pytest.mark.slow
def test_a_search_run_again_with_its_storage_adds_trials_to_its_study(search, small_text, tmp_path):
    """The same study_name and storage continue the study: the second search adds its trial after the first's,
    its sampler seeded past them (with the first's seed it proposed the same settings again)."""
    sweep, _ = search
    shutil.copy(sweep.parent.parent.parent / "search.db", tmp_path / "search.db")
    again = train_here(*SEARCH, "hydra.sweeper.n_trials=1", *search_args(small_text, "trainer.max_steps=2"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Optuna study tinygpt2 (sqlite:///search.db) holds 3 trials; this search adds 1" in again.stdout
    trials = study_in(tmp_path).trials
    assert [trial.state.name for trial in trials] == ["COMPLETE"] * 4
    tried = [tuple(sorted((k, v) for k, v in trial.params.items() if k != "trainer.max_steps")) for trial in trials]
    assert len(set(tried)) == 4
    (added,) = tmp_path.glob("multirun/*/*")
    assert rows_of(added, "run", "finished") == [("0", "true")]


@pytest.mark.slow
def test_a_trial_a_killed_search_left_running_is_failed_by_the_next_search_on_its_study(
    small_text, held_elsewhere, tmp_path
):
    """A kill gives a search no chance to end its trial under way, which the stored study held as running for
    ever; the next search on the study marks it failed, and says so. A trial of a search still under way (its
    folder locked by the process running it) is left as it is."""
    import optuna

    hold, _ = held_elsewhere
    killed, running = tmp_path / "multirun" / "killed", tmp_path / "multirun" / "running"
    killed.mkdir(parents=True)
    running.mkdir(parents=True)
    hold(running)
    study = optuna.create_study(study_name="tinygpt2", storage="sqlite:///search.db", direction="minimize")
    for search in (killed, running):  # as the project's sweeper marks each trial it asks for
        study.ask().set_user_attr(SEARCH_OF_TRIAL, str(search))
    later = train_here(*SEARCH, "hydra.sweeper.n_trials=1", *search_args(small_text, "trainer.max_steps=2"))
    assert later.returncode == 0, later.stderr[-3000:]
    assert (
        f"trial 0 of the study tinygpt2 was left running by a search that was killed ({killed}); it is marked failed"
        in later.stderr
    )
    assert "trial 1 " not in later.stderr
    assert [trial.state.name for trial in study_in(tmp_path).trials] == ["FAIL", "RUNNING", "COMPLETE"]


@pytest.mark.slow
def test_a_search_stopped_by_ctrl_c_leaves_no_trial_running_in_its_stored_study(small_text, tmp_path):
    """The trial Ctrl-C stops is failed in the study, as Optuna's optimize() fails one; left running, it
    stayed so in every later search that continues the study."""
    stopped = train_here(*SEARCH, "hydra.sweeper.n_trials=2", *search_args(small_text), env={"TINYGPT2_FAILPOINT": "sigint:3"})  # fmt: skip
    said = stopped.stdout + stopped.stderr
    assert stopped.returncode == 130 and "the sweep stops here" in said, said[-3000:]
    later = train_here(*SEARCH, "hydra.sweeper.n_trials=1", *search_args(small_text, "trainer.max_steps=2"))
    assert later.returncode == 0, later.stderr[-3000:]
    assert [trial.state.name for trial in study_in(tmp_path).trials] == ["FAIL", "COMPLETE"]


@pytest.mark.slow
def test_a_search_with_its_study_in_memory_is_not_told_to_reuse_a_storage_it_has_not(small_text, tmp_path):
    """The default search keeps its study in memory: what it says at a stop (and to resume=) names the
    storage that keeps one, not "the same hydra.sweeper.storage", which was null."""
    ran = train_here("-m", "hparams_search=optuna", "hydra.sweeper.n_trials=1", *search_args(small_text))
    assert ran.returncode == 0, ran.stderr[-3000:]
    (sweep,) = tmp_path.glob("multirun/*/*")
    (tmp_path / "here").mkdir()
    assert refused("-m", f"resume={sweep}", cwd=tmp_path / "here").startswith(
        f"resume={sweep} is a search, which is not continued in its folder: its study was kept in memory "
        "(hydra.sweeper.storage=null) and ended with it; run it again with hydra.sweeper.storage=sqlite:///search.db"
    )
    assert "its study was kept in memory" in how_to_continue(sweep)  # said at a Ctrl-C


def test_two_searches_started_together_on_a_new_storage_take_turns_opening_it(tmp_path):
    """Two searches that opened one new SQLite storage at once each made the database's tables, and the second
    failed (UNIQUE constraint failed: alembic_version): a search opens it holding a lock on its folder, so that
    one waits while another (here the test) holds it, and two at once both open it."""
    import optuna

    from shell.sweeps import open_study_storage

    sweeper = OmegaConf.create({"storage": f"sqlite:///{tmp_path / 'search.db'}", "study_name": "tinygpt2"})
    held = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    waiting = threading.Thread(target=open_study_storage, args=(sweeper,))
    waiting.start()
    time.sleep(1)
    assert waiting.is_alive() and not (tmp_path / "search.db").exists()
    os.close(held)
    waiting.join(60)
    assert not waiting.is_alive() and (tmp_path / "search.db").is_file()

    (tmp_path / "search.db").unlink()
    failed = []

    def search() -> None:
        try:
            open_study_storage(sweeper)
        except Exception as err:  # what the test reports
            failed.append(err)

    both = [threading.Thread(target=search) for _ in range(2)]
    for thread in both:
        thread.start()
    for thread in both:
        thread.join(60)
    assert failed == []
    optuna.create_study(study_name="tinygpt2", storage=sweeper.storage)  # the storage is whole


# ---- a SLURM_JOB job's sweep, requeued -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_requeued_slurm_sweep_continues_in_its_folder(small_text, job_reference, tmp_path):
    """A SLURM_JOB job running a sweep, stopped and requeued, runs its command again: the sweep continues as -m
    resume=SWEEP would continue it, where a new launch of the same job id is refused."""
    args = ["-m", *sweep_args(small_text), "trainer.max_steps=6,10,14"]
    stopped = train_here(*args, env={**SLURM_JOB, "TINYGPT2_FAILPOINT": "sigint:7"})
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    sweep = tmp_path / "multirun" / "slurm-4242"
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]
    kept = kept_as_it_was(sweep / "0")

    assert "already holds a sweep" in refused(*args, env=SLURM_JOB)  # not a requeue

    requeue = {**SLURM_JOB, "SLURM_RESTART_COUNT": "1"}
    requeued = train_here(*args, env=requeue)
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert f"this job was restarted by its scheduler: continuing the sweep {sweep}" in requeued.stderr
    assert kept_as_it_was(sweep / "0") == kept
    assert_bit_equal(sweep / "1" / "checkpoints" / "last.ckpt", job_reference / "checkpoints" / "last.ckpt")
    assert rows_of(sweep, "run", "finished") == [("0", "true"), ("1", "true"), ("2", "true")]
    with open(sweep / "summary.csv", newline="") as file:
        assert "resumed with" not in next(csv.reader(file))  # continued with the sweep's own settings, none changed

    ended = {job: kept_as_it_was(sweep / job) for job in ("0", "1", "2")}
    again = train_here(*args, env={**requeue, "SLURM_RESTART_COUNT": "2"})  # requeued once more as it ended
    said = again.stdout + again.stderr
    assert again.returncode == 0, said[-3000:]
    assert all(f"job {job} finished before (" in said for job in ("0", "1", "2"))
    assert {job: kept_as_it_was(sweep / job) for job in ("0", "1", "2")} == ended


@pytest.mark.slow
def test_a_requeued_slurm_search_ends_if_it_had_ended_and_is_refused_in_one_line_if_not(small_text, tmp_path):
    """A SLURM_JOB job running an Optuna search, requeued: the search is not continued in its folder (its storage
    continues it), so a search stopped part way is refused in one line, and one that had ended when the job
    was requeued exits 0, as a finished sweep does."""
    args = ["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=1", *search_args(small_text)]
    stopped_job = {**SLURM_JOB, "SLURM_JOB_ID": "4343"}
    stopped = train_here(*args, env={**stopped_job, "TINYGPT2_FAILPOINT": "sigint:3"})
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert (tmp_path / "multirun" / "slurm-4343" / "multirun.yaml").is_file()
    assert refused(*args, env={**stopped_job, "SLURM_RESTART_COUNT": "1"}).startswith(
        "this job was restarted by its scheduler, and its sweep cannot continue: the sweep folder multirun/slurm-4343 "
        "is a search, which is not continued in its folder"  # (the folder as the job names it, from where it runs)
    )

    ended = train_here(*args, env=SLURM_JOB)
    assert ended.returncode == 0, ended.stderr[-3000:]
    sweep = tmp_path / "multirun" / "slurm-4242"
    before = snapshot(sweep, itself=False)
    requeued = train_here(*args, env={**SLURM_JOB, "SLURM_RESTART_COUNT": "1"})
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert requeued.stdout == (
        f"this job was restarted by its scheduler, and its search had ended: {sweep / 'optimization_results.yaml'}\n"
    )
    assert snapshot(sweep, itself=False) == before
