"""What the benchmark scripts share: where Tiny Shakespeare is, the runs they read back, the programs
they start, and how they end.

A benchmark runs for minutes and works in a temporary folder. A Ctrl-C, or a SIGTERM (`kill`, a
scheduler), stops it and the programs it started, removes that folder and says so in one line (exit
130 or 143); a reader that leaves the pipe (`| head -1`) ends it quietly (141), as the project's other
scripts end. Each script imports this module after putting the checkout first on sys.path.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from data.errors import DataError
from shell.programs import exit_quietly, run_program

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def shakespeare() -> Path:
    """Tiny Shakespeare's input.txt: $TINYSHAKESPEARE (set but empty: unset), else found as `python
    train.py` run in the checkout finds it (data.sources.find_shakespeare with configs/data/shakespeare.yaml's
    settings): the token cache's copy, a local copy, else downloaded into the cache. Without it (a file
    $TINYSHAKESPEARE does not name, no copy and no network), the benchmark ends in one line."""
    given = os.environ.get("TINYSHAKESPEARE")
    if given:
        if not Path(given).expanduser().is_file():
            raise SystemExit(f"error: Tiny Shakespeare not found at {given}; set TINYSHAKESPEARE=/path/to/input.txt")
        return Path(given).expanduser()
    from omegaconf import OmegaConf

    from data.sources import find_shakespeare

    settings = OmegaConf.load(ROOT / "configs" / "data" / "shakespeare.yaml")
    copies = [os.path.normpath(ROOT / Path(copy).expanduser()) for copy in settings.local_copies]  # train.py's in ROOT
    found = find_shakespeare(settings.cache_dir, copies, settings.url)
    if found is None:
        raise SystemExit(
            f"error: Tiny Shakespeare is not in the cache ({settings.cache_dir}) or beside the checkout "
            f"({', '.join(settings.local_copies)}), and its download failed; set TINYSHAKESPEARE=/path/to/input.txt"
        )
    return Path(found)


def finished_metrics(run: Path, what: str) -> dict[str, float]:
    """The final metrics a train.py run recorded in its result.json; one that a signal stopped early has
    no final validation: refused in one line."""
    from shell.folders import RunFolder

    result = RunFolder(run).read_result()
    if not result.get("finished"):
        raise SystemExit(stopped_early(what))
    return result["metrics"]


def stopped_early(what: str) -> str:
    return f"error: {what} was stopped before its end (a signal sent to it); it has no figures"


def refuse_stopped(proc: subprocess.CompletedProcess, what: str) -> None:
    """A train.py run that a signal sent to it alone stopped early exits 130 or 143, with its checkpoint
    and no final figures: refused in one line."""
    if proc.returncode in [128 + stop for stop in STOPS]:
        raise SystemExit(stopped_early(what))


STOPS = (signal.SIGINT, signal.SIGTERM)


class Terminated(BaseException):  # as KeyboardInterrupt: no library's `except Exception` takes it
    """SIGTERM, raised where the script is, so that it cleans up as for Ctrl-C."""


def terminate(signum, frame) -> NoReturn:
    raise Terminated


def run_benchmark(main: Callable[[], None]) -> NoReturn:
    """Run a benchmark's main and exit as described at the top."""
    signal.signal(signal.SIGTERM, terminate)
    # Ctrl-C stops a benchmark even where it was started with SIGINT ignored (a background job of a
    # script), as it stops train.py: its temporary folder and the programs it runs are taken back
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = run_program(main, DataError)  # Tiny Shakespeare downloaded and not kept, a preparation refused
    except (KeyboardInterrupt, Terminated) as stop:
        print(f"\nstopped by {'SIGTERM' if isinstance(stop, Terminated) else 'Ctrl-C'}", file=sys.stderr)
        code = 143 if isinstance(stop, Terminated) else 130
    exit_quietly(code)


@contextlib.contextmanager
def started(command: list[str], **popen) -> Iterator[subprocess.Popen]:
    """subprocess.Popen(command, **popen) for a program the benchmark runs (train.py, nanoGPT, a
    preparation), in a process group of its own: a Ctrl-C at the terminal reaches the benchmark alone.
    Should the benchmark be stopped (Ctrl-C, SIGTERM) while the block runs, the program and the
    processes it started are asked to stop (SIGINT) and waited for, so that nothing they write outlives
    the temporary folder the benchmark removes next; a second stop ends them at once (SIGKILL)."""
    held: list[int] = []  # a stop while Popen starts it is taken once `proc` is there to pass it on to
    handlers = {signum: signal.signal(signum, lambda signum, frame: held.append(signum)) for signum in STOPS}
    try:
        proc = subprocess.Popen(command, start_new_session=True, **popen)
    except BaseException:
        restore(handlers)
        raise
    try:
        restore(handlers)
        for signum in held[:1]:
            signal.raise_signal(signum)
        yield proc
    except (KeyboardInterrupt, Terminated):
        signal_group(proc, signal.SIGINT)
        try:
            proc.communicate()  # what it still prints is read, so that it never waits on a full pipe
        except (KeyboardInterrupt, Terminated):
            signal_group(proc, signal.SIGKILL)
            proc.wait()
        raise


def restore(handlers: dict) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:  # all of them have ended
        pass


def run(command: list[str], **popen) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True), started and stopped as above."""
    with started(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen) as proc:
        out, err = proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def print_table(rows: list[tuple[str, str]]) -> None:
    """A benchmark's results after a blank line: names in one column, values beside them."""
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
