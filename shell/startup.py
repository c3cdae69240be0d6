"""What every entry script (train.py, generate.py, explain.py, export.py, studio.py) does first, before its
imports: Ctrl-C and SIGTERM end the process at once while the libraries load (nothing has started that could
be left half done, and a KeyboardInterrupt inside a C extension's import breaks it), and the cyclic garbage
collector waits until start-up is over (`started`): the imports and the model make hundreds of thousands of
objects that live as long as the process, which it would otherwise sweep over and over as they are made."""

from __future__ import annotations

import gc
import signal


def start_up(pause_gc: bool = True) -> None:
    """Called at the top of a script run as a program, before its other imports. `pause_gc`: the script calls
    `started()` once its start-up is over."""
    if pause_gc:
        gc.disable()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def started() -> None:
    """Start-up is over: what it made is frozen out of the collector's way, which is on again."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
