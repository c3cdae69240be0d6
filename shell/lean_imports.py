"""A run imports only what it uses: Lightning imports torchmetrics, whose package imports transformers and
matplotlib whenever they are installed, for metrics (BERTScore, CLIPScore) and plots this project never
asks of it: about a second of every run's start-up (0.9 s of 3.4 s for `import lightning.pytorch` on a
2-core AMD EPYC). transformers is used here only for Hugging Face folders (export.py, init_from=hf/...),
matplotlib only to draw loss.png at the end of a run; each imports it where it does that.

`skip_unused_torchmetrics_imports()` makes torchmetrics read those two as absent: as its table of
optional libraries (torchmetrics.utilities.imports) is first imported, their entries are set false, so
the modules that consult it leave them alone. Nothing else changes: importing transformers or matplotlib
ourselves works as before, and a torchmetrics function that needs one says it is not installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TABLE = "torchmetrics.utilities.imports"
UNUSED = (  # the entries that lead torchmetrics to import them (transformers, matplotlib)
    "_TRANSFORMERS_AVAILABLE",
    "_TRANSFORMERS_GREATER_EQUAL_4_4",
    "_TRANSFORMERS_GREATER_EQUAL_4_10",
    "_MATPLOTLIB_AVAILABLE",
)


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


def skip_unused_torchmetrics_imports() -> None:
    """Before Lightning is imported (a process of train.py's own): see the module's docstring."""
    if TABLE not in sys.modules and not any(isinstance(f, SkipUnused) for f in sys.meta_path):
        sys.meta_path.insert(0, SkipUnused())
