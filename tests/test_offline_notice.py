"""A model trained on the offline pydoc corpus, where the quick start's Tiny Shakespeare was not to be
had, writes Python's help texts rather than a play: generate.py and explain.py say so in one line on
stderr when they load it (its checkpoint's saved settings know), and say nothing of a model that
learned the text it was given."""

from __future__ import annotations

import pytest

import explain
import generate
from checkpoint import PREPARED, trained_offline
from data.sources import OFFLINE_LABEL, PYDOC_LABEL
from shell.programs import OFFLINE_NOTE
from tests.common import NO_DOWNLOAD, TINY_OVERRIDES, only_run, train_here

OFFLINE = ["data.local_copies=[]", f"data.url={NO_DOWNLOAD}"]  # no copy, no network
QUICK = [*TINY_OVERRIDES, "trainer.max_steps=3", "tokenizer.dropout=0"]


@pytest.mark.parametrize(
    ("source", "prepared", "offline"),
    [
        ("shakespeare", OFFLINE_LABEL, True),  # the stand-in
        ("shakespeare", PYDOC_LABEL, True),  # the same tokens, cached first by a data=pydoc run
        ("shakespeare", "/home/me/.cache/tinygpt2/sources/tinyshakespeare/input.txt", False),
        ("pydoc", PYDOC_LABEL, False),  # chosen: the user knows
        ("text", "/data/notes.txt", False),
    ],
)
def test_the_saved_settings_tell_a_stand_in_from_a_text_asked_for(source, prepared, offline):
    assert trained_offline({"data": {"source": source}, PREPARED: {"source": prepared}}) is offline


def test_settings_that_say_nothing_of_the_data_are_no_stand_in():
    """A Hugging Face folder's (no settings), and checkpoints from before prepared_data was saved."""
    assert not trained_offline({})
    assert not trained_offline({"data": {"source": "shakespeare"}})
    assert not trained_offline({"data": "shakespeare", PREPARED: ["pydoc"]})


def notes(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("note:")]


def run_trained(tmp_path, *overrides: str):
    """A run of `python train.py OVERRIDES` (in this process): its folder."""
    trained = train_here(*overrides)
    assert trained.returncode == 0, trained.stderr[-2000:]
    return only_run(tmp_path / "outputs")


def test_a_model_trained_offline_says_so_where_it_writes(tmp_path, capsys):
    run = run_trained(tmp_path, *QUICK, *OFFLINE)

    assert generate.main(["--ckpt", str(run), "--prompt", "The", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert notes(err) == [OFFLINE_NOTE] and "note:" not in out
    assert "data.path=" in OFFLINE_NOTE and "not Tiny Shakespeare" in OFFLINE_NOTE

    assert explain.main(["--ckpt", str(run), "--prompt", "The"]) == 0
    out, err = capsys.readouterr()
    assert notes(err) == [OFFLINE_NOTE] and "note:" not in out

    # a refused prompt (a byte that is not UTF-8) is said alone, in its one error line
    assert generate.main(["--ckpt", str(run), "--prompt", "a\udcff"]) == 1
    [said] = capsys.readouterr().err.strip().splitlines()
    assert said.startswith("error: the prompt is not valid UTF-8")


def test_a_model_trained_on_the_text_given_says_nothing_of_it(tmp_path, small_text, capsys):
    run = run_trained(tmp_path, *QUICK, *OFFLINE, f"data.path={small_text}")
    assert generate.main(["--ckpt", str(run), "--prompt", "The", "--max-new-tokens", "8"]) == 0
    assert notes(capsys.readouterr().err) == []
