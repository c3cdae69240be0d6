"""`python train.py -m hparams_search=optuna`, on the project's own sweeper (hydra_plugins/tinygpt2_optuna)
and a current Optuna: the search space read from Hydra's sweep syntax, a search that ends with its
summary and its best trial, a study kept in a storage that a later search adds trials to, and a trial a
kill left running that the next search on the study marks failed."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.common import TINY_OVERRIDES, run_script, start_script

SEARCH = ["-m", "hparams_search=optuna", "hydra.sweeper.storage=sqlite:///search.db"]


def study_of(folder: Path):
    import optuna

    return optuna.load_study(study_name="tinygpt2", storage=f"sqlite:///{folder / 'search.db'}")


def test_a_search_runs_on_the_projects_sweeper_and_a_current_optuna():
    """The sweeper Hydra chooses for hparams_search=optuna is the project's (hydra-optuna-sweeper, which
    named its sweeper alike, pinned optuna below 3 and SQLAlchemy below 2)."""
    import optuna
    import sqlalchemy

    from shell.command_line import Composer

    assert int(optuna.__version__.split(".")[0]) >= 4 and int(sqlalchemy.__version__.split(".")[0]) >= 2
    with Composer() as composer:
        sweeper = composer.compose(["hparams_search=optuna"], with_hydra=True)["hydra"]["sweeper"]
    assert sweeper["_target_"] == "hydra_plugins.tinygpt2_optuna.optuna_sweeper.OptunaSweeper"
    assert sweeper["sampler"] == {"_target_": "optuna.samplers.TPESampler", "seed": 1337}


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


@pytest.mark.slow
def test_a_search_of_three_trials_ends_with_its_summary_and_its_best(small_text, tmp_path):
    """Each trial a run folder of the sweep, its settings drawn from the space (with the command line's
    sweep of trainer.max_steps), the study told each trial's final val/bpc; summary.csv names the best."""
    proc = run_script(
        "train.py",
        *SEARCH,
        "hydra.sweeper.n_trials=3",
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "trainer.max_time=null",
        "trainer.max_steps=range(4,7)",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2"]
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    bpcs = [float(row["val/bpc"]) for row in rows]
    assert len(rows) == 3 and [row["best"] for row in rows].count("*") == 1
    assert float(next(row for row in rows if row["best"] == "*")["val/bpc"]) == min(bpcs)
    assert {"optim", "optim.lr", "optim.weight_decay", "model.dropout", "trainer.max_steps"} <= set(rows[0])
    assert "best: " in proc.stdout and f"sweep summary: {sweep / 'summary.csv'}" in proc.stdout

    trials = study_of(tmp_path).trials
    assert [trial.state.name for trial in trials] == ["COMPLETE"] * 3
    assert [trial.value for trial in trials] == pytest.approx(bpcs)  # what each job returned
    runs = json.loads((sweep / "summary.json").read_text())["runs"]
    for trial, run in zip(trials, runs, strict=True):
        assert trial.params["trainer.max_steps"] in (4, 5, 6)
        assert run["config"]["trainer"]["max_steps"] == trial.params["trainer.max_steps"]
        assert run["config"]["optim"]["lr"] == pytest.approx(trial.params["optim.lr"])
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(bpcs))


@pytest.mark.slow
def test_a_search_run_again_with_its_storage_adds_trials_to_its_study(small_text, tmp_path):
    """The same study_name and storage continue the study: the second search adds its trial after the
    first's, its sampler seeded past them (with the first's seed it proposed the same settings again)."""
    search = [*SEARCH, "hydra.sweeper.n_trials=1", *TINY_OVERRIDES, f"data.path={small_text}"]
    search += ["trainer.max_time=null", "trainer.max_steps=2", "optim.warmup_steps=0"]
    first = run_script("train.py", *search, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_script("train.py", *search, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Optuna study tinygpt2 (sqlite:///search.db) holds 1 trial; this search adds 1" in again.stdout

    trials = study_of(tmp_path).trials
    assert [trial.state.name for trial in trials] == ["COMPLETE", "COMPLETE"]
    assert trials[0].params != trials[1].params
    sweeps = sorted((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 2 and all(len(list(csv.DictReader(open(s / "summary.csv")))) == 1 for s in sweeps)


@pytest.mark.slow
def test_a_trial_killed_mid_run_is_marked_failed_when_its_study_is_continued(small_text, tmp_path):
    """A kill leaves the search no chance to tell its trial under way how it ended: the next search on
    the study tells it failed, says so, and adds its own trial."""
    search = [*SEARCH, *TINY_OVERRIDES, f"data.path={small_text}", "trainer.max_time=null", "optim.warmup_steps=0"]
    killed = start_script(
        "train.py", *search, "hydra.sweeper.n_trials=2", cwd=tmp_path, failpoint="kill:2", stderr=subprocess.PIPE
    )
    killed.communicate(timeout=600)
    assert killed.returncode == -9
    assert [trial.state.name for trial in study_of(tmp_path).trials] == ["RUNNING"]
    (sweep,) = (tmp_path / "multirun").glob("*/*")

    later = run_script("train.py", *search, "hydra.sweeper.n_trials=1", cwd=tmp_path)
    assert later.returncode == 0, later.stderr[-3000:]
    assert (
        f"trial 0 of the study tinygpt2 was left running by a search that was killed ({sweep}); it is marked failed"
        in later.stderr
    )
    assert [trial.state.name for trial in study_of(tmp_path).trials] == ["FAIL", "COMPLETE"]
