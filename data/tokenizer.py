"""Tokenizers, all built with HF `tokenizers` and stored as one `tokenizer.json`."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .sources import DataError

EOT = "<|endoftext|>"
BYTE_ALPHABET = 256


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """GPT-2 style byte-level BPE trained on texts, with <|endoftext|> as its one special token.

    Every byte has a token, so any text encodes and decodes back exactly.
    """
    if vocab_size < BYTE_ALPHABET + 1:
        raise DataError(
            f"tokenizer.vocab_size={vocab_size} is too small: byte-level BPE needs {BYTE_ALPHABET} byte "
            f"tokens plus {EOT}, so at least {BYTE_ALPHABET + 1}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def build_tokenizer(cfg, train_texts: list[str]) -> Tokenizer:
    """The tokenizer that tokenizer.kind asks for, trained on the training split."""
    if cfg.kind == "bpe":
        return train_bpe(train_texts, cfg.vocab_size)
    raise DataError(f"unknown tokenizer.kind {cfg.kind!r}; use bpe")


def eot_id(tokenizer: Tokenizer) -> int | None:
    return tokenizer.token_to_id(EOT)
