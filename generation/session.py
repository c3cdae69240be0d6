"""A trained model and its tokenizer, ready to continue prompts: what `generate.py` and the samples
written during training both use, so a prompt is encoded, refused and decoded the same way in both."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from data.tokenizer import EOT, UNK
from generation.decode import stream
from generation.sampling import Generators, check_sampling
from generation.text import TextStream
from model import GPT


class PromptError(ValueError):
    """A prompt this model cannot take; the message says why and what to change."""


def encode_prompt(tokenizer: Tokenizer, prompt: str, start_token: int | None) -> list[int]:
    """The prompt's token ids; an empty prompt starts from start_token (`<|endoftext|>`)."""
    check_text(prompt)
    if prompt:
        encoding = tokenizer.encode(prompt, add_special_tokens=False)
        unknown = unknown_characters(tokenizer, prompt, encoding)
        if unknown:
            shown = ", ".join(repr(c) for c in unknown)
            raise PromptError(
                f"the prompt has characters this model's tokenizer never saw in training: {shown}; "
                "leave them out or replace them"
            )
        if encoding.ids:
            return encoding.ids
    if start_token is None:
        raise PromptError(
            "the prompt is empty and this tokenizer has no <|endoftext|> token to start from; give a non-empty prompt"
        )
    return [start_token]


def check_text(prompt: str) -> None:
    """Refuse a prompt that is not Unicode text (see `not_utf8`)."""
    wrong = not_utf8(prompt)
    if wrong:
        raise PromptError(f"the prompt is not valid UTF-8: {wrong}; save or type it as UTF-8 text")


def not_utf8(text: str) -> str | None:
    """Where text is not Unicode, in words (None where it is): bytes that were not UTF-8 reach Python
    from a file or the command line as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start : err.end]
        raw = " ".join(f"0x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else repr(c) for c in bad)
        return f"byte(s) {raw} at character {err.start + 1}"
    return None


def unknown_characters(tokenizer: Tokenizer, prompt: str, encoding) -> list[str]:
    """The distinct pieces of prompt that the tokenizer could only map to its unknown token."""
    unk = tokenizer.token_to_id(UNK)
    if unk is None:
        return []
    spans = [encoding.offsets[i] for i, token in enumerate(encoding.ids) if token == unk]
    return list(dict.fromkeys(prompt[start:end] for start, end in spans))


@dataclass
class Sampling:
    """How to continue a prompt."""

    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    stop: Sequence[str] = ()  # strings that end a sample (not printed)
    use_cache: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        check_sampling(self.temperature, self.top_k, self.top_p)


@dataclass
class Completion:
    texts: list[str]  # the generated text of each sample, prompt not included
    prompt_ids: list[int]
    first_sample_ids: list[int] = field(default_factory=list)  # what sample 1 generated
    tokens: int = 0  # generated tokens, all samples together, up to where each stopped
    seconds: float = 0.0
    cache_length: int = 0  # positions the KV cache held at the last step


class Session:
    """model + tokenizer. `eot`: the token that ends a sample and starts an empty prompt (the
    tokenizer's `<|endoftext|>`, else the one given, e.g. a Hugging Face config's eos_token_id)."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, eot: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        found = tokenizer.token_to_id(EOT)
        self.eot = found if found is not None else eot

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.eot)

    def complete(
        self,
        prompt: str,
        sampling: Sampling,
        num_samples: int = 1,
        generators: Generators = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Completion:
        """Continue prompt num_samples times in one batch (row i drawing with generators[i]).
        `on_text` receives sample 1's text as it is decoded, whole characters at a time."""
        prompt_ids = self.encode(prompt)
        device = self.model.transformer.wte.weight.device
        idx = torch.tensor([prompt_ids] * num_samples, dtype=torch.long, device=device)  # (B, T)
        texts = [TextStream(self.tokenizer, sampling.stop) for _ in range(num_samples)]
        done = Completion([""] * num_samples, prompt_ids)
        started = time.perf_counter()
        steps = stream(
            self.model, idx, sampling.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p,
            use_cache=sampling.use_cache, generator=generators, stop_tokens=None if self.eot is None else [self.eot],
        )  # fmt: skip
        finished = [False] * num_samples
        for step_tokens in steps:
            done.cache_length = self.model.cache_length()
            self.take(step_tokens.tolist(), texts, finished, done, on_text)
            if all(finished):
                steps.close()  # frees the KV cache now
                break
        done.seconds = time.perf_counter() - started
        for row, text in enumerate(texts):
            tail = text.finish()
            if row == 0 and on_text and tail:
                on_text(tail)
            done.texts[row] = text.text
        return done

    def take(self, tokens: list[int], texts: list[TextStream], finished: list[bool], done: Completion, on_text) -> None:
        """One step's token of each row into its text, up to where the row ends: at <|endoftext|>, or
        at a stop string (which its TextStream holds back)."""
        for row, token in enumerate(tokens):
            if finished[row]:
                continue
            if token == self.eot:
                finished[row] = True
                continue
            done.tokens += 1
            if row == 0:
                done.first_sample_ids.append(token)
            piece = texts[row].add(token)
            if row == 0 and on_text and piece:
                on_text(piece)
            finished[row] = texts[row].stopped
