"""A picture of one layer's attention: one heatmap per head, tokens as axis labels."""

from __future__ import annotations

import errno
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from data.writes import making_folders

if TYPE_CHECKING:
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.image import AxesImage

MAX_LABELS = 96  # beyond this many tokens, label every n-th one so the labels stay legible


def save_attention_png(
    weights: torch.Tensor,
    labels: list[str],
    path: str | Path,
    title: str = "",
    prompt_len: int | None = None,
    replace: bool = False,
) -> Path:
    """Write weights (n_head, T, T) as a PNG: row = the token attending (query), column = the token
    attended to (key). A dashed line marks where the prompt ends. The file appears complete or not
    at all (written aside, then renamed), and a failed write leaves no folder it made. A file already
    at `path` is kept (FileExistsError) unless `replace`: a picture this process drew there itself."""
    figure = attention_figure(weights, labels, title, prompt_len)
    path = Path(path)
    write_png(figure, path, replace)
    return path


def attention_figure(weights: torch.Tensor, labels: list[str], title: str, prompt_len: int | None) -> Figure:
    """One heatmap per head on a grid about as wide as it is tall, all on one colour scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n_head, T, _ = weights.shape
    if len(labels) != T:
        raise ValueError(f"{len(labels)} labels for {T} tokens")
    cols = math.ceil(math.sqrt(n_head))
    rows = math.ceil(n_head / cols)
    panel = min(8.0, max(3.0, 0.12 * T))  # inches per heatmap
    figure = Figure(figsize=(cols * panel + 1.0, rows * panel + 0.8), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, cols, squeeze=False)
    image = draw_heads(axes, weights, labels, prompt_len)
    if image is not None:
        figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="attention weight")
    figure.suptitle(title or "attention weights (row: query token, column: key token)", fontsize=10)
    figure.supxlabel("attended to (key)", fontsize=9)
    figure.supylabel("attending (query)", fontsize=9)
    return figure


def draw_heads(axes: np.ndarray, weights: torch.Tensor, labels: list[str], prompt_len: int | None) -> AxesImage | None:
    """Head h's weights (T, T) in panel h of axes (rows, cols), tokens as tick labels; panels beyond
    the last head stay blank. Returns the last heatmap drawn, for the colour bar."""
    n_head, T, _ = weights.shape
    fontsize = max(3.0, min(8.0, 500 / (T * axes.shape[1])))
    ticks = list(range(0, T, math.ceil(T / MAX_LABELS)))
    tick_labels = [labels[i].replace("$", r"\$") for i in ticks]  # `$` would start matplotlib's math mode
    values = weights.detach().float().cpu().numpy()
    vmax = float(values.max()) or 1.0
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= n_head:
            ax.axis("off")
            continue
        image = ax.imshow(values[h], cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xticks(ticks, tick_labels, rotation=90, fontsize=fontsize)
        ax.set_yticks(ticks, tick_labels, fontsize=fontsize)
        if prompt_len is not None and 0 < prompt_len < T:
            for line in (ax.axvline, ax.axhline):
                line(prompt_len - 0.5, color="white", linewidth=0.6, linestyle="--")
    return image


def write_png(figure: Figure, path: Path, replace: bool) -> None:
    """The figure as a PNG at path: written aside, then renamed (put_new, unless `replace`); a failed
    write leaves neither the file aside nor a folder it made."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with making_folders(path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as out, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # glyphs missing from the font: the label shows a box instead
                figure.savefig(out, format="png", dpi=150)
            if replace:
                os.replace(tmp, path)
            else:
                put_new(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def put_new(written: Path, path: Path) -> None:
    """Give the finished file `written` the name `path`, which must still be free: a hard link fails if a
    file took the name meanwhile (another process), where a rename would replace it."""
    try:
        os.link(written, path)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links (FAT, some network shares)
        if path.exists() or path.is_symlink():
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.replace(written, path)
        return
    written.unlink()
