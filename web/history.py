"""How the model learned: the run's loss curves, from its newest checkpoint (the loss curve is part of
every checkpoint, whatever loggers the run used), and what it wrote at each validation, from samples.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from checkpoint import CHECKPOINTS_DIR, checkpoint_files, read_loss_history

SECTION = re.compile(r"^## step (\d+), prompt ([^\n]*)\n\n(`{3,})\n(.*?)\n\3\n", re.MULTILINE | re.DOTALL)


def run_folder(checkpoint: Path | None) -> Path | None:
    """The run folder a training checkpoint lies in (None for a Hugging Face folder or a loose file)."""
    if checkpoint is None or checkpoint.is_dir():
        return None
    folder = checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS_DIR else checkpoint.parent
    return folder if (folder / "config.yaml").is_file() or (folder / "samples.md").is_file() else None


def history(checkpoint: Path | None) -> dict:
    """{"run": folder, "train": [[tokens, loss]], "val": [...], "samples": [{"step", "prompt", "text"}]}."""
    folder = run_folder(checkpoint)
    curves = {"train": [], "val": []}
    if checkpoint is not None and checkpoint.is_file():
        newest = checkpoint_files(checkpoint.parent)
        curves = read_loss_history(newest[-1] if newest else checkpoint)
    samples = read_samples(folder / "samples.md") if folder else []
    return {"run": str(folder) if folder else None, **curves, "samples": samples}


def read_samples(path: Path) -> list[dict]:
    """samples.md's sections in order: the step, the prompt as written (a Python literal) and the text."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [
        {"step": int(m.group(1)), "prompt": unquote(m.group(2)), "text": m.group(4)} for m in SECTION.finditer(text)
    ]


def unquote(literal: str) -> str:
    """The prompt from its repr() in a section's heading; the heading's text where it is not one."""
    try:
        value = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        return literal
    return value if isinstance(value, str) else literal
