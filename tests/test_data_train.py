"""Every source and every tokenizer trains end to end: composed configs, real Lightning runs on local data."""

from __future__ import annotations

import json
import math

import datasets
import pytest
from tokenizers import Tokenizer

from checkpoint import load_checkpoint
from data.tokenizer import EOT, train_bpe
from tests.common import NO_DOWNLOAD, TINY_OVERRIDES, find_tiny_shakespeare, hub_folder, stories, train_here


def metrics_of(run, *args: str) -> dict[str, float]:
    """`python train.py ARGS hydra.run.dir=RUN` run in this process, to its end: the metrics it recorded."""
    ran = train_here(*args, f"hydra.run.dir={run}")
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["finished"]
    return result["metrics"]


def source_overrides(kind: str, tmp_path, small_text) -> list[str]:
    """Local data for each source, and the overrides that point a run at it."""
    if kind == "txt-folder":
        folder = tmp_path / "books"
        folder.mkdir()
        text = small_text.read_text()
        for i in range(3):
            (folder / f"book{i}.txt").write_text(text[i * 20_000 : (i + 1) * 20_000])
        return ["data=text", f"data.path={folder}"]
    if kind in ("jsonl", "csv", "parquet"):
        table = datasets.Dataset.from_dict({"id": list(range(400)), "body": stories(400)})
        path = tmp_path / f"stories.{kind}"
        {
            "jsonl": lambda: table.to_json(path, lines=True),
            "csv": lambda: table.to_csv(path),
            "parquet": lambda: table.to_parquet(path),
        }[kind]()
        return ["data=text", f"data.path={path}", "data.text_column=body"]
    if kind in ("hub", "hub-streaming"):
        folder = hub_folder(tmp_path, {"train": 400, "validation": 60})
        return ["data=hub", f"data.name={folder}", f"data.streaming={kind == 'hub-streaming'}"]
    if kind == "pydoc":
        return ["data=pydoc"]
    # the default, found where the tests found it (beside the checkout), or else trained on its offline fallback
    copies = [str(found)] if (found := find_tiny_shakespeare()) else []
    return ["data=shakespeare", f"data.local_copies={copies}", f"data.url={NO_DOWNLOAD}"]


@pytest.mark.parametrize(
    "kind",
    ["txt-folder", "jsonl", "csv", "parquet", "hub", "hub-streaming", "pydoc"]
    + [pytest.param("shakespeare", marks=pytest.mark.slow)],  # (the whole text tokenized, its BPE-dropout copies too)
)
def test_each_source_trains(kind, tmp_path, small_text):
    run = tmp_path / "run"
    args = [*TINY_OVERRIDES, *source_overrides(kind, tmp_path, small_text), "trainer.max_steps=4"]
    metrics = metrics_of(run, *args, "trainer.val_check_interval=2")
    assert (run / "checkpoints" / "last.ckpt").is_file() and math.isfinite(metrics["val/bpc"])
    assert load_checkpoint(tmp_path / "run").tokenizer_json == (tmp_path / "run" / "tokenizer.json").read_text()


@pytest.mark.parametrize("kind", ["char", "pretrained"])
def test_each_tokenizer_trains(kind, tmp_path, small_text):
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("tokenizer.")]
    if kind == "pretrained":
        path = tmp_path / "tokenizer.json"
        train_bpe([small_text.read_text()], vocab_size=280).save(str(path))
        overrides += ["tokenizer=pretrained", f"tokenizer.path={path}"]
    else:
        overrides += ["tokenizer=char"]
    # data=text: no data=shakespeare sample prompts (ROMEO:, JULIET:), whose letters other text may lack
    data = ["data=text", f"data.path={small_text}"]
    metrics = metrics_of(tmp_path / "run", *overrides, *data, "trainer.max_steps=4", "trainer.val_check_interval=2")
    assert math.isfinite(metrics["val/bpc"])
    tokenizer = Tokenizer.from_str(load_checkpoint(tmp_path / "run").tokenizer_json)
    expected_vocab = 280 if kind == "pretrained" else len(set(small_text.read_text()[:54_000])) + 2
    assert tokenizer.get_vocab_size() == expected_vocab and tokenizer.token_to_id(EOT) is not None
    text = small_text.read_text()[:100]  # characters the char tokenizer saw
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    if kind == "char":  # one token per character: bits per character are the loss in bits
        assert metrics["val/bpc"] == pytest.approx(metrics["val/loss"] / math.log(2), rel=1e-5)
