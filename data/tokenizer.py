"""Tokenizers, all built with HF `tokenizers` and stored as one `tokenizer.json` string.

    bpe         GPT-2 style byte-level BPE trained on the training split (a bounded sample of it)
    char        one token per character seen in the training split
    pretrained  an existing tokenizer.json, or a Hugging Face tokenizer folder, read from disk

Every tokenizer has `<|endoftext|>`, the token that separates documents.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from data.errors import DataError

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
UNK = "<|unk|>"  # char tokenizer: a character the training split never showed
BYTE_ALPHABET = 256
ANY_CHARACTER = r"[\s\S]"
# GPT-2's pre-tokenizer cuts text into words with this regex (tokenizers' ByteLevel uses it), then BPE
# learns merges within words. Learning a merge rewrites each word that holds the pair, in time growing
# with the square of the word's length, so a text without spaces (a DNA sequence, a file of one repeated
# byte), one word of millions of bytes, would take hours. Training therefore cuts the runs of the regex
# at TRAIN_RUN characters; ordinary text has no such runs (Tiny Shakespeare's longest word has 16).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
TRAIN_RUN = 256
REPORT_SECONDS = 10


def bpe_vocab_size_problem(vocab_size: int) -> str | None:
    """What is wrong with a byte-level BPE of vocab_size tokens, if anything."""
    if vocab_size < BYTE_ALPHABET + 1:
        return (
            f"tokenizer.vocab_size={vocab_size} is too small: byte-level BPE needs {BYTE_ALPHABET} byte "
            f"tokens plus {EOT}, so at least {BYTE_ALPHABET + 1}"
        )
    return None


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE trained on texts, with <|endoftext|> as its one special token.

    Every byte has a token, so any text encodes and decodes back exactly. Words longer than TRAIN_RUN
    characters are learnt from in pieces; the tokenizer returned encodes with GPT-2's own pre-tokenizer.
    """
    problem = bpe_vocab_size_problem(vocab_size)
    if problem:
        raise DataError(problem)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = training_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),  # the library's own bars, through the merges, where someone watches
    )
    # off a terminal the library draws nothing through the merges: a line every REPORT_SECONDS says it works on
    merging = Heartbeat("tokenizer: still learning merges, %d s so far") if not sys.stderr.isatty() else None
    try:
        tokenizer.train_from_iterator(reported(texts, vocab_size, merging), trainer)
    finally:
        if merging is not None:
            merging.stop()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if tokenizer.get_vocab_size() < vocab_size:  # every pair of the text merged: the model is sized to what there is
        log.warning(
            "tokenizer.vocab_size=%d is more than this text has merges for: the tokenizer has %d tokens, and the "
            "model that many; give a smaller tokenizer.vocab_size, or more text",
            vocab_size,
            tokenizer.get_vocab_size(),
        )
    return tokenizer


def training_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """GPT-2's byte-level pre-tokenizer, but with no word longer than TRAIN_RUN characters (plus a space)."""
    bounded = GPT2_SPLIT.replace("+", f"{{1,{TRAIN_RUN}}}")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(bounded), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class Heartbeat:
    """Once started, a log line every REPORT_SECONDS (`message` % seconds since the start) until stopped:
    a sign of life from work in a library that says nothing (it runs while the library holds no GIL)."""

    def __init__(self, message: str):
        self.message = message
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        started = time.monotonic()

        def beat() -> None:
            while not self.stopped.wait(REPORT_SECONDS):
                log.info(self.message, time.monotonic() - started)

        thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
        thread.start()
        self.thread = thread  # (only once started: a signal between the two must not leave stop() a thread to wait for)

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()


def reported(texts: Iterable[str], vocab_size: int, then: Heartbeat | None = None) -> Iterator[str]:
    """texts, passed on as they are; says every REPORT_SECONDS how much has been read, and at the end
    how much the merges are learnt from (and starts `then`, for the merges)."""
    started = last_report = time.monotonic()
    chars = 0
    for text in texts:
        yield text
        chars += len(text)
        if time.monotonic() - last_report >= REPORT_SECONDS:
            log.info("tokenizer: read %.1f M characters of the training split so far", chars / 1e6)
            last_report = time.monotonic()
    log.info(
        "tokenizer: learning %d byte-level BPE tokens from %s characters (read in %.1f s)",
        vocab_size,
        f"{chars:,}",
        time.monotonic() - started,
    )
    if then is not None:
        then.start()


def train_char(texts: Iterable[str]) -> Tokenizer:
    """One token per character, ids in character order (as char-rnn and nanoGPT's shakespeare_char),
    then <|endoftext|> and <|unk|>; decoding joins the characters back without spaces."""
    alphabet: set[str] = set()
    for text in texts:
        alphabet.update(text)
    if not alphabet:
        raise DataError("the training split holds no text to take characters from")
    vocab = {char: i for i, char in enumerate(sorted(alphabet))}
    for special in (EOT, UNK):
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(ANY_CHARACTER), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([EOT, UNK])
    return tokenizer


def load_pretrained(path: str | os.PathLike | None) -> Tokenizer:
    """A tokenizer.json file, or a folder holding one (or GPT-2's original vocab.json + merges.txt).

    Truncation and padding settings are dropped (documents are encoded whole), and <|endoftext|> is
    added as a special token if the vocabulary lacks it.
    """
    if not path:
        raise DataError(
            "tokenizer=pretrained needs tokenizer.path: a tokenizer.json or a Hugging Face tokenizer folder"
        )
    path = Path(path).expanduser()
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            tokenizer = read_tokenizer_json(path / "tokenizer.json")
        elif has_gpt2_files(path):
            try:
                tokenizer = read_gpt2_files(path)
            except (OSError, ValueError) as err:
                raise DataError(
                    f"tokenizer.path {err}; point it at GPT-2's own files, or at a folder with a tokenizer.json"
                ) from None
        else:
            raise DataError(
                f"tokenizer.path folder {path} holds no tokenizer.json (nor vocab.json + merges.txt); "
                "point it at a Hugging Face tokenizer folder or a tokenizer.json file"
            )
    elif path.is_file():
        tokenizer = read_tokenizer_json(path)
    else:
        raise DataError(
            f"tokenizer.path {path} does not exist; give a tokenizer.json or a Hugging Face tokenizer folder"
        )
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.add_special_tokens([EOT])  # keeps the id the vocabulary gives it, if it has one
    check_ids(tokenizer, path)
    return tokenizer


def check_ids(tokenizer: Tokenizer, path: Path) -> None:
    """A vocabulary the model can use: ids 0 to N-1, one token each (the model has a row per id up
    to the vocabulary's size, and the token files a width chosen from it), and a tokenizer that reads
    back as it is saved (worker processes and checkpoints carry it as its JSON)."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    ids = set(vocab.values())
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if len(ids) < len(vocab) or ids != set(range(size)):
        problem = (
            f"some of its tokens share an id ({len(vocab) - len(ids):,} more tokens than ids)"
            if len(ids) < len(vocab)
            else f"its {size:,} tokens have ids up to {max(ids):,}, not 0 to {size - 1:,}"
        )
        raise DataError(
            f"tokenizer.path {path}: {problem}; a model needs one token for each id from 0 up, so give a tokenizer "
            "whose vocabulary is numbered so (as tokenizers and transformers save them)"
        )
    try:
        Tokenizer.from_str(tokenizer.to_str())
    except Exception as err:  # the library's own error
        raise DataError(
            f"tokenizer.path {path}: the tokenizer cannot be read back once saved ({str(err).splitlines()[0]}); "
            "give a tokenizer.json that a tokenizers Tokenizer saved (tokenizer.save)"
        ) from None


def pretrained(cfg, texts: Callable[[int | None], Iterator[str]]) -> Tokenizer:
    """tokenizer.path's tokenizer, once its normalizer is seen to leave the whole training text as it is (or
    to be undone by its decoder)."""
    tokenizer = load_pretrained(cfg.get("path"))
    for text in texts(None) if tokenizer.normalizer is not None else ():
        if check_normalizer(tokenizer, text, cfg.get("path"), bool(cfg.get("allow_normalized"))):
            break  # rewritten, and allowed: said once
    return tokenizer


def check_normalizer(tokenizer: Tokenizer, text: str, path, allowed: bool) -> bool:
    """A normalizer that rewrites the text (lowercases it, strips accents, replaces characters) and whose
    rewriting decoding does not undo makes the model learn, and val/bpc measure, another text than the
    user's: refused, or with tokenizer.allow_normalized said once (returns True). A change is tried for
    decoding around where it first comes."""
    if tokenizer.normalizer is None or (normalized := tokenizer.normalizer.normalize_str(text)) == text:
        return False
    at = len(os.path.commonprefix([text, normalized]))
    around = text[max(0, at - 2000) : at + 2000]
    ids = tokenizer.encode(around, add_special_tokens=False).ids
    if tokenizer.decode(ids, skip_special_tokens=False) == around:
        return False  # rewritten for the vocabulary and written back (SentencePiece's spaces as ▁)
    what = f"tokenizer.path {path}: its normalizer ({normalizer_names(tokenizer)}) rewrites the text ({first_change(text, normalized)})"
    if not allowed:
        raise DataError(
            f"{what}, so the model would learn, and val/bpc measure, that text rather than yours; use a tokenizer "
            "that keeps the text (tokenizer=bpe does), or set tokenizer.allow_normalized=true to train on it as rewritten"
        )
    log.warning(
        "%s; as tokenizer.allow_normalized=true, the model learns, and val/bpc measures, the text as rewritten", what
    )
    return True


def normalizer_names(tokenizer: Tokenizer) -> str:
    """ "Lowercase", or "NFD, StripAccents" for a sequence of normalizers."""
    spec = json.loads(tokenizer.to_str())["normalizer"]
    return ", ".join(n.get("type", "?") for n in spec.get("normalizers", [spec]))


def first_change(text: str, rewritten: str) -> str:
    """Where two texts first differ, from the start of the word: "'First Citizen' becomes 'first citizen'"."""
    at = len(os.path.commonprefix([text, rewritten]))
    start = max(text.rfind(" ", 0, at) + 1, text.rfind("\n", 0, at) + 1, at - 12)
    return f"{line_part(text, start, at)!r} becomes {line_part(rewritten, start, at)!r}"


def line_part(text: str, start: int, at: int) -> str:
    """text from start to a few characters past at, or to the end of at's line if sooner."""
    end = text.find("\n", at + 1)
    return text[start : min(at + 16, len(text) if end < 0 else end)]


def has_gpt2_files(folder: Path) -> bool:
    return (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()


def read_gpt2_files(folder: Path) -> Tokenizer:
    """The byte-level BPE of GPT-2's original release files, `vocab.json` and `merges.txt`.
    `<|endoftext|>`, when the vocabulary has it, is a special token. Raises OSError or ValueError
    (with the library's words) for files it cannot read."""
    try:
        bpe = models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
    except Exception as err:  # the library raises its own Exception for malformed files
        raise ValueError(f"{folder}: vocab.json or merges.txt cannot be read ({err})") from None
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    if tokenizer.token_to_id(EOT) is not None:
        tokenizer.add_special_tokens([EOT])
    return tokenizer


def read_tokenizer_json(file: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # the library says only "expected value at line 1 column 1" and the like
        raise DataError(
            f"tokenizer.path {file} is not a tokenizer.json that `tokenizers` can read ({err}); give a tokenizer.json "
            "that a tokenizers Tokenizer saved (tokenizer.save), or a Hugging Face tokenizer folder"
        ) from None


def pretrained_files(path: str | os.PathLike | None) -> list[str]:
    """The files load_pretrained reads, so that a changed tokenizer is noticed."""
    if not path:
        return []
    path = Path(path).expanduser()
    if path.is_dir():
        return sorted(str(p) for p in path.iterdir() if p.name in ("tokenizer.json", "vocab.json", "merges.txt"))
    return [str(path)] if path.is_file() else []


def build_tokenizer(cfg, train_texts: Callable[[int | None], Iterator[str]]) -> Tokenizer:
    """The tokenizer that tokenizer.kind asks for (one of TOKENIZERS). train_texts(n) gives the training
    split's text, at most n characters of it spread over the whole split (None: all of it)."""
    return TOKENIZERS[cfg.kind](cfg, train_texts)


def with_dropout(tokenizer: Tokenizer, dropout: float) -> Tokenizer:
    """The same tokenizer encoding with BPE-dropout (Provilkov et al., 2020): each merge is skipped with
    probability `dropout`, so a word comes out in one of several splits, each into tokens of the same
    vocabulary. Only a BPE model has merges to skip."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise DataError(
            f"tokenizer.dropout={dropout} skips BPE merges, and this tokenizer's model is {model.get('type')}, "
            "which has none; set tokenizer.dropout=0, or use a BPE tokenizer (tokenizer=bpe)"
        )
    model["dropout"] = dropout
    return Tokenizer.from_str(json.dumps(spec))


def eot_id(tokenizer: Tokenizer) -> int | None:
    return tokenizer.token_to_id(EOT)


# ---- splitting long texts without changing their tokens ----------------------------------------------
#
# A long document is encoded in pieces (to bound memory and to spread the work), which is only right
# if the pieces give the same ids as the whole. With GPT-2's byte-level pre-tokenizer that holds at two
# kinds of places: after a newline that follows a non-space and precedes a letter ("day,\nAnd"), and
# before a space between two letters ("good| morrow"). In both, the regex ends one pre-token and starts
# the next no matter what else the text holds, and BPE never merges across pre-tokens.


def splits_safely(tokenizer: Tokenizer) -> bool:
    """True for tokenizers whose pieces at safe_cut places give the same ids as the whole text:
    byte-level BPE with GPT-2's regex and no prefix space or normalizer, and the char tokenizer."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("normalizer") is not None:
        return False
    if any(
        not t.get("special") and any(c.isspace() for c in t.get("content", "")) for t in spec.get("added_tokens", [])
    ):
        return False  # an added token may span a place that is safe to cut for the BPE ("good morrow")
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        return pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
    return pre.get("type") == "Split" and pre.get("pattern") == {"Regex": ANY_CHARACTER}


def is_safe_cut(text: str, p: int) -> bool:
    if p < 2 or p >= len(text) - 1:
        return False
    if text[p - 1] == "\n":
        return text[p].isalpha() and not text[p - 2].isspace()
    return text[p] == " " and text[p - 1].isalpha() and text[p + 1].isalpha()


def safe_cut(text: str, end: int, start: int = 0) -> int:
    """The last position p in (start, end] where text[:p] and text[p:] tokenize as the whole does;
    0 if there is none."""
    best = 0
    for mark, shift in (("\n", 1), (" ", 0)):  # a cut goes after a newline, or at a space
        at = text.rfind(mark, start + 1, end + 1 - shift)
        while at != -1 and at + shift > best and not is_safe_cut(text, at + shift):
            at = text.rfind(mark, start + 1, at)
        if at != -1 and at + shift > best:
            best = at + shift
    return best


def next_safe_cut(text: str, start: int) -> int:
    """The first safe position at or after start; 0 if none."""
    best = 0
    for mark, shift in (("\n", 1), (" ", 0)):
        at = text.find(mark, max(start - shift, 1))
        while at > 0 and (best == 0 or at + shift < best) and not is_safe_cut(text, at + shift):
            at = text.find(mark, at + 1)
        if at > 0 and (best == 0 or at + shift < best):
            best = at + shift
    return best


def safe_pieces(text: str, size: int) -> list[str]:
    """text cut at safe places into pieces of about `size` characters (longer where no place is safe)."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = safe_cut(text, start + size, start)
        if cut == 0:  # nothing safe in this stretch: go on to the first safe place after it
            cut = next_safe_cut(text, start + size)
            if cut <= start:
                break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


# tokenizer.kind's choices, and how each is made: trained on the training split, or read from disk
TOKENIZERS: dict[str, Callable] = {
    "bpe": lambda cfg, texts: train_bpe(texts(cfg.get("max_train_chars")), cfg.vocab_size),
    "char": lambda cfg, texts: train_char(texts(None)),
    "pretrained": pretrained,
}
