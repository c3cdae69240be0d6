"""From token ids to printable text, one token at a time.

Byte-level BPE splits a character such as "é" or "🙂" over several tokens; `DecodeStream` gives text
only once a character is complete, so what is printed is always whole characters. Stop strings are
looked for in the generated text; text that could still turn into one is held back until it is
clear, so a stop string is never printed, not even in part.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel, DecodeStream


class StopStrings:
    """Cuts streamed text at the first occurrence of any of the stop strings."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self.pending = ""  # text that may be the beginning of a stop string
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of text (plus what was held back) that is surely before any stop string."""
        if self.stopped:
            return ""
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self.pending = self.pending[: min(found)], ""
            return out
        hold = max((self.partial_match(stop) for stop in self.stops), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return out

    def partial_match(self, stop: str) -> int:
        """Length of the longest end of the pending text that begins `stop`."""
        for n in range(min(len(stop) - 1, len(self.pending)), 0, -1):
            if self.pending.endswith(stop[:n]):
                return n
        return 0

    def flush(self) -> str:
        """What was held back, once no more text will come."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class TextStream:
    """Token ids in, whole characters out, up to the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.stops = StopStrings(stop_strings)
        self.text = ""  # everything given out so far
        self.chars = 0  # characters the tokens so far decode to, stop strings or not

    @property
    def stopped(self) -> bool:
        """True once a stop string has appeared."""
        return self.stops.stopped

    def add(self, token: int) -> str:
        """The new printable text after one more token ("" while a character is incomplete)."""
        if self.stopped or not 0 <= token < self.vocab_size:  # ids past the tokenizer: padding rows of wte
            return ""
        decoded = self.decoder.step(self.tokenizer, token) or ""
        self.chars += len(decoded)
        out = self.stops.feed(decoded)
        self.text += out
        return out

    def finish(self) -> str:
        """Text held back for a possible stop string, given out at the end."""
        out = self.stops.flush()
        self.text += out
        return out


def visible(text: str) -> str:
    """text as a terminal should show it: control characters other than line breaks and tabs (ESC,
    backspace, \\r, which a model may write as any other byte) escaped as \\x1b, \\x08, \\r, so that
    they are seen rather than obeyed (an ESC sequence can move the cursor, clear the screen or leave
    the terminal in another colour)."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else ascii(c)[1:-1] for c in text)


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as one character in its vocabulary: the printable Latin-1
    bytes as themselves, the other bytes (controls, the space, ...) as the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(moved)}


BYTE_LEVEL_ALPHABET = byte_level_alphabet()


def token_label(tokenizer: Tokenizer, token: int) -> str:
    """A short readable label for one token: its text with spaces and line breaks made visible. A
    byte-level token that holds only part of a character shows its bytes as \\xNN ("é" is "\\xc3"
    then "\\xa9"); any other token that is no text of its own, its vocabulary entry."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    if not text or "\ufffd" in text:
        entry = tokenizer.id_to_token(token) or f"<{token}>"
        byte_level = isinstance(tokenizer.decoder, ByteLevel) and all(c in BYTE_LEVEL_ALPHABET for c in entry)
        text = bytes(BYTE_LEVEL_ALPHABET[c] for c in entry).decode(errors="backslashreplace") if byte_level else entry
    text = text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u2423")
    if text and unicodedata.category(text[0]) in ("Mn", "Me"):  # an accent alone: on a dotted circle, as
        text = "\u25cc" + text  # character charts show one, rather than on whatever is printed before it
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)  # \r, ESC: never sent to the terminal
