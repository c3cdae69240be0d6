"""Where generate.py, explain.py and export.py write: stdout and files. A write the system refuses (a full
disk, a quota, a device error) is said in one line naming the place, and leaves nothing half made."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from data.writes import refused_write


class OutputError(Exception):
    """Output that could not be written; the message names where, the system's reason and what to do."""


def reason(err: BaseException) -> str:
    """The system's reason for a failed write: OSError's, or the one safetensors quotes ("... (os error 28)")."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    if (refused := refused_write(err)) is not None:
        return refused.strerror
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def cannot_write(what: str | Path, err: BaseException, instead: str = "choose another place") -> str:
    """One line for a write the system refused: what, why, and what to do."""
    refused = refused_write(err)
    return f"cannot write {what}: {reason(err)}; {f'{refused.fix} or ' if refused else ''}{instead}"


class GuardedStdout:
    """sys.stdout, whose failed writes (other than a reader that left the pipe) come as OutputError, so
    that they can be told from a failed write of a file."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        if self.stream is None:  # the process started with stdout closed (`>&-`): Python leaves sys.stdout None
            raise OutputError("cannot write the output: stdout is closed; send the output elsewhere (> FILE)")
        with self.failures_said():
            return self.stream.write(text)

    def flush(self) -> None:
        if self.stream is None:
            return
        with self.failures_said():
            self.stream.flush()

    @contextlib.contextmanager
    def failures_said(self):
        try:
            yield
        except BrokenPipeError:  # not a failure: the reader has all it wants
            raise
        except OSError as err:
            raise OutputError(
                cannot_write(f"the output to {stdout_name(self.stream)}", err, "send the output elsewhere")
            ) from None
        except UnicodeEncodeError as err:  # PYTHONIOENCODING=ascii, or a locale of another encoding
            raise OutputError(
                f"cannot write the output to {stdout_name(self.stream)}: its encoding, {err.encoding}, has no "
                f"{err.object[err.start]!r}; set PYTHONIOENCODING=utf-8, or use a UTF-8 locale"
            ) from None

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def stdout_name(stream) -> str:
    """The name of stdout in a message, with the file it goes to when it is one (`> /dev/full`)."""
    try:
        target = os.readlink(f"/proc/self/fd/{stream.fileno()}")
    except (OSError, ValueError):  # not Linux, or a stream without a descriptor
        return "stdout"
    return f"stdout ({target})" if target.startswith("/") else "stdout"


def silence_stdout() -> None:
    """Point stdout at the null device, so that what is still buffered has somewhere to go at exit
    (Python would print the failed flush there, and exit with status 120)."""
    stream = sys.stdout.stream if isinstance(sys.stdout, GuardedStdout) else sys.stdout
    if stream is None:  # stdout closed from the start: nothing is buffered
        return
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError):  # a stream without a descriptor (a test's capture) flushes nowhere at exit
        pass
