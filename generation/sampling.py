"""Sampling: pure functions from last-position logits (B, vocab) to next tokens (B,)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Generators = torch.Generator | Sequence[torch.Generator] | None


def keep_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf (ties at the k-th all stay)."""
    k = min(k, logits.size(-1))
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def keep_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability adds up to at least p."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= p  # the mass before this token already reaches p
    drop_sorted[..., 0] = False  # the most likely token always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def draw(probs: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """One token per row from probs (B, vocab).

    With a sequence of generators, row i draws with generator i alone, so a row's tokens do not
    depend on which other rows share its batch.
    """
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if len(generator) != probs.size(0):
        raise ValueError(f"got {len(generator)} generators for a batch of {probs.size(0)} rows")
    rows = [torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generator, strict=True)]
    return torch.cat(rows)


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: Generators = None,
) -> torch.Tensor:
    """Next tokens (B,) from logits (B, vocab). temperature=0 is greedy (argmax)."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    return draw(probabilities(logits, temperature, top_k, top_p), generator)


def probabilities(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """The distribution (B, vocab) that sampling draws from: logits scaled by 1/temperature, cut to
    the top k, then to the top p of what is left (renormalised), then softmax. temperature > 0."""
    logits = logits.float()
    # from the row's largest logit down, so that a tiny temperature sends the rest to -inf, not the top to inf
    # (a temperature too small for the logits' type counts as the smallest it has: greedy, in effect)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(logits.dtype).tiny)
    if top_k is not None:
        logits = keep_top_k(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = keep_top_p(logits, top_p)
    return torch.softmax(logits, dim=-1)


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not 0 <= temperature < math.inf:  # NaN too
        raise ValueError(f"temperature must be 0 (greedy) or a positive number, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1 (or None to switch it off), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
