"""The progress bar as a user sees it: train.py run in a subprocess under a pseudo-terminal, and the
output read back the way a terminal shows it. (Where the output is a log file, a run writes plain
lines instead: tests/test_plain_logs.py.)"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.common import ROOT, TINY_OVERRIDES, run_in_terminal

pytestmark = pytest.mark.slow

BAR = "training:"
NO_STEP_LIMIT = "1099511627775"  # the batches of a run limited by time (data.datamodule), not a total to show
STEPS_BAR = re.compile(r"^training: +\d+%\|.*\| (\d+)/(\S+) \[(\S+)<(\S+),")
TIME_BAR = re.compile(r"^training: +(\d+)%\|.*\| (\d\d):(\d\d)/(\d\d:\d\d) \[step (\d+)")
CURSOR = re.compile(r"\x1b\[\d*[A-Za-z]")  # a terminal's cursor moves, as tqdm writes them


def bar_args(small_text: Path, *extra: str) -> list[str]:
    return [*TINY_OVERRIDES, f"data.path={small_text}", "trainer.enable_progress_bar=true", *extra]


def in_terminal(args: list[str], cwd: Path) -> str:
    """All that `python train.py ARGS` printed in a terminal; the run must succeed."""
    status, output = run_in_terminal("train.py", *args, cwd=cwd)
    assert status == 0, output[-3000:]
    return output


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
    parts = (CURSOR.sub("", part).strip() for part in re.split(r"[\r\n]", output))
    return [part for part in parts if part.startswith(BAR)]


def in_terminal_until_drawn(args: list[str], cwd: Path, ready) -> str:
    """All that `python train.py ARGS` printed in a terminal, stopped with SIGINT (as Ctrl-C stops it)
    once its bar has been drawn in a state that satisfies `ready`; the run must end well."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, stdin=child, stdout=child, stderr=child
    )
    os.close(child)
    printed, stopped, deadline = bytearray(), False, time.time() + 300
    try:
        while time.time() < deadline:
            if select.select([main], [], [], 0.05)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the terminal's other end closed: the process is done
                    break
                if not chunk:
                    break
                printed += chunk
            if not stopped and any(ready(line) for line in drawn(printed.decode("utf-8", errors="replace"))):
                proc.send_signal(signal.SIGINT)
                stopped = True
    finally:
        os.close(main)
        if proc.poll() is None and not stopped:
            proc.kill()
    output = printed.decode("utf-8", errors="replace")
    assert stopped, f"the run ended or stalled before its bar showed what was waited for:\n{output[-3000:]}"
    assert proc.wait(timeout=300) == 130, output[-3000:]  # stopped with a checkpoint
    return output


def resume_command(log: str) -> list[str]:
    """The arguments of the command a stopped run printed to continue it."""
    (command,) = re.findall(r"Continue with: (python \S*train\.py resume=\S+)", log)
    return shlex.split(command)[2:]


def test_validations_closer_together_than_a_redraw_still_move_the_bar_on(small_text, tmp_path):
    # a validation redraws the bar with its figures; if it drew the count of before it, steps done
    # between validations a fifth of a second apart would never be shown
    args = bar_args(small_text, "trainer.max_steps=30", "trainer.val_check_interval=3", "trainer.limit_val_batches=2")
    output = in_terminal(args, tmp_path)
    shown = {int(STEPS_BAR.match(line)[1]) for line in drawn(output) if STEPS_BAR.match(line)}
    assert set(range(3, 31, 3)) <= shown, sorted(shown)  # the steps done at each validation, and the end


def test_a_run_limited_by_time_shows_the_time_spent_of_its_budget(small_text, tmp_path):
    args = bar_args(small_text, "trainer.max_steps=-1", "trainer.max_time=00:00:00:06", "trainer.val_check_interval=50")
    output = in_terminal(args, tmp_path)
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

    stopped = in_terminal_until_drawn(args, tmp_path, reached(2))
    at = int(re.search(r"stopped by SIGINT at step (\d+)", stopped)[1])
    resumed = in_terminal_until_drawn(resume_command(stopped), tmp_path, reached(at + 3))
    states = [STEPS_BAR.match(line) for line in drawn(resumed)]
    assert states and all(states), drawn(resumed)
    assert {s[2] for s in states} == {str(steps)}  # never "n/?"
    assert int(states[0][1]) == at
    assert all(s[4] != "?" for s in states[1:]), drawn(resumed)  # time left, from the resumed run's own pace


def test_a_resumed_run_limited_by_time_goes_on_from_the_time_it_had_spent(small_text, tmp_path):
    args = bar_args(small_text, "trainer.max_steps=-1", "trainer.max_time=00:00:00:12", "trainer.val_check_interval=50")

    def started(line):
        return (found := TIME_BAR.match(line)) is not None and spent(found) >= 2

    stopped = in_terminal_until_drawn(args, tmp_path, started)
    resumed = in_terminal(resume_command(stopped), tmp_path)
    states = [TIME_BAR.match(line) for line in drawn(resumed)]
    assert states and all(states), drawn(resumed)
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
