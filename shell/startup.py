"""What every entry script (train.py, generate.py, explain.py, export.py) does first, before its imports.

Ctrl-C while the libraries load ends the process at once: nothing has started that could be left half
done. The cyclic garbage collector waits until start-up is over (`started`): the imports and the model
make hundreds of thousands of objects that live as long as the process, which it would otherwise sweep
over and over as they are made, and once more at exit. And Lightning's torchmetrics is kept from
importing transformers and matplotlib, which it loads whenever they are installed, for metrics and plots
this project never asks of it; they are imported where they are used (Hugging Face folders, loss.png).
"""

from __future__ import annotations

import gc
import signal
import sys


def start_up(lean_lightning: bool = False, pause_gc: bool = True) -> None:
    """Called at the top of a script run as a program, before its other imports. `pause_gc`: the script
    calls `started()` once its start-up is over (train.py and generate.py, whose start-up is long)."""
    if pause_gc:
        gc.disable()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if lean_lightning:
        skip_unused_torchmetrics_imports()


def started() -> None:
    """Start-up is over: what it made is frozen out of the collector's way, which is on again."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


TABLE = "torchmetrics.utilities.imports"  # torchmetrics' table of optional libraries it finds installed
UNUSED = (  # the entries that lead torchmetrics to import them (transformers, matplotlib)
    "_TRANSFORMERS_AVAILABLE",
    "_TRANSFORMERS_GREATER_EQUAL_4_4",
    "_TRANSFORMERS_GREATER_EQUAL_4_10",
    "_MATPLOTLIB_AVAILABLE",
)


def skip_unused_torchmetrics_imports() -> None:
    """Before Lightning is imported: torchmetrics then reads transformers and matplotlib as absent. (The
    finder is made here, not when this module is imported: its imports come after Ctrl-C is set up.)"""
    import importlib.abc
    import importlib.util

    class SkipUnused(importlib.abc.MetaPathFinder):
        """Finds nothing itself: when torchmetrics' table is about to be imported, it returns the table's
        own spec with its loading followed by setting the UNUSED entries false, and steps aside."""

        def find_spec(self, name, path=None, target=None):
            if name != TABLE:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            load = spec.loader.exec_module

            def exec_module(module) -> None:
                load(module)
                for entry in UNUSED:
                    if hasattr(module, entry):  # (another torchmetrics may name them otherwise: then they stay)
                        setattr(module, entry, False)

            spec.loader.exec_module = exec_module
            return spec

    if TABLE not in sys.modules and not any(type(f).__name__ == "SkipUnused" for f in sys.meta_path):
        sys.meta_path.insert(0, SkipUnused())
