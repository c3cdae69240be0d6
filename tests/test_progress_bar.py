"""The progress bar as a user sees it: Lightning's bar over the run's steps, redrawn every ten steps and at the
end. Its counts are read from train.py run in this process with the bar put in the place of the plain lines
(train_here's output is no terminal); what a terminal shows is read from one run in a pseudo-terminal, the
output read back the way a terminal shows it. (Where the output is a log file, a run writes plain lines
instead: tests/test_plain_logs.py.)"""

from __future__ import annotations

import re

import pytest

from shell.progress import StepsBar
from tests.common import TINY_OVERRIDES, run_in_terminal, train_here

BAR = "training:"
NO_STEP_LIMIT = "1099511627775"  # the batches of a run limited by time (data.datamodule), not a total to show
STEPS_BAR = re.compile(r"^training: +(?:\d+%)?\|.*\| (\d+)/(\S+) \[(\S+)<(\S+),")


@pytest.fixture
def bar_here(monkeypatch):
    """The terminal's bar for the runs train_here runs (shell/run.py imports progress_callback by that name)."""
    monkeypatch.setattr("shell.run.progress_callback", lambda accumulation: StepsBar(accumulation))


def bar_args(small_text, *extra: str) -> list[str]:
    return [*TINY_OVERRIDES, f"data.path={small_text}", "trainer.enable_progress_bar=true", *extra]


def drawn(output: str) -> list[str]:
    """Every state the training bar was drawn in, in order."""
    parts = (re.sub(r"\x1b\[\d*[A-Za-z]", "", part).strip() for part in re.split(r"[\r\n]", output))
    return [part for part in parts if part.startswith(BAR)]


def counts(output: str) -> list[tuple[int, str]]:
    """The (count, total) of every state the training bar was drawn in, in order."""
    states = [STEPS_BAR.match(line) for line in drawn(output)]
    assert states and all(states), drawn(output)
    return [(int(state[1]), state[2]) for state in states]


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


def test_the_progress_bar_redraws_every_ten_steps_and_ends_on_the_last_step(small_text, bar_here):
    ran = train_here(*bar_args(small_text, "trainer.max_steps=25", "trainer.val_check_interval=5"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    shown = counts(ran.stdout)
    assert {total for _, total in shown} == {"25"} and shown[-1] == (25, "25"), shown
    assert {n for n, _ in shown} == {0, 10, 20, 25}, shown  # every ten steps, and the last


def test_a_resumed_runs_bar_counts_on_from_its_step_to_the_same_total(small_text, tmp_path, bar_here):
    """A resumed run's bar starts at the step it continues from, counts on to its end, and says the time left
    at the resumed run's own pace."""
    run = tmp_path / "run"
    ran = train_here(*bar_args(small_text, "trainer.max_steps=6", f"hydra.run.dir={run}"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    again = train_here(f"resume={run}", "trainer.max_steps=26", "trainer.enable_progress_bar=true")
    assert again.returncode == 0, again.stderr[-3000:]
    shown = counts(again.stdout)
    assert {total for _, total in shown} == {"26"} and shown[0] == (6, "26") and shown[-1] == (26, "26"), shown
    assert [n for n, _ in shown] == sorted(n for n, _ in shown), shown  # never back
    left = [(n, STEPS_BAR.match(line)[4]) for (n, _), line in zip(shown, drawn(again.stdout), strict=True)]
    assert all(re.fullmatch(r"\d\d:\d\d", each) for n, each in left if n > 6), left  # the time left at its pace


def test_a_run_limited_by_time_shows_its_step_count(small_text, bar_here):
    args = ["trainer.max_steps=-1", "trainer.max_time=00:00:00:02", "trainer.val_check_interval=50"]
    ran = train_here(*bar_args(small_text, *args))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert NO_STEP_LIMIT not in ran.stdout.replace(",", "")  # no total of batches that are not there
    shown = counts(ran.stdout)
    assert {total for _, total in shown} == {"?"}, shown  # a count of steps, with no total
    assert [n for n, _ in shown] == sorted(n for n, _ in shown) and shown[-1][0] > 0, shown


@pytest.mark.slow
def test_in_a_terminal_the_run_ends_with_its_final_bar_once_and_lightnings_last_line_whole(small_text, tmp_path):
    status, output = run_in_terminal("train.py", *bar_args(small_text, "trainer.max_steps=6"), cwd=tmp_path)
    lines = screen(output)
    assert status == 0, "\n".join(lines[-40:])
    assert re.search(r"\rtraining: +100%\|", output), output[-3000:]  # drawn over itself
    assert not re.search(r"^step \d+/\d+ \|", output, re.MULTILINE)  # no plain progress lines
    assert "Validation DataLoader 0" in output  # shown while it runs,
    assert not [line for line in lines if line.startswith("Validation")], lines  # and cleared after
    bars = [line for line in lines if line.startswith(BAR)]
    assert len(bars) == 1 and STEPS_BAR.match(bars[0]).group(1, 2) == ("6", "6"), bars
    # Lightning's last line whole, written above the bar as log lines are; the run's own last lines after it
    stop = lines.index("`Trainer.fit` stopped: `max_steps=6` reached.")
    (done,) = [i for i, line in enumerate(lines) if "[train][INFO] - done: " in line]
    assert stop < lines.index(bars[0]) < done
