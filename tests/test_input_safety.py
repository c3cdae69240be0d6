"""Input that is not what it claims to be, refused in one line before anything is made: a text file that
turns into NUL bytes past its first bytes, a pretrained tokenizer whose normalizer rewrites the text, and
a Hugging Face folder whose index or links lead out of it."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import transformers
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, normalizers

import export
import generate
from data import DataError
from data.datamodule import TextDataModule
from data.tokenizer import train_bpe
from tests.common import TINY_OVERRIDES, data_config, one_error_line, refused, train_here

OPENING = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
# the tiny run, its BPE and a private token cache; the tokenizer settings are the test's own
RUN = [o for o in TINY_OVERRIDES if not o.startswith("tokenizer.")]


def program_refused(main, *args: str, capsys) -> str:
    """generate.py's or export.py's refusal, run in this process: status 1, its one error line, nothing on stdout."""
    assert main(list(args)) == 1
    out, err = capsys.readouterr()
    assert out == ""
    return one_error_line(err)


# ---- 1. a text whose bytes turn into NULs past its first 8,000 --------------------------------------------


def text_then_nuls(path, text: str, nuls: int):
    """A file of text (its bytes) followed by NUL bytes, as a disk image or a file zero-filled after a crash."""
    path.write_bytes(text.encode() + b"\0" * nuls)
    return path


def test_train_py_refuses_a_text_file_that_turns_into_nul_bytes(tmp_path, small_text):
    """Its first 8,000 bytes are text, so the check of a file's first bytes passes it; it trained on the
    NULs (val/bpc 0.018). Every block is checked as it is read, before any of it is tokenized."""
    text = small_text.read_bytes()[:8000].decode(errors="ignore")
    data = text_then_nuls(tmp_path / "disk.txt", text, 200_000)
    at = len(text.encode())
    assert refused(*RUN, f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}") == (
        f"{data} holds a NUL byte at byte {at}, so it is not text from there on; keep the text before it "
        f"(head -c {at} {data} > {tmp_path / 'disk-text.txt'}) or leave the file out"
    )  # (and nothing made: no run folder, no token cache)


def test_a_nul_byte_blocks_into_a_file_is_placed_exactly(tmp_path):
    """Read in blocks of 1 MiB, after a byte-order mark: the byte named is the file's own."""
    line = "é" * 10 + "abc\n"  # 24 bytes
    data = tmp_path / "long.txt"
    data.write_bytes(b"\xef\xbb\xbf" + (line * 60_000).encode() + b"\0" + line.encode() * 1000)
    dm = TextDataModule(data_config(tmp_path / "cache", path=str(data)), OmegaConf.create({"kind": "char"}), 32, 0, 1)
    with pytest.raises(DataError) as caught:
        dm.prepare()
    assert str(caught.value).startswith(f"{data} holds a NUL byte at byte {3 + 24 * 60_000}, so it is not text")
    assert not (tmp_path / "cache").exists()


def test_a_csv_file_that_turns_into_nul_bytes_is_refused_too(tmp_path):
    """A CSV reader passes the NULs on as characters of a text value (a JSON reader refuses them itself)."""
    rows = "".join(f"the cat sat on mat number {i}\n" for i in range(400))
    data = text_then_nuls(tmp_path / "table.csv", "text\n" + rows, 5000)
    dm = TextDataModule(data_config(tmp_path / "cache", path=str(data)), OmegaConf.create({"kind": "char"}), 32, 0, 1)
    with pytest.raises(DataError) as caught:
        dm.prepare()
    assert str(caught.value).startswith(f"{data} holds a NUL byte at byte {len(rows) + 5}, so it is not text")
    assert not (tmp_path / "cache").exists()


# ---- 2. a pretrained tokenizer whose normalizer rewrites the text ------------------------------------------


@pytest.fixture(scope="module")
def opening_text(tmp_path_factory, small_text):
    path = tmp_path_factory.mktemp("text") / "play.txt"
    path.write_text(OPENING + small_text.read_text(encoding="utf-8"), encoding="utf-8")
    return path


def saved(tokenizer: Tokenizer, path) -> str:
    tokenizer.save(str(path))
    return str(path)


def lowercasing(text: str) -> Tokenizer:
    """A byte-level BPE of the text with a Lowercase normalizer, as an uncased model's tokenizer has."""
    tokenizer = train_bpe([text.lower()], 300)
    tokenizer.normalizer = normalizers.Lowercase()
    return tokenizer


def test_train_py_refuses_a_tokenizer_whose_normalizer_rewrites_the_text(tmp_path, opening_text):
    """Its tokens decode to a lowercased text: the model would learn that, and val/bpc measure it."""
    path = saved(lowercasing(opening_text.read_text()), tmp_path / "uncased.json")
    args = [*RUN, f"data.path={opening_text}", f"data.cache_dir={tmp_path / 'cache'}", "tokenizer=pretrained"]
    assert refused(*args, f"tokenizer.path={path}") == (
        f"tokenizer.path {path}: its normalizer (Lowercase) rewrites the text ('First Citizen:' becomes "
        "'first citizen:'), so the model would learn, and val/bpc measure, that text rather than yours; use a "
        "tokenizer that keeps the text (tokenizer=bpe does), or set tokenizer.allow_normalized=true to train on "
        "it as rewritten"
    )  # (and nothing made: no run folder, no token cache)


def test_with_allow_normalized_it_trains_warning_once_and_labels_val_bpc(tmp_path, opening_text):
    path = saved(lowercasing(opening_text.read_text()), tmp_path / "uncased.json")
    ran = train_here(
        *RUN,
        f"data.path={opening_text}",
        "tokenizer=pretrained",
        f"tokenizer.path={path}",
        "tokenizer.allow_normalized=true",
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    said = (ran.stdout + ran.stderr).splitlines()
    warned = [line for line in said if "rewrites the text" in line]
    assert len(warned) == 1 and "[WARNING]" in warned[0]
    assert warned[0].endswith(
        f"tokenizer.path {path}: its normalizer (Lowercase) rewrites the text ('First Citizen:' becomes 'first "
        "citizen:'); as tokenizer.allow_normalized=true, the model learns, and val/bpc measures, the text as rewritten"
    )
    (done,) = [line for line in said if "- done: " in line]
    assert done.endswith("(val/bpc of the text as the tokenizer's normalizer rewrites it: tokenizer.allow_normalized)")


def test_a_normalizer_that_decoding_undoes_or_that_changes_nothing_here_is_kept(tmp_path, opening_text):
    """SentencePiece-style tokenizers write spaces as ▁ for the vocabulary and back as spaces when
    decoding: the text comes back, so nothing is refused. Nor is a normalizer that has nothing to change
    in this text (accents stripped from a text without any)."""
    text = opening_text.read_text().encode("ascii", "ignore").decode()
    plain = tmp_path / "plain.txt"
    plain.write_text(text)
    spaces = train_bpe([text.replace(" ", "▁")], 300)
    spaces.normalizer = normalizers.Replace(" ", "▁")
    spaces.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("▁", " ")])
    accents = train_bpe([text], 300)
    accents.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    for name, tokenizer in (("spaces", spaces), ("accents", accents)):
        cfg = OmegaConf.create({"kind": "pretrained", "path": saved(tokenizer, tmp_path / f"{name}.json")})
        dm = TextDataModule(data_config(tmp_path / "cache", path=str(plain)), cfg, 32, 0, 1)
        assert dm.tokenizer.decode(dm.prepare().ids("train").tolist()) == text[: int(len(text) * 0.9)]


# ---- 3. Hugging Face folders read weights only from inside themselves --------------------------------------


@pytest.fixture(scope="module")
def sharded(transformers_folder, tmp_path_factory):
    """The tiny model saved by transformers in shards, with an index naming them."""
    folder = tmp_path_factory.mktemp("sharded") / "model"
    transformers.GPT2LMHeadModel.from_pretrained(transformers_folder).save_pretrained(folder, max_shard_size="40KB")
    shutil.copy(transformers_folder / "tokenizer.json", folder)
    return folder


def copy_with_index(sharded, folder, point_at: str):
    """A copy of the sharded folder whose index names point_at for its first shard's tensors."""
    shutil.copytree(sharded, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: point_at if v == first else v for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_generate_py_refuses_an_index_that_names_a_file_outside_the_folder(sharded, tmp_path, capsys):
    folder = copy_with_index(sharded, tmp_path / "model", "../../../../etc/passwd")
    assert program_refused(generate.main, "--ckpt", str(folder), "--max-new-tokens", "4", capsys=capsys) == (
        f"error: the shard index {folder / 'model.safetensors.index.json'} names '../../../../etc/passwd', a file "
        f"outside {folder}; a model's weights are read only from its own folder: name each shard by its file name "
        "in the folder"
    )


def test_export_py_refuses_an_index_that_names_another_models_weights(sharded, transformers_folder, tmp_path, capsys):
    """Else the export would write, and --push-to-hub upload, another model's weights under this one's name."""
    other = os.path.relpath(transformers_folder / "model.safetensors", tmp_path / "model")
    folder = copy_with_index(sharded, tmp_path / "model", other)
    line = program_refused(export.main, "--ckpt", str(folder), "--out", str(tmp_path / "out"), capsys=capsys)
    assert line.startswith(f"error: the shard index {folder / 'model.safetensors.index.json'} names '{other}'")
    assert not (tmp_path / "out").exists()


def test_train_py_init_from_refuses_weights_that_are_a_link_out_of_the_folder(transformers_folder, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for file in ("config.json", "tokenizer.json"):
        shutil.copy(transformers_folder / file, folder)
    (folder / "model.safetensors").symlink_to(transformers_folder / "model.safetensors")
    target = transformers_folder / "model.safetensors"
    assert refused(*RUN, f"init_from={folder}", f"data.cache_dir={tmp_path / 'cache'}") == (
        f"{folder / 'model.safetensors'} is a link to {target}, outside {folder}; a model's weights are read "
        f"only from its own folder: put a copy of the file there in place of the link (cp --remove-destination "
        f"{target} {folder / 'model.safetensors'})"
    )  # (and nothing made: no run folder, no token cache)


def hub_cache_copy(transformers_folder, hub, repo: str, blob_repo: str | None = None):
    """The model as the Hugging Face cache keeps it: snapshots/REV/NAME links to ../../blobs/HASH (the
    weights' link, with blob_repo, to another cached model's blobs)."""
    snapshot = hub / repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for n, file in enumerate(sorted(transformers_folder.iterdir())):
        owner = blob_repo if blob_repo and file.name == "model.safetensors" else repo
        blob = hub / owner / "blobs" / f"{n:040x}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_a_hugging_face_cache_snapshot_reads_its_own_blobs_and_no_others(transformers_folder, tmp_path, capsys):
    hub = tmp_path / "hub"
    snapshot = hub_cache_copy(transformers_folder, hub, "models--org--tiny")
    assert generate.main(["--ckpt", str(snapshot), "--max-new-tokens", "4", "--prompt", "KING"]) == 0
    assert capsys.readouterr().out.startswith("KING")
    borrowed = hub_cache_copy(transformers_folder, hub, "models--org--borrowed", blob_repo="models--other--secret")
    line = program_refused(generate.main, "--ckpt", str(borrowed), "--max-new-tokens", "4", capsys=capsys)
    assert f"{borrowed / 'model.safetensors'} is a link to {hub / 'models--other--secret' / 'blobs'}" in line
