"""The command line of generate.py, explain.py and export.py: argparse's parser with its errors in one
line (argparse prints its usage block first), the kinds of value their options take, and how a run of
one ends."""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from checkpoint import trained_offline
from shell.output import GuardedStdout, OutputError, silence_stdout


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        hint = f"python {self.prog} --help lists the options"
        if "expected one argument" in message:  # --stop at the end, or --stop -x: a value that starts with -
            flag = message.split()[1].rstrip(":")
            hint = f"give it a value; one that starts with - is written with =, e.g. {flag}=-x; {hint}"
        self.exit(2, f"error: {message} ({hint})\n")


# The kinds of value, each refused in the same words ("argument --top-p: must be a number, got 'abc'").


def whole_number(text: str) -> int:
    """A count as a user may write it: 500, 2_000 or 1e3 (as train.py's settings take it)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}")
    return int(value)


def number(text: str) -> float:
    """Any number float() reads; nan and inf too, which each option's own check then refuses or takes."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def given_path(text: str) -> Path:
    """A path, ~ expanded (`--out=~/hf`: the shell leaves that ~ as it is). An empty one (an unset
    variable, `--ckpt "$RUN"`) is refused, where Path would read it as the current folder."""
    if not text:
        raise argparse.ArgumentTypeError("needs a path, got ''")
    return Path(text).expanduser()


STOPS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and a scheduler's or `kill`'s stop


class Terminated(BaseException):  # as KeyboardInterrupt: no library's `except Exception` takes it
    """SIGTERM (a scheduler's or `kill`'s stop), raised where the program is, so that what it was writing
    is cleaned up as for Ctrl-C; the default action would end the process with its files half made."""


@contextlib.contextmanager
def stops_raised() -> Iterator[None]:
    """While held, Ctrl-C raises KeyboardInterrupt and SIGTERM raises Terminated where the program is;
    the handlers that were there before come back after. A stop whose handler runs only as the block is
    left is dropped: the work has ended by then, one way or the other, and raised while the other
    signal's handler is given back, it would escape the caller's `except` as a traceback."""
    over = False

    def stop(signum, frame) -> None:
        if not over:
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated

    before = {signum: signal.signal(signum, stop) for signum in STOPS}
    try:
        yield
    finally:
        over = True
        for signum, handler in before.items():
            signal.signal(signum, handler)


def stopped_status(stop: BaseException) -> int:
    """The exit status of a run that a stop ended, as a shell reports a process that the signal ended."""
    return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)


def exit_quietly(code: int) -> NoReturn:
    """Exit with code, once the work is done and reported. A stop from here on (Ctrl-C or SIGTERM while
    the interpreter shuts down and torch's exit handlers run) is ignored: it would change the status of a
    run that is over (143 for an export in place) or show a traceback of those handlers."""
    for signum in STOPS:
        signal.signal(signum, signal.SIG_IGN)
    sys.exit(code)


def run_program(work: Callable[[], int | None], *refusals: type[Exception], less: str = "") -> int:
    """Run a script's work and end as the project's scripts end: an error of the kinds given (bad input,
    a failing environment), output that cannot be written, or memory that cannot be had, in one `error:`
    line and status 1 (`less`: what to ask for instead, for the last); a reader that left the pipe
    (`| head`) quietly with 141, as a shell reports SIGPIPE. Ctrl-C is the caller's."""
    stdout = sys.stdout
    sys.stdout = GuardedStdout(stdout)
    try:
        code = work() or 0
        sys.stdout.flush()  # what is still buffered fails here rather than at exit, in Python's own words
        return code
    except (OutputError, *refusals) as err:
        print(f"error: {err}", file=sys.stderr)
        if isinstance(err, OutputError):
            silence_stdout()
        return 1
    except BrokenPipeError:
        silence_stdout()
        return 141
    except (MemoryError, RuntimeError) as err:  # torch.OutOfMemoryError is a RuntimeError too
        if not out_of_memory(err):
            raise
        print(f"error: {memory_message(err, less)}", file=sys.stderr)
        return 1
    finally:
        sys.stdout = stdout


def out_of_memory(err: BaseException) -> bool:
    """An allocation that failed: torch's CPU allocator says so in a RuntimeError, CUDA's in its own."""
    import torch

    text = str(err)
    return (
        isinstance(err, (MemoryError, torch.OutOfMemoryError))
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


def memory_message(err: BaseException, less: str = "") -> str:
    wanted = re.search(r"allocate (\d+) bytes", str(err))
    size = f" ({int(wanted.group(1)) / 2**30:.1f} GiB at once)" if wanted else ""
    return f"out of memory{size}: {less + ', or ' if less else ''}use a machine with more memory for this model"


OFFLINE_NOTE = (
    "note: this model was trained on the offline corpus (Python's help texts), not Tiny Shakespeare, which "
    "train.py could neither find nor download: give your text with data.path=/path/to/input.txt, or let "
    "train.py download it (data.url) on a machine with network"
)


def say_what_it_learned(settings: dict) -> None:
    """One line on stderr where the model learned the offline stand-in for Tiny Shakespeare (its saved
    settings say so: checkpoint.trained_offline), whose text it writes rather than a play's."""
    if trained_offline(settings):
        print(OFFLINE_NOTE, file=sys.stderr)
