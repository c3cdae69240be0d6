"""A model trained on the offline pydoc corpus, where the quick start's Tiny Shakespeare was not to be
had, writes Python's help texts rather than a play: generate.py and explain.py say so in one line on
stderr when they load it (its checkpoint's saved settings know), and say nothing of a model that
learned the text it was given."""

from __future__ import annotations

import pytest

from checkpoint import PREPARED, trained_offline
from data.sources import OFFLINE_LABEL, PYDOC_LABEL
from shell.programs import OFFLINE_NOTE
from tests.common import NO_DOWNLOAD, TINY_OVERRIDES, only_run, run_script

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


@pytest.mark.slow
def test_a_model_trained_offline_says_so_where_it_writes(tmp_path):
    trained = run_script("train.py", *QUICK, *OFFLINE, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    run = only_run(tmp_path / "outputs")

    generated = run_script("generate.py", "--ckpt", str(run), "--prompt", "The", "--max-new-tokens", "8", cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert notes(generated.stderr) == [OFFLINE_NOTE] and "note:" not in generated.stdout
    assert "data.path=" in OFFLINE_NOTE and "not Tiny Shakespeare" in OFFLINE_NOTE

    explained = run_script("explain.py", "--ckpt", str(run), "--prompt", "The", cwd=tmp_path)
    assert explained.returncode == 0, explained.stderr[-2000:]
    assert notes(explained.stderr) == [OFFLINE_NOTE] and "note:" not in explained.stdout

    # a refused prompt (a byte that is not UTF-8) is said alone, in its one error line
    refused = run_script("generate.py", "--ckpt", str(run), "--prompt", "a\udcff", cwd=tmp_path)
    assert refused.returncode == 1
    [said] = refused.stderr.strip().splitlines()
    assert said.startswith("error: the prompt is not valid UTF-8")


@pytest.mark.slow
def test_a_model_trained_on_the_text_given_says_nothing_of_it(tmp_path, small_text):
    trained = run_script("train.py", *QUICK, *OFFLINE, f"data.path={small_text}", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    run = only_run(tmp_path / "outputs")
    generated = run_script("generate.py", "--ckpt", str(run), "--prompt", "The", "--max-new-tokens", "8", cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert notes(generated.stderr) == []
