"""Fault injection for the reliability tests; inert unless TINYGPT2_FAILPOINT is set.

TINYGPT2_FAILPOINT holds comma-separated points, each `name:first[-last]` in optimizer steps:

    kill:5        SIGKILL this process when step 5 has finished (before its checkpoint)
    kill_save:5   SIGKILL this process halfway through writing the first checkpoint file of step 5
    kill_end:5    SIGKILL this process when training has ended at step 5 and its last checkpoint is
                  written, before the run's result is recorded
    kill_val:5    SIGKILL this process as the validation after step 5 begins
    sigint:5      send this process SIGINT (Ctrl-C) as step 5 begins
    ctrl_c_save:5 send this process SIGINT twice (Ctrl-C, and again) halfway through writing the first
                  checkpoint file of step 5
    nan:3-5       make the loss of steps 3 to 5 not a number
    nan_weights:4 make a weight not a number after step 4 (an update that broke the weights)
    enospc:4      fail the first checkpoint write of step 4 with "no space left on device"

Steps count from 1 (the step that makes global_step 1 is step 1).
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "TINYGPT2_FAILPOINT"


def _points() -> dict[str, tuple[int, int]]:
    points = {}
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        name, _, steps = item.partition(":")
        first, _, last = steps.partition("-")
        points[name.strip()] = (int(first), int(last or first))
    return points


def active(name: str, step: int) -> bool:
    """Whether failpoint `name` covers optimizer step `step` (1-based)."""
    span = _points().get(name)
    return span is not None and span[0] <= step <= span[1]


_FIRED: set[str] = set()


def once(name: str, step: int) -> bool:
    """active(), but true only the first time in this process (a step of several micro-batches)."""
    if name in _FIRED or not active(name, step):
        return False
    _FIRED.add(name)
    return True


def kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def interrupt_now() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def disk_full(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
