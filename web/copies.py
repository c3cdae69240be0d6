"""The "what it copied" panel: the copy index of the run's own token cache (data/copies.py), opened or
built in the background when the studio starts, so that the page is usable meanwhile.

The index holds the training text as the tokenizer encodes it, but a model writes whatever tokens it
samples: one trained with BPE-dropout often spells a word in smaller pieces than the tokenizer would.
So the generated tokens are decoded and encoded again, as the training text was, before the lookup,
and each span found is mapped back onto the tokens the page shows through the text's characters."""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from generation.text import TextStream
from web.requests import BadRequest

log = logging.getLogger(__name__)


class Finder:
    """The run's copy index, once it is ready; `status` says where it stands."""

    def __init__(self, settings: dict[str, Any], tokenizer: Tokenizer):
        self.index, self.tokenizer = None, tokenizer
        self.state, self.reason = (
            "none",
            "no training text is known for this model (a Hugging Face folder, or a checkpoint that does not "
            "name its token cache)",
        )
        data, prepared = settings.get("data"), settings.get("prepared_data")
        if isinstance(data, dict) and isinstance(prepared, dict) and prepared.get("cache_key"):
            self.cache_dir = Path(str(data.get("cache_dir", "~/.cache/tinygpt2"))).expanduser()
            self.key = str(prepared["cache_key"])
            self.source = prepared.get("source")
            self.settings = settings
            self.state, self.reason = "building", "the index of the training text is being built"
            threading.Thread(target=self.open, daemon=True).start()

    def open(self) -> None:
        try:
            from omegaconf import OmegaConf

            from data.copies import open_copy_index, source_of_entry

            data, tokenizer = (OmegaConf.create(self.settings.get(k) or {}) for k in ("data", "tokenizer"))
            self.index = open_copy_index(self.cache_dir, self.key, source_of_entry(data, tokenizer, self.key))
        except Exception as err:  # any failure is said on the page; the rest of the studio goes on
            self.state, self.reason = "none", f"the copy index cannot be made: {err}"
            log.warning("studio: %s", self.reason)
            return
        self.state, self.reason = "ready", None

    def status(self) -> dict:
        return {"state": self.state, "reason": self.reason}

    def find(self, ids: list[int], min_tokens: int) -> dict:
        """Spans of ids (the generated tokens) found in the training text, as token positions in ids."""
        if self.index is None:
            raise BadRequest(self.reason or "no copy index", "ids", status=409)
        pieces = token_texts(self.tokenizer, ids)  # the text each token adds ("" for part of a character)
        text = "".join(pieces)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)  # as the training text was encoded
        ends = list(itertools.accumulate(len(piece) for piece in pieces))  # (len(ids),) characters so far
        spans = []
        for copy in self.index.find(encoding.ids, min_tokens):
            first_char, end_char = encoding.offsets[copy.start][0], encoding.offsets[copy.end - 1][1]
            start = bisect.bisect_right(ends, first_char)  # the token whose text holds the span's first character
            end = bisect.bisect_left(ends, end_char) + 1
            spans.append(
                vars(copy)
                | {"start": start, "end": end, "tokens": copy.end - copy.start, "text": text[first_char:end_char]}
            )
        return {"min_tokens": min_tokens, "source": self.source, "spans": spans}


def token_texts(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    stream = TextStream(tokenizer)
    return [stream.add(token) for token in ids]
