"""Data preparation on hostile input and hostile ends: BPE training on text without spaces, and
tokenizing workers whose parent is killed."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import data.shards
import data.tokenizer
from data.prepare import prepare_corpus
from data.shards import SPLITS, ShardEncoder
from data.tokenizer import EOT, TRAIN_RUN, train_bpe, train_char, training_pre_tokenizer
from tests.common import CHAR_TOKENIZER, ROOT, data_config

# ---- BPE training on text without spaces ------------------------------------------------------------

ONE_MB = 1_000_000


def text_without_spaces(kind: str) -> str:
    """1 MB of text that GPT-2's pre-tokenizer leaves as one word; each once took byte-level BPE
    training more than five minutes, its time growing with the square of the length."""
    if kind == "one byte":
        return "a" * ONE_MB
    if kind == "one two-byte character":
        return "é" * (ONE_MB // 2)
    return "".join(random.Random(0).choices("ACGT", k=ONE_MB))  # a DNA sequence on one line


TRAIN = """
import sys
sys.path.insert(0, {root!r})
from data.tokenizer import train_bpe
with open({text!r}, encoding="utf-8") as f:
    train_bpe([f.read()], 1024).save({out!r})
"""


@pytest.mark.parametrize("kind", ["one byte", "one two-byte character", "DNA"])
def test_bpe_learns_from_a_megabyte_without_spaces_and_encodes_it_back(tmp_path, kind):
    text = text_without_spaces(kind)
    text_file, out = tmp_path / "text.txt", tmp_path / "tokenizer.json"
    text_file.write_text(text, encoding="utf-8")
    script = TRAIN.format(root=str(ROOT), text=str(text_file), out=str(out))
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

    tokenizer = Tokenizer.from_file(str(out))
    assert tokenizer.get_vocab_size() <= 1024 and tokenizer.token_to_id(EOT) is not None
    ids = tokenizer.encode(text).ids
    assert len(ids) < len(text.encode("utf-8")) / 2  # it learnt merges from the long word
    assert tokenizer.decode(ids) == text
    # encoding uses GPT-2's pre-tokenizer, not the one training cut long words with
    assert json.loads(tokenizer.to_str())["pre_tokenizer"] == {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }


def test_bpe_training_says_it_is_still_learning_merges_off_a_terminal(monkeypatch, caplog):
    """In a log file, where the library draws no bars, merges that take long are not silence."""
    monkeypatch.setattr(data.tokenizer, "REPORT_SECONDS", 0.05)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with caplog.at_level(logging.INFO, logger="data.tokenizer"):
        train_bpe([text_without_spaces("DNA")], 2048)
    beats = [r.getMessage() for r in caplog.records if "still learning merges" in r.getMessage()]
    learning = next(i for i, r in enumerate(caplog.records) if "learning 2048 byte-level BPE tokens" in r.getMessage())
    assert beats and all(i > learning for i, r in enumerate(caplog.records) if "still learning" in r.getMessage())
    assert not [t for t in threading.enumerate() if t.name == "heartbeat"]  # stopped with the training


def test_bpe_of_ordinary_text_is_the_one_whole_words_give(small_text):
    """Cutting long words for training changes nothing where words are of ordinary length."""
    text = small_text.read_text(encoding="utf-8")
    reference = Tokenizer(models.BPE())
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    reference.train_from_iterator([text], trainer)
    assert train_bpe([text], 500).to_str() == reference.to_str()


def test_training_cuts_no_ordinary_word_and_every_long_one(small_text):
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False)
    ordinary = (
        small_text.read_text(encoding="utf-8") + "Thou art — déjà vu 🙂 \n\n  odd\tspacing\r\n中文没有空格 it's 1234"
    )
    assert training_pre_tokenizer().pre_tokenize_str(ordinary) == gpt2.pre_tokenize_str(ordinary)
    long = "x" * 1000 + " " * 600 + "!" * 700 + "7" * 300 + "\n" * 300 + "é" * 300
    words = training_pre_tokenizer().pre_tokenize_str(long)
    assert "".join(word for word, _ in words) == "".join(word for word, _ in gpt2.pre_tokenize_str(long))
    assert max(end - start for _, (start, end) in words) == TRAIN_RUN + 1  # characters: a space, then 256


def test_bpe_training_says_how_much_text_it_learns_from(small_text, caplog):
    text = small_text.read_text(encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="data.tokenizer"):
        train_bpe([text[:25_000], text[25_000:]], 300)
    assert any("300 byte-level BPE tokens from 60,000 characters" in r.getMessage() for r in caplog.records)


# ---- shard files and worker processes ---------------------------------------------------------------


def test_a_shard_cut_off_part_way_leaves_no_file(tmp_path, monkeypatch, small_text):
    """A shard file appears whole or not at all, so no run reads one its writer did not finish."""
    text = small_text.read_text(encoding="utf-8")
    encoder = ShardEncoder(train_char([text]).to_str(), tmp_path, "uint16", can_split=True)
    items = [("train", text[i : i + 10_000], i > 0, False) for i in range(0, 50_000, 10_000)]
    monkeypatch.setattr(data.shards, "ENCODE_CHARS", 10_000)  # one document a batch
    whole = encoder(0, items)
    assert (tmp_path / "000000.train.bin").stat().st_size == whole["train_tokens"] * 2

    class FailsOnThirdBatch:
        def __init__(self, tokenizer):
            self.tokenizer, self.calls = tokenizer, 0

        def encode_batch_fast(self, *args, **kwargs):
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt
            return self.tokenizer.encode_batch_fast(*args, **kwargs)

    encoder.tokenizer = FailsOnThirdBatch(encoder.tokenizer)
    with pytest.raises(KeyboardInterrupt):
        encoder(1, items)
    assert not any((tmp_path / f"000001.{split}.bin").exists() for split in SPLITS)


PREPARE = """
import sys
sys.path.insert(0, {root!r})
from omegaconf import OmegaConf
from tests.common import data_config
from data.prepare import prepare_corpus
prepare_corpus(data_config({cache!r}, path={path!r}, num_proc=2, shard_chars=20_000), OmegaConf.create({char!r}))
"""


def children(pid: int) -> list[int]:
    """The processes pid started that are still its children (Linux: /proc/<pid>/task/*/children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            pass
    return found


def started_at(pid: int) -> int | None:
    """The start time of a running process, or None where it has ended (gone, or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (name) "
    return None if fields[0] in "ZX" else int(fields[19])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds worker processes in /proc (Linux)")
def test_workers_end_with_a_killed_preparation_which_then_resumes(tmp_path, documents):
    script = PREPARE.format(root=str(ROOT), cache=str(tmp_path / "cache"), path=str(documents), char=CHAR_TOKENIZER)
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stderr=subprocess.PIPE)
    shards = tmp_path / "cache" / "tokens"
    try:
        deadline = time.monotonic() + 120
        workers: list[int] = []
        while proc.poll() is None and time.monotonic() < deadline:
            workers = children(proc.pid)
            if len(workers) >= 2 and any(shards.glob("*.partial/shards/000000.json")):
                break
            time.sleep(0.005)
        ended = proc.poll() is not None
        assert not ended and len(workers) >= 2, proc.stderr.read().decode()[-2000:] if ended else "no workers"
        running = {pid: start for pid in workers if (start := started_at(pid)) is not None}
        os.kill(proc.pid, signal.SIGKILL)  # the preparing process only: its workers are left to themselves
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(started_at(pid) == start for pid, start in running.items()):
            time.sleep(0.05)
        survivors = [pid for pid, start in running.items() if started_at(pid) == start]
        assert survivors == [], f"workers {survivors} outlived the killed preparation"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the process group, should the test fail
        proc.wait()

    done = len(list(shards.glob("*.partial/shards/*.json")))
    encoded = []
    resumed = prepare_corpus(
        data_config(tmp_path / "cache", path=str(documents), num_proc=2, shard_chars=20_000),
        OmegaConf.create(CHAR_TOKENIZER),
        progress=encoded.append,
    )
    assert encoded[0]["index"] == done  # it went on after the shards the killed run finished
    clean = prepare_corpus(
        data_config(tmp_path / "clean", path=str(documents), num_proc=1), OmegaConf.create(CHAR_TOKENIZER)
    )
    for split in SPLITS:
        assert np.array_equal(resumed.ids(split), clean.ids(split))


def test_a_file_with_no_safe_place_to_cut_is_cut_anyway_and_held_in_bounded_pieces(tmp_path, caplog):
    """Digits and spaces for 9M characters: no place where a cut keeps GPT-2's tokens (no space between
    two letters, no newline before one). The file is not carried whole (nor scanned over and over as it
    grows): it comes in pieces of at most LONGEST_UNCUT characters, cut at spaces, that join to the text,
    with one warning."""
    from data.files import LONGEST_UNCUT, document_pieces

    numbers = tmp_path / "numbers.txt"
    text = " ".join(str(n) for n in range(1_200_000))
    assert len(text) > 2 * LONGEST_UNCUT
    numbers.write_text(text)
    with caplog.at_level("WARNING", logger="data.files"):
        rows = list(document_pieces(str(numbers), "strict", 65_536))
    assert "".join(r["text"] for r in rows) == text
    assert max(len(r["text"]) for r in rows) <= LONGEST_UNCUT and len(rows) >= 3
    assert all(r["text"].startswith(" ") for r in rows[1:])  # each forced cut at a space, which goes with the next word
    assert [r["continues"] for r in rows] == [False] + [True] * (len(rows) - 1)  # one document still
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "was cut 2 time(s) anyway" in warnings[0]
