"""The progress bar as a user sees it: train.py run in a subprocess with its output sent to a log file
(no terminal), or under a pseudo-terminal, and the output read back the way a terminal shows it."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.common import ROOT, TINY_OVERRIDES, run_in_terminal

pytestmark = pytest.mark.slow

BAR = "training:"
NO_STEP_LIMIT = "1099511627775"  # the batches of a run limited by time (data.datamodule), not a total to show
STEPS_BAR = re.compile(r"^training: +\d+%\|.*\| (\d+)/(\S+) \[(\S+)<(\S+),")
TIME_BAR = re.compile(r"^training: +(\d+)%\|.*\| (\d\d):(\d\d)/(\d\d:\d\d) \[step (\d+)")


def bar_args(small_text: Path, *extra: str) -> list[str]:
    return [*TINY_OVERRIDES, f"data.path={small_text}", "trainer.enable_progress_bar=true", *extra]


def read(log: Path) -> str:
    """A log as written: read_text would turn its carriage returns into newlines."""
    return log.read_bytes().decode("utf-8", errors="replace")


def run_to_file(args: list[str], cwd: Path, log: Path) -> subprocess.CompletedProcess:
    """python train.py ARGS > log 2>&1"""
    with open(log, "w") as out:
        return subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=600
        )


def screen(output: str) -> list[str]:
    """The lines a terminal shows once `output` has been written to it (as `cat log.txt` shows a log):
    a carriage return goes back to the line's start, a newline down a line, ESC[nA up n lines, and
    text overwrites what is under it."""
    lines: list[list[str]] = [[]]
    row = col = 0
    for token in re.split(r"(\r|\n|\x1b\[\d*[A-Za-z])", output):
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append([])
        elif token.startswith("\x1b["):
            if token.endswith("A"):
                row = max(0, row - int(token[2:-1] or 1))
        elif token:
            line = lines[row]
            line.extend(" " * (col + len(token) - len(line)))
            line[col : col + len(token)] = token
            col += len(token)
    return ["".join(line).rstrip() for line in lines]


def spent(state: re.Match) -> int:
    """The seconds a time bar shows spent."""
    return int(state[2]) * 60 + int(state[3])


def drawn(output: str) -> list[str]:
    """Every state the training bar was drawn in, in order."""
    return [part.strip() for part in re.split(r"[\r\n]", output) if part.strip().startswith(BAR)]


def run_until_drawn(args: list[str], cwd: Path, log: Path, ready) -> str:
    """The log of `python train.py ARGS > log 2>&1` stopped with SIGINT (as Ctrl-C stops it) once its
    bar has been drawn in a state that satisfies `ready`."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT
        )
        deadline = time.time() + 300
        while not any(ready(line) for line in drawn(read(log))):
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"the run ended or stalled before its bar showed what was waited for:\n{read(log)[-3000:]}")
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=300) == 130, read(log)[-3000:]  # stopped with a checkpoint
    return read(log)


def resume_command(log: str) -> list[str]:
    """The arguments of the command a stopped run printed to continue it."""
    (command,) = re.findall(r"Continue with: (python \S*train\.py resume=\S+)", log)
    return shlex.split(command)[2:]


# ---- a log file ------------------------------------------------------------------------------------------


def test_a_log_file_gets_no_line_per_validation_batch(small_text, tmp_path):
    log = tmp_path / "log.txt"
    args = bar_args(small_text, "trainer.max_steps=6", "trainer.val_check_interval=2", "trainer.limit_val_batches=10")
    args.append("trainer.log_every_n_steps=10")  # longer than the run: its last step's values are logged all the same
    assert run_to_file(args, tmp_path, log).returncode == 0, read(log)[-3000:]
    output = read(log)
    assert "Validation" not in output and "\x1b[" not in output, output[-3000:]
    assert "logging interval" not in output  # Lightning's advice to log more often, which the run does not need
    lines = screen(output)
    assert len(lines) < 40, "\n".join(lines)  # the run's own lines, not one per redraw or validation batch
    bars = [line for line in lines if line.startswith(BAR)]
    assert len(bars) == 1 and STEPS_BAR.match(bars[0]).group(1, 2) == ("6", "6"), bars  # the final bar, once
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in lines


def test_validations_closer_together_than_a_redraw_still_move_the_bar_on(small_text, tmp_path):
    # a validation redraws the bar with its figures; if it drew the count of before it, steps done
    # between validations a fifth of a second apart would never be shown
    log = tmp_path / "log.txt"
    args = bar_args(small_text, "trainer.max_steps=30", "trainer.val_check_interval=3", "trainer.limit_val_batches=2")
    assert run_to_file(args, tmp_path, log).returncode == 0, read(log)[-3000:]
    shown = {int(STEPS_BAR.match(line)[1]) for line in drawn(read(log)) if STEPS_BAR.match(line)}
    assert set(range(3, 31, 3)) <= shown, sorted(shown)  # the steps done at each validation, and the end


def test_a_run_limited_by_time_shows_the_time_spent_of_its_budget(small_text, tmp_path):
    log = tmp_path / "log.txt"
    args = bar_args(small_text, "trainer.max_steps=-1", "trainer.max_time=00:00:00:06", "trainer.val_check_interval=50")
    assert run_to_file(args, tmp_path, log).returncode == 0, read(log)[-3000:]
    output = read(log)
    assert NO_STEP_LIMIT not in output.replace(",", "")
    states = [TIME_BAR.match(line) for line in drawn(output)]
    assert states and all(states), drawn(output)
    assert {s[4] for s in states} == {"00:06"}
    seconds = [spent(s) for s in states]
    assert seconds == sorted(seconds) and seconds[-1] >= 6
    steps = [int(s[5]) for s in states]
    assert steps == sorted(steps) and steps[-1] > 0
    lines = screen(output)
    bars = [line for line in lines if line.startswith(BAR)]
    assert len(bars) == 1 and TIME_BAR.match(bars[0])[1] == "100", bars  # the final bar, once
    assert any(line.startswith("Time limit reached. Elapsed time is ") for line in lines), lines  # on a line of its own


def test_a_resumed_run_keeps_its_total_and_time_left(small_text, tmp_path):
    steps = 2000  # long enough to be stopped early on any machine; both runs are stopped
    args = bar_args(small_text, f"trainer.max_steps={steps}", "trainer.val_check_interval=100")

    def reached(step):
        return lambda line: (found := STEPS_BAR.match(line)) is not None and int(found[1]) >= step

    stopped = run_until_drawn(args, tmp_path, tmp_path / "first.log", reached(2))
    at = int(re.search(r"stopped by SIGINT at step (\d+)", stopped)[1])
    resumed = run_until_drawn(resume_command(stopped), tmp_path, tmp_path / "resumed.log", reached(at + 3))
    states = [STEPS_BAR.match(line) for line in drawn(resumed)]
    assert states and all(states), drawn(resumed)
    assert {s[2] for s in states} == {str(steps)}  # never "n/?"
    assert int(states[0][1]) == at
    assert all(s[4] != "?" for s in states[1:]), drawn(resumed)  # time left, from the resumed run's own pace


def test_a_resumed_run_limited_by_time_goes_on_from_the_time_it_had_spent(small_text, tmp_path):
    args = bar_args(small_text, "trainer.max_steps=-1", "trainer.max_time=00:00:00:12", "trainer.val_check_interval=50")

    def started(line):
        return (found := TIME_BAR.match(line)) is not None and spent(found) >= 2

    stopped = run_until_drawn(args, tmp_path, tmp_path / "first.log", started)
    log = tmp_path / "resumed.log"
    assert run_to_file(resume_command(stopped), tmp_path, log).returncode == 0, read(log)[-3000:]
    states = [TIME_BAR.match(line) for line in drawn(read(log))]
    assert states and all(states), drawn(read(log))
    assert {s[4] for s in states} == {"00:12"}
    assert spent(states[0]) >= 2  # the time spent up to the stop's checkpoint counts
    assert spent(states[-1]) >= 12 and states[-1][1] == "100"


# ---- a terminal ------------------------------------------------------------------------------------------


def test_in_a_terminal_the_run_ends_with_its_final_bar_once_and_lightnings_last_line_whole(small_text, tmp_path):
    args = bar_args(small_text, "trainer.max_steps=6", "trainer.val_check_interval=3")
    status, output = run_in_terminal("train.py", *args, cwd=tmp_path)
    lines = screen(output)
    assert status == 0, "\n".join(lines[-40:])
    assert "Validation DataLoader 0" in output  # shown while it runs,
    assert not [line for line in lines if line.startswith("Validation")], lines  # and cleared after
    bars = [line for line in lines if line.startswith(BAR)]
    assert len(bars) == 1 and STEPS_BAR.match(bars[0]).group(1, 2) == ("6", "6"), bars
    stop = lines.index("`Trainer.fit` stopped: `max_steps=6` reached.")
    assert lines.index(bars[0]) < stop
