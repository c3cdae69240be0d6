"""Folder names: train.py run from a folder whose name has letters beyond ASCII, a comma or = (the quick
start in /home/josé/...), given such a folder as runs_root, hydra.run.dir, hydra.sweep.dir or resume=, and
the commands it prints for them pasted into bash as they are. A start that is refused leaves nothing."""

from __future__ import annotations

import csv
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.common import TINY_OVERRIDES, one_error_line, run_script, runs_under, script_environment

JOSE = "josé, a=b"  # the folder: an accent, a comma and =
ODD = "it's [1] {x} (y) $HOME ü日, a=b \\ end "  # a quote, brackets, $, a backslash, a space at its end


def run_args_in(small_text: Path, *extra: str) -> list[str]:
    return [*TINY_OVERRIDES, f"data.path={small_text}", "checkpoint.every_n_steps=2", *extra]


def said(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def printed_after(marker: str, proc: subprocess.CompletedProcess) -> str:
    """The one command a run printed after marker (e.g. "Continue with: ")."""
    (line,) = [line for line in said(proc).splitlines() if marker in line]
    return line.split(marker, 1)[1]


def paste(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A printed command pasted into bash as it is, `python` being this interpreter."""
    python = f'python() {{ {shlex.quote(sys.executable)} "$@"; }}\n'
    return subprocess.run(
        ["bash", "-c", python + command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=script_environment(None, None),
    )


def result(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


@pytest.mark.slow
def test_the_quick_start_runs_in_a_folder_named_jose_a_b_and_continues_as_printed(small_text, tmp_path):
    here = tmp_path / JOSE
    here.mkdir()
    stopped = run_script("train.py", *run_args_in(small_text), cwd=here, failpoint="sigint:4")  # Ctrl-C at step 4
    assert stopped.returncode == 130, said(stopped)[-3000:]
    (run,) = runs_under(here / "outputs")
    command = printed_after("Continue with: ", stopped)
    assert f"resume={run}" in shlex.split(command)
    resumed = paste(command, here)
    assert resumed.returncode == 0, said(resumed)[-3000:]
    assert "Traceback" not in said(resumed)
    assert runs_under(here / "outputs") == [run] and result(run)["finished"]
    assert sorted(p.name for p in here.iterdir()) == ["outputs"]


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["runs_root", "hydra.run.dir"])
def test_a_run_goes_into_any_folder_typed_and_resume_auto_says_it_starts_a_new_run(setting, small_text, tmp_path):
    """runs_root=/tmp/ü日..., hydra.run.dir=... typed as the shell passes them (no quotes of Hydra's); with
    resume=auto and nothing to continue there, one line says what was looked for and that a new run starts."""
    place = tmp_path / ODD / "runs"
    args = run_args_in(small_text)
    if setting == "runs_root":
        args = [a for a in args if not a.startswith("latest_link=")]  # ${runs_root}/latest, in that folder too
    proc = run_script("train.py", *args, f"{setting}={place}", "resume=auto", cwd=tmp_path)
    assert proc.returncode == 0, said(proc)[-3000:]
    assert "Traceback" not in said(proc)
    (run,) = runs_under(place) if setting == "runs_root" else [place]
    assert result(run)["finished"] and result(run)["run_dir"] == str(run)
    if setting == "runs_root":
        assert (place / "latest").resolve() == run
        line = f"resume=auto: no unfinished run under {place} has these settings; starting a new run in {run}"
    else:
        line = f"resume=auto: {run} holds no checkpoint to continue from; starting a new run there"
    assert proc.stdout.splitlines().count(line) == 1, proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [ODD]


@pytest.mark.slow
def test_a_sweep_into_such_a_folder_continues_as_printed(small_text, tmp_path):
    here = tmp_path / JOSE
    here.mkdir()
    args = ["-m", *run_args_in(small_text), "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={ODD}"]  # relative to here
    stopped = run_script("train.py", *args, cwd=here, failpoint="sigint:4")  # job 0 stopped at step 4
    assert stopped.returncode == 130, said(stopped)[-3000:]
    sweep = here / ODD
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"]
    command = printed_after("this job and the rest, with: ", stopped)
    assert shlex.split(command)[-2:] == ["-m", f"resume={sweep}"]
    continued = paste(command, tmp_path)  # from another folder: it runs where the sweep was started
    assert continued.returncode == 0, said(continued)[-3000:]
    assert "Traceback" not in said(continued)
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["run"], r["optim.lr"], r["finished"]) for r in rows] == [("0", "0.001", "true"), ("1", "0.002", "true")]
    assert sorted(p.name for p in here.iterdir()) == [ODD]


@pytest.mark.slow
@pytest.mark.parametrize(
    "folder, args, said_",
    [
        (JOSE, ["optim.lr=-1"], "optim.lr must be above 0, got -1"),
        (JOSE, [f"hydra.run.dir={ODD}/run", "optim.lr=-1"], "optim.lr must be above 0, got -1"),
        (JOSE, ["-m", "optim.lr=1e-3,-1", f"hydra.sweep.dir={ODD}"], "optim.lr must be above 0, got -1"),
        (JOSE, [f"resume={ODD}"], f"resume={ODD} does not exist"),
        ("a${x}b", [], "has ${ in its path, which Hydra reads as a reference to a setting"),
        ("a${x}b", ["-m", "optim.lr=1e-3,2e-3"], "has ${ in its path, which Hydra reads as a reference to a setting"),
    ],
)
def test_a_refused_start_in_or_into_such_a_folder_leaves_nothing(folder, args, said_, small_text, tmp_path):
    here = tmp_path / folder
    here.mkdir()
    proc = run_script("train.py", *run_args_in(small_text), *args, cwd=here)
    assert proc.returncode == 1
    assert said_ in one_error_line(proc.stderr)
    assert not any(here.iterdir()) and [p.name for p in tmp_path.iterdir()] == [folder]
