"""Looking inside a trained model, for the studio's page: what else each step could have written, where
each head attends and what kind of head it is, and what each layer would predict on its own (the logit
lens). Pure functions of the model's own forward; nothing here changes the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import GPT

# A head is called one of these when its score reaches the threshold (see `head_scores`): most of its
# attention goes where that kind of head looks.
KINDS = {"previous-token": 0.5, "first-token": 0.5, "induction": 0.4}
MIN_REPEATS = 3  # positions whose token came before, needed to score a head for induction


def top_alternatives(logits: torch.Tensor, k: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own distribution (temperature 1, nothing cut) of logits (vocab,): the k most likely
    tokens and their probabilities, each (k,), most likely first."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, min(k, probs.numel()))
    return top.indices, top.values


def token_probability(logits: torch.Tensor, token: int) -> float:
    """Probability of token under logits (vocab,), temperature 1."""
    return torch.softmax(logits.float(), dim=-1)[token].item()


@dataclass
class HeadScore:
    previous: float  # mean weight on the position just before (queries 1..T-1)
    first: float  # mean weight on position 0 (queries 1..T-1)
    induction: float | None  # mean weight on the token after an earlier copy of the query's token
    kind: str | None  # the kind it clearly is, if any (KINDS)


def head_scores(weights: list[torch.Tensor], ids: list[int]) -> list[list[HeadScore]]:
    """Every head of every layer scored from its attention weights, each (nh, T, T) for one sequence
    of token ids (T,): [layer][head]."""
    T = len(ids)
    if T < 2:
        return [[HeadScore(0.0, 0.0, None, None) for _ in layer] for layer in weights]
    rows = torch.arange(1, T)  # the queries that have a position before them
    targets = induction_targets(ids)  # (T, T) bool: where an induction head would look
    repeats = targets.any(dim=-1)  # (T,)
    scores = []
    for att in weights:  # (nh, T, T)
        att = att.float()
        previous = att[:, rows, rows - 1].mean(dim=-1)  # (nh,)
        first = att[:, rows, 0].mean(dim=-1)  # (nh,)
        induction = None
        if int(repeats.sum()) >= MIN_REPEATS:
            induction = (att * targets).sum(dim=-1)[:, repeats].mean(dim=-1)  # (nh,)
        scores.append([head_score(previous, first, induction, h) for h in range(att.size(0))])
    return scores


def head_score(previous: torch.Tensor, first: torch.Tensor, induction: torch.Tensor | None, h: int) -> HeadScore:
    values = {"previous-token": previous[h].item(), "first-token": first[h].item()}
    if induction is not None:
        values["induction"] = induction[h].item()
    clear = [(score, kind) for kind, score in values.items() if score >= KINDS[kind]]
    kind = max(clear)[1] if clear else None
    return HeadScore(values["previous-token"], values["first-token"], values.get("induction"), kind)


def induction_targets(ids: list[int]) -> torch.Tensor:
    """(T, T) bool: query t, key j + 1 where token j is token t and j + 1 < t: the token that followed
    an earlier copy of this one, which an induction head attends to (to predict that it comes again)."""
    tokens = torch.tensor(ids)
    T = tokens.numel()
    same = tokens[:, None] == tokens[None, :]  # (T, T): same[t, j]
    earlier = torch.ones(T, T, dtype=torch.bool).tril(diagonal=-2)  # j + 1 < t
    targets = torch.zeros(T, T, dtype=torch.bool)
    targets[:, 1:] = (same & earlier)[:, :-1]  # shift: key j + 1 for a match at j
    return targets


@torch.no_grad()
def logit_lens(model: GPT, idx: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """For the sequence idx (1, T): what the residual stream predicts before the first block and after
    each one, read through ln_f and lm_head as the last layer's is. Returns the top k tokens and their
    probabilities, each (n_layer + 1, T, k); row n_layer is the model's own prediction."""
    T = idx.size(1)
    x = model.transformer.drop(model.transformer.wte(idx) + model.transformer.wpe(torch.arange(T, device=idx.device)))
    streams = [x]
    for block in model.transformer.h:
        x = block(x)
        streams.append(x)
    logits = model.lm_head(model.transformer.ln_f(torch.cat(streams)))  # (n_layer + 1, T, vocab)
    top = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    return top.indices, top.values


def first_layer(top_tokens: torch.Tensor) -> list[int]:
    """For each position, the first layer (0 = the embeddings) whose top token is the final one, given
    logit_lens's top tokens (n_layer + 1, T, k)."""
    best = top_tokens[..., 0]  # (n_layer + 1, T)
    same = best == best[-1]  # (n_layer + 1, T)
    return same.int().argmax(dim=0).tolist()  # the first True of each column; the last row always is
