"""Tiny real models: the one tiny shape, and models of it, untrained or trained.

`tiny_config` and `untrained_gpt`: the shape as a GPTConfig and a freshly initialised GPT of it, for
tests of the maths, where any weights do. The fixtures: a byte-level BPE trained on the tests' text
(Tiny Shakespeare where the machine has it), a GPT of the tiny shape trained on it for a few dozen
steps (so greedy decoding writes varied tokens, not one token over and over), saved two ways: as a
tinygpt2 checkpoint (the dict training writes), and as a Hugging Face folder written by
`transformers` itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from checkpoint import META_KEY, STATE_PREFIX
from data.tokenizer import train_bpe
from model import GPT, GPTConfig
from model.hf import hf_config_dict, to_hf_state_dict

TINY_SHAPE = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, dropout=0.0)
TINY_VOCAB = 64  # the vocabulary of a tiny model made without a tokenizer
EOT = "<|endoftext|>"


def tiny_config(**overrides) -> GPTConfig:
    """The tiny shape, with TINY_VOCAB tokens unless told otherwise."""
    return GPTConfig(**{**TINY_SHAPE, "vocab_size": TINY_VOCAB, **overrides})


def untrained_gpt(seed: int = 0, **overrides) -> GPT:
    """A tiny GPT as GPT-2's initialisation leaves it, in eval mode, the same for the same seed."""
    torch.manual_seed(seed)
    return GPT(tiny_config(**overrides)).eval()


def train_tiny_gpt(tokenizer: Tokenizer, text: str, steps: int = 200, seed: int = 0, **overrides) -> GPT:
    """A tiny GPT fitted for a few steps on random windows of text (seconds on a CPU)."""
    torch.manual_seed(seed)
    config = tiny_config(vocab_size=tokenizer.get_vocab_size(), **overrides)
    gpt = GPT(config)
    ids = torch.tensor(tokenizer.encode(text).ids)
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-2)
    T = config.block_size
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains fastest on one thread
    try:
        for _ in range(steps):
            starts = torch.randint(0, len(ids) - T - 1, (16,))
            batch = torch.stack([ids[s : s + T + 1] for s in starts.tolist()])
            _, loss = gpt(batch[:, :-1], batch[:, 1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return gpt.eval()


def write_checkpoint(path: Path, gpt: GPT, tokenizer: Tokenizer) -> Path:
    """What a training run's checkpoint holds for loading: prefixed weights and the `tinygpt2` key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "state_dict": {STATE_PREFIX + k: v for k, v in gpt.state_dict().items()},
            META_KEY: {"model_config": gpt.config.to_dict(), "tokenizer": tokenizer.to_str(), "config": {}},
        },
        path,
    )
    return path


def write_transformers_folder(folder: Path, gpt: GPT, tokenizer: Tokenizer) -> Path:
    """A Hugging Face folder written by transformers' own save_pretrained."""
    import transformers

    eot = tokenizer.token_to_id(EOT)
    values = {k: v for k, v in hf_config_dict(gpt.config, eot).items() if k != "architectures"}
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**values))
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(gpt.state_dict(), gpt.config), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.save_pretrained(folder)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOT, bos_token=EOT)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_text(small_text) -> str:
    return small_text.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_text) -> Tokenizer:
    return train_bpe([tiny_text], 300)


@pytest.fixture(scope="session")
def tiny_gpt(tiny_tokenizer, tiny_text) -> GPT:
    return train_tiny_gpt(tiny_tokenizer, tiny_text)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_gpt, tiny_tokenizer) -> Path:
    """A run folder holding checkpoints/last.ckpt."""
    run = tmp_path_factory.mktemp("tiny_run")
    write_checkpoint(run / "checkpoints" / "last.ckpt", tiny_gpt, tiny_tokenizer)
    return run


@pytest.fixture(scope="session")
def transformers_folder(tmp_path_factory, tiny_gpt, tiny_tokenizer) -> Path:
    return write_transformers_folder(tmp_path_factory.mktemp("hf") / "tiny-gpt2", tiny_gpt, tiny_tokenizer)
