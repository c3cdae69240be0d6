"""A corpus as HF `datasets` streams, read in order, split into training and validation text.

A corpus is a list of parts. Each part is an `IterableDataset` of rows with a text column (and,
for long plain-text documents read in pieces, `continues`: the row goes on with the previous row's
document), and a rule for the split its rows go to:

    train, val   all of them
    tail         the last val_fraction of the part's characters validate; the document on the
                 boundary is cut in two (a one-file corpus splits as char-rnn and nanoGPT split it)
    every        every k-th document validates, k = round(1 / val_fraction): for streams, whose
                 end is not known until it comes

Reading gives items `(split, text, separator_before, lines)`: separator_before is true when the text
starts a document that is not the first of its split (an end-of-text token goes before it), lines
when each line of the text is a document of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from data.errors import DataError

if TYPE_CHECKING:  # a part only holds a function that opens its stream: the sources import datasets
    import datasets

SAMPLE_WINDOW = 100_000  # characters: the tokenizer's sample of a large corpus is windows this long

Item = tuple[str, str, bool, bool]


@dataclass
class Part:
    rows: Callable[[], datasets.IterableDataset]  # a fresh stream on every call
    split: str  # train, val, tail or every
    column: str = "text"
    where: str = ""  # the files or dataset, for messages
    lines: bool = False
    batch_rows: int = 64  # rows read at a time; where reading can resume
    streaming: bool = False  # rows come over the network: its size is not counted beforehand
    explain: Callable[[Exception], Exception] | None = None  # a reading error as the error to raise
    check: Callable[[list], None] | None = None  # looks at each batch's texts; a DataError if they are not text

    def batches(self, state: dict | None = None) -> Iterator[tuple[list[tuple[Any, bool]], dict]]:
        """(text, continues) rows a batch at a time, each batch with the stream's state after it;
        reading resumes after that batch when given its state."""
        try:
            stream = self.rows()
            known = stream.column_names  # None where the reader learns them from the first rows
            if known is not None:
                self.check_column(known)
                stream = stream.select_columns([c for c in (self.column, "continues") if c in known])
            if state:
                stream.load_state_dict(state)
            for batch in stream.iter(batch_size=self.batch_rows):
                if known is None:
                    self.check_column(list(batch))
                texts = batch[self.column]
                if self.check is not None:
                    self.check(texts)
                yield list(zip(texts, batch.get("continues") or [False] * len(texts), strict=True)), stream.state_dict()
        except DataError:
            raise
        except Exception as err:
            if self.explain is None:
                raise
            raise self.explain(err) from None

    def is_text(self, value) -> bool:
        """True for text, False for a missing value; anything else is an error."""
        if value is None or isinstance(value, str):
            return bool(value)
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
        name = type(value).__name__
        kind = f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
        raise DataError(
            f"data.text_column={self.column!r} of {self.where} holds {kind} value ({shown}), not "
            "text; set data.text_column to the column that holds the text, or, if this is it, write that value "
            "as a string"
        )

    def check_column(self, names: list[str]) -> None:
        if self.column not in names:
            raise DataError(
                f"data.text_column={self.column!r} is not a column of {self.where}; its columns are "
                f"{', '.join(names)}; set data.text_column to the one that holds the text"
            )


@dataclass
class Corpus:
    parts: list[Part]
    val_fraction: float
    sizes: dict[int, int] = field(default_factory=dict)

    def size(self, index: int) -> int:
        """Characters in a part (read once, then remembered)."""
        if index not in self.sizes:
            part = self.parts[index]
            total = 0
            for rows, _ in part.batches():
                total += sum(len(text) for text, _ in rows if part.is_text(text))
            if total == 0:
                raise DataError(f"{part.where} holds no text")
            self.sizes[index] = total
        return self.sizes[index]

    def boundary(self, index: int) -> int:
        """Where validation starts in a tail part, in characters."""
        if not 0.0 < self.val_fraction < 1.0:
            raise DataError(f"data.val_fraction must be between 0 and 1 (exclusive), got {self.val_fraction}")
        return int(self.size(index) * (1.0 - self.val_fraction))

    def train_chars(self) -> int | None:
        """Characters of training text, or None where a stream would have to be read to know."""
        total = 0
        for i, part in enumerate(self.parts):
            if part.split == "val":
                continue
            if part.streaming or part.split == "every":
                return None
            total += self.size(i) if part.split == "train" else self.boundary(i)
        return total

    def walk(self, position: dict | None = None, train_only: bool = False) -> Walk:
        return Walk(self, position, train_only)

    def train_texts(self, max_chars: int | None = None) -> Iterator[str]:
        """The training text; with max_chars, at most that much: evenly spaced windows over all of
        it, or (for a stream of unknown length) its beginning."""
        texts = (text for items in self.walk(train_only=True) for split, text, _, _ in items if split == "train")
        total = self.train_chars() if max_chars is not None else None
        if max_chars is None or (total is not None and total <= max_chars):
            yield from texts
        elif total is None:
            yield from take_chars(texts, max_chars)
        else:
            yield from windows(texts, total, max_chars)


def take_chars(texts: Iterator[str], limit: int) -> Iterator[str]:
    for text in texts:
        yield text[:limit]
        limit -= len(text)
        if limit <= 0:
            return


def windows(texts: Iterator[str], total: int, budget: int) -> Iterator[str]:
    """At most `budget` characters of texts, in windows (at least 16) spaced evenly over all `total`."""
    width = max(1, min(SAMPLE_WINDOW, budget // 16))
    count = budget // width
    period = total / count
    offset, j = 0, 0
    for text in texts:
        end = offset + len(text)
        while j < count:
            start = int(j * period)
            if start >= end:
                break
            if start + width > offset:
                yield text[max(start - offset, 0) : start + width - offset]
            if start + width > end:
                break  # the window goes on in the next text
            j += 1
        offset = end
        if j == count:
            return


class Walk:
    """Reads a corpus in order as batches of items, keeping `position`: where reading stands after the
    last batch given out, so that a later run can start there."""

    def __init__(self, corpus: Corpus, position: dict | None = None, train_only: bool = False):
        self.corpus, self.train_only = corpus, train_only
        self.position = position or {
            "part": 0,
            "state": None,
            "chars": 0,
            "docs": 0,
            "started": {"train": False, "val": False},
        }

    def __iter__(self) -> Iterator[list[Item]]:
        pos = self.position
        while pos["part"] < len(self.corpus.parts):
            index = pos["part"]
            part = self.corpus.parts[index]
            if not (self.train_only and part.split == "val"):
                boundary = self.corpus.boundary(index) if part.split == "tail" else None
                every = max(2, round(1 / self.corpus.val_fraction)) if part.split == "every" else None
                for rows, state in part.batches(pos["state"]):
                    items: list[Item] = []
                    for text, continues in rows:
                        self.assign(part, text, continues, boundary, every, items)
                    pos["state"] = state
                    yield items
                    if self.train_only and boundary is not None and pos["chars"] >= boundary:
                        break
            self.position = pos = {**pos, "part": index + 1, "state": None, "chars": 0, "docs": 0}

    def assign(self, part: Part, text, continues: bool, boundary: int | None, every: int | None, items: list[Item]):
        """Append the items of one row: its split, and the separator before it."""
        if not part.is_text(text):
            return
        pos = self.position
        if not continues:
            pos["docs"] += 1
        start = pos["chars"]
        pos["chars"] += len(text)
        if part.split in ("train", "val"):
            self.emit(part.split, text, not continues, part.lines, items)
        elif part.split == "every":
            self.emit("val" if pos["docs"] % every == 0 else "train", text, not continues, part.lines, items)
        elif start + len(text) <= boundary:
            self.emit("train", text, not continues, part.lines, items)
        elif start >= boundary:
            self.emit("val", text, not continues, part.lines, items)
        else:  # the boundary falls inside this row: its head trains, its tail starts the validation text
            self.emit("train", text[: boundary - start], not continues, part.lines, items)
            self.emit("val", text[boundary - start :], True, part.lines, items)

    def emit(self, split: str, text: str, new_document: bool, lines: bool, items: list[Item]) -> None:
        started = self.position["started"]
        if lines:
            new_document = True
        items.append((split, text, new_document and started[split], lines))
        if not started[split] and (text.strip("\n") if lines else text):
            started[split] = True
