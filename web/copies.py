"""The "what it copied" panel: the copy index of the run's own token cache (data/copies.py), opened or
built in the background when the studio starts, so that the page is usable meanwhile."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from web.requests import BadRequest

log = logging.getLogger(__name__)


class Finder:
    """The run's copy index, once it is ready; `status` says where it stands."""

    def __init__(self, settings: dict[str, Any]):
        self.index = None
        self.state, self.reason = (
            "none",
            "this model was not trained by tinygpt2 (a Hugging Face folder): no training text is known",
        )
        data, prepared = settings.get("data"), settings.get("prepared_data")
        if isinstance(data, dict) and isinstance(prepared, dict) and prepared.get("cache_key"):
            self.cache_dir = Path(str(data.get("cache_dir", "~/.cache/tinygpt2"))).expanduser()
            self.key = str(prepared["cache_key"])
            self.source = prepared.get("source")
            self.state, self.reason = "building", "the index of the training text is being built"
            threading.Thread(target=self.open, daemon=True).start()

    def open(self) -> None:
        try:
            from data.copies import open_copy_index

            self.index = open_copy_index(self.cache_dir, self.key)
        except Exception as err:  # any failure is said on the page; the rest of the studio goes on
            self.state, self.reason = "none", f"the copy index cannot be made: {err}"
            log.warning("studio: %s", self.reason)
            return
        self.state, self.reason = "ready", None

    def status(self) -> dict:
        return {"state": self.state, "reason": self.reason}

    def find(self, ids: list[int], min_tokens: int) -> dict:
        if self.index is None:
            raise BadRequest(self.reason or "no copy index", "ids", status=409)
        found = self.index.find(ids, min_tokens)
        return {"min_tokens": min_tokens, "source": self.source, "spans": [vars(copy) for copy in found]}
