"""Talk to the model: a prompt continued token by token, each token sent to the page as a server-sent
event as soon as it is sampled, with its probability and the ten tokens the model liked best after it.

Events (each `event: NAME` then `data: JSON`):
    prompt  {"tokens": [[id, label], ...]}                       the prompt as the model sees it
    token   {"id", "text", "label", "prob", "alternatives": [[id, label, prob], ...]}
    done    {"tokens", "seconds", "tokens_per_second", "finish_reason"}   ("length" or "stop")
    error   {"message"}                                          if the model fails part way
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from functools import lru_cache

import torch
from tokenizers import Tokenizer

from generation.decode import stream
from generation.lens import top_alternatives
from generation.session import Session
from generation.text import TextStream, token_label

ALTERNATIVES = 10


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class Labels:
    """token_label, remembered: the same few hundred tokens come up again and again."""

    def __init__(self, tokenizer: Tokenizer):
        self.label = lru_cache(maxsize=65536)(lambda token: token_label(tokenizer, token))

    def __call__(self, token: int) -> str:
        return self.label(token)


def step_event(logits: torch.Tensor, token: int, text: str, labels: Labels) -> str:
    """One token's event from the logits (vocab,) it was sampled from."""
    ids, probs = top_alternatives(logits, ALTERNATIVES + 1)
    chosen = torch.softmax(logits.float(), dim=-1)[token].item()
    alternatives = [
        [i, labels(i), round(p, 6)] for i, p in zip(ids.tolist(), probs.tolist(), strict=True) if i != token
    ]
    data = {
        "id": token,
        "text": text,
        "label": labels(token),
        "prob": round(chosen, 6),
        "alternatives": alternatives[:ALTERNATIVES],
    }
    return event("token", data)


def sampled(model, idx: torch.Tensor, max_new_tokens: int, **sampling) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """generation.stream's tokens, (B,), each with the logits it was sampled from, (B, vocab);
    `sampling`: stream's keyword arguments."""
    seen: list[torch.Tensor] = []
    steps = stream(model, idx, max_new_tokens, on_logits=seen.append, **sampling)
    try:
        for token in steps:
            yield seen.pop(), token
    finally:
        steps.close()


def talk(session: Session, labels: Labels, prompt: str, sampling: dict) -> Iterator[str]:
    """The events of one continuation of prompt. sampling: max_new_tokens, temperature, top_k, top_p, seed."""
    model, tokenizer = session.model, session.tokenizer
    prompt_ids = session.encode(prompt)
    yield event("prompt", {"tokens": [[i, labels(i)] for i in prompt_ids]})
    device = model.transformer.wte.weight.device
    generator = torch.Generator(device=device).manual_seed(sampling["seed"])
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
    text = TextStream(tokenizer)
    steps = sampled(
        model, idx, sampling["max_new_tokens"], temperature=sampling["temperature"], top_k=sampling["top_k"],
        top_p=sampling["top_p"], generator=generator, stop_tokens=None if session.eot is None else [session.eot],
    )  # fmt: skip
    started, count, reason = time.perf_counter(), 0, "length"
    try:
        for logits, token in steps:
            token = token.item()
            if token == session.eot:
                reason = "stop"
                break
            count += 1
            yield step_event(logits[0], token, text.add(token), labels)
    finally:
        steps.close()
    seconds = time.perf_counter() - started
    done = {"tokens": count, "seconds": round(seconds, 4), "finish_reason": reason}
    yield event("done", done | {"tokens_per_second": round(count / max(seconds, 1e-9), 2)})
