"""Look inside a trained model: python explain.py --prompt "ROMEO:" [--ckpt RUN_OR_CKPT] [--layer N] [--head N] [--json]

Runs the prompt once through the model and prints, step by step, one attention layer as it computes:
the real tensors' shapes and what each step means, from token ids to the residual stream after
attention. Every step uses the layer's own modules and weights, and the result is checked against the
model's own `block.attn(block.ln_1(x))`. Then two other views of the same layer: `c_attn` cut into
separate per-head q, k, v projections (the same numbers from the same parameters), and the KV cache as
generation uses it (one query against every key so far).

Loads the newest run (outputs/latest) unless --ckpt names a run folder, a .ckpt file or a Hugging Face
GPT-2 folder. Needs neither Hydra nor Lightning.
"""

from __future__ import annotations

if __name__ == "__main__":
    from shell.startup import start_up

    start_up(pause_gc=False)  # before the imports: Ctrl-C stops at once

import argparse
import json
import math
import re
import sys
import textwrap
import unicodedata
from dataclasses import dataclass, field

import torch
from torch import nn

from checkpoint import CheckpointError, given_or_newest, load_checkpoint
from generation.session import PromptError, Session
from generation.text import token_label
from model import GPT
from model.gpt import causal_mask
from shell.programs import (
    Parser,
    Terminated,
    exit_quietly,
    given_path,
    run_program,
    say_what_it_learned,
    stopped_status,
    stops_raised,
    whole_number,
)

WIDTH = 92  # columns of the text output
CODE_WIDTH = 46  # the column where shapes start
MASK_TOKENS = 8  # tokens shown in the causal-mask grid
ROW_TOKENS = 12  # weights shown of a softmax row; a longer row shows its largest


class UsageError(ValueError):
    """Bad command-line input; the message says what to change."""


@dataclass
class Step:
    """One operation of the walk: the code that ran, the shape it gave, and what it means."""

    name: str  # a short, stable key ("c_attn", "scores", ...)
    code: str
    shape: list[int]
    meaning: str
    data: dict = field(default_factory=dict)  # values worth seeing, for --json
    lines: list[str] = field(default_factory=list)  # the same values as a terminal shows them

    def to_json(self) -> dict:
        return {"name": self.name, "code": self.code, "shape": self.shape, "meaning": self.meaning, **self.data}


class Walk:
    """The steps in the order they ran."""

    def __init__(self, labels: list[str]):
        self.labels = labels  # one readable label per token
        self.steps: list[Step] = []

    def add(self, name: str, code: str, tensor: torch.Tensor, meaning: str, lines=(), **data) -> None:
        self.steps.append(Step(name, code, list(tensor.shape), meaning, data, list(lines)))


# ---- the walk ----------------------------------------------------------------------------------------


def embed(model: GPT, idx: torch.Tensor, start_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token embeddings (B, T, C), position embeddings (T, C) and their sum: the input of block 0."""
    tokens = model.transformer.wte(idx)
    positions = model.transformer.wpe(torch.arange(start_pos, start_pos + idx.size(1), device=idx.device))
    return tokens, positions, model.transformer.drop(tokens + positions)  # dropout: off in eval


def embedding_steps(walk: Walk, model: GPT, idx: torch.Tensor, layer: int) -> torch.Tensor:
    """idx (B, T) -> the input of the chosen layer, (B, T, C), through the model's own blocks."""
    c = model.config
    B, T = idx.shape
    ids = idx[0].tolist()
    listed = wrap("  ".join(f"{label}={i}" for label, i in zip(walk.labels, ids, strict=True)))
    if any(re.search(r"\\x[0-9a-f]{2}", label) for label in walk.labels):
        listed += wrap(
            "(\\xNN: a byte by its number: part of a character that byte-level BPE split over tokens, or a control character)"
        )
    walk.add(
        "idx",
        "idx",
        idx,
        f"the prompt as token ids: B = {B} sequence of T = {T} token{'s' if T > 1 else ''}",
        lines=listed,
        values=ids,
        labels=walk.labels,
    )
    tokens, positions, x = embed(model, idx)
    walk.add(
        "wte",
        "wte(idx)",
        tokens,
        f"token embeddings: row idx of wte ({c.vocab_size} x {c.n_embd}), one C = {c.n_embd} vector per token",
    )
    rows = "row 0" if T == 1 else f"rows 0..{T - 1}"
    walk.add(
        "wpe",
        "wpe(arange(T))",
        positions,
        f"position embeddings: {rows} of wpe ({c.block_size} x {c.n_embd}), the same for every sequence",
    )
    walk.add(
        "x",
        "x = wte(idx) + wpe(arange(T))",
        x,
        "what each token is plus where it stands (added, broadcast over B): the residual stream",
    )
    if layer > 0:
        for block in model.transformer.h[:layer]:
            x = block(x)
        walk.add(
            "blocks",
            f"x = h[{'0' if layer == 1 else f'0..{layer - 1}'}](x)",
            x,
            f"the model's own blocks before layer {layer}, each x + attn(ln_1(x)), then x + mlp(ln_2(x)); "
            "the width stays C",
        )
    return x


def projection_steps(walk: Walk, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x (B, T, C) -> ln_1(x) and the heads' q, k, v, each (B, nh, T, hs)."""
    attn = block.attn
    B, T, C = x.shape
    nh, hs = attn.n_head, C // attn.n_head
    x_ln = block.ln_1(x)
    walk.add(
        "ln_1",
        "ln_1(x)",
        x_ln,
        "LayerNorm: each token's vector brought to mean 0 and variance 1, then scaled and shifted by learned weights",
    )
    qkv = attn.c_attn(x_ln)
    walk.add(
        "c_attn",
        "qkv = c_attn(ln_1(x))",
        qkv,
        f"one Linear({C}, {3 * C}): the queries, keys and values of all {nh} heads in one matrix multiply",
    )
    q, k, v = qkv.split(C, dim=2)
    walk.add(
        "split",
        "q, k, v = qkv.split(C, dim=2)",
        q,
        f"three (B, T, C) tensors; in each, columns h*{hs}..h*{hs}+{hs - 1} belong to head h",
    )
    q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))
    walk.add(
        "q",
        "q.view(B, T, nh, hs).transpose(1, 2)",
        q,
        f"view cuts C = {C} into nh = {nh} heads of "
        f"hs = {hs}; transpose puts the head before the token, so each head is its own (T, hs) matrix: "
        "what each token is looking for",
    )
    walk.add("k", "k.view(B, T, nh, hs).transpose(1, 2)", k, "the keys, cut the same way: what each token offers")
    walk.add(
        "v",
        "v.view(B, T, nh, hs).transpose(1, 2)",
        v,
        "the values, cut the same way: what each token passes on to the tokens that attend to it",
    )
    return x_ln, q, k, v


def weight_steps(walk: Walk, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, head: int) -> torch.Tensor:
    """q, k (B, nh, T, hs) -> attention weights (B, nh, T, T)."""
    T, hs = q.size(2), q.size(3)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
    walk.add(
        "scores",
        "q @ k.transpose(-2, -1) / sqrt(hs)",
        scores,
        f"how well token t's query matches token s's key, in every head; dividing by sqrt({hs}) = "
        f"{math.sqrt(hs):.3f} keeps the scores from growing with hs and the softmax from saturating",
    )
    allowed = causal_mask(T, T, q.device)
    masked = scores.masked_fill(~allowed, float("-inf"))
    n = min(T, MASK_TOKENS)
    walk.add(
        "mask",
        "scores.masked_fill(~causal, -inf)",
        masked,
        "a token may attend to itself and to earlier tokens, never to later ones: it learns to predict "
        "the next token without seeing it",
        lines=mask_grid(allowed, walk.labels),
        mask=allowed[:n, :n].int().tolist(),
        mask_labels=walk.labels[:n],
    )
    att = attn.attn_dropout(torch.softmax(masked, dim=-1))  # dropout: off in eval
    row = att[0, head, T - 1].tolist()  # the last token sees every token
    walk.add(
        "softmax",
        "att = softmax(scores, dim=-1)",
        att,
        "each row becomes weights >= 0 that add up to 1 (a masked -inf becomes 0): how much each token "
        "takes from each earlier one",
        lines=row_lines(row, walk.labels, head),
        head=head,
        query=T - 1,
        row=row,
        row_sum=sum(row),
    )
    return att


def output_steps(walk: Walk, attn: nn.Module, att: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Weights (B, nh, T, T) and values (B, nh, T, hs) -> the attention output (B, T, C)."""
    B, T, C = x.shape
    y = att @ v
    walk.add(
        "att_v",
        "y = att @ v",
        y,
        "each token's output in each head: the weighted average of the value vectors of the tokens it attends to",
    )
    merged = y.transpose(1, 2).contiguous().view(B, T, C)
    walk.add(
        "merge",
        "y.transpose(1, 2).contiguous().view(B, T, C)",
        merged,
        f"the {attn.n_head} heads' outputs side by side again, hs = {C // attn.n_head} columns each",
    )
    out = attn.resid_dropout(attn.c_proj(merged))  # dropout: off in eval
    walk.add(
        "c_proj",
        "out = c_proj(y)",
        out,
        f"Linear({C}, {C}): mixes what the heads found; this is the block's attention output",
    )
    walk.add(
        "residual",
        "x + out",
        x + out,
        "the residual connection: attention adds to the stream instead of "
        "replacing it; next in the block, the MLP adds its part the same way",
    )
    return out


@torch.no_grad()
def walk_layer(model: GPT, idx: torch.Tensor, layer: int, head: int, labels: list[str]) -> dict:
    """Every step of one layer's attention; its output checked against the model's own modules."""
    walk = Walk(labels)
    x = embedding_steps(walk, model, idx, layer)
    block = model.transformer.h[layer]
    x_ln, q, k, v = projection_steps(walk, block, x)
    att = weight_steps(walk, block.attn, q, k, head)
    out = output_steps(walk, block.attn, att, v, x)
    expected = block.attn(block.ln_1(x))  # the model's own forward of this layer's attention
    return {"steps": walk.steps, "layer_max_diff": max_diff(out, expected), "x_ln": x_ln, "out": expected}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---- the same layer, two other ways ------------------------------------------------------------------


@torch.no_grad()
def per_head_linears(attn: nn.Module) -> list[list[nn.Linear]]:
    """c_attn's weight (3C, C) cut into n_head Linear(C, hs) for each of q, k and v: rows
    part*C + h*hs .. part*C + (h+1)*hs - 1 are head h's, as split(C) and view(.., nh, hs) cut the output."""
    C, nh = attn.n_embd, attn.n_head
    hs = C // nh
    weight, bias = attn.c_attn.weight, attn.c_attn.bias
    parts = []
    for part in range(3):  # q, k, v
        heads = []
        for h in range(nh):
            rows = slice(part * C + h * hs, part * C + (h + 1) * hs)
            linear = nn.Linear(C, hs, bias=bias is not None, device=weight.device, dtype=weight.dtype)
            linear.weight.copy_(weight[rows])
            if bias is not None:
                linear.bias.copy_(bias[rows])
            heads.append(linear)
        parts.append(heads)
    return parts


@torch.no_grad()
def per_head_view(attn: nn.Module, x_ln: torch.Tensor, combined_out: torch.Tensor) -> dict:
    """The attention output recomputed with separate per-head projections, against the combined c_attn."""
    B, T, C = x_ln.shape
    parts = per_head_linears(attn)
    q, k, v = (torch.stack([linear(x_ln) for linear in heads], dim=1) for heads in parts)  # (B, nh, T, hs)
    y = attn.attend(q, k, v).transpose(1, 2).contiguous().view(B, T, C)
    out = attn.resid_dropout(attn.c_proj(y))
    return {
        "per_head_max_diff": max_diff(out, combined_out),
        "per_head_params": sum(p.numel() for heads in parts for linear in heads for p in linear.parameters()),
        "combined_params": sum(p.numel() for p in attn.c_attn.parameters()),
        "per_head_linears": len(parts) * len(parts[0]),
    }


@torch.no_grad()
def kv_cache_view(model: GPT, idx: torch.Tensor, layer: int, full_out: torch.Tensor) -> dict:
    """The chosen layer for the last token as generation computes it: its one query against the keys
    and values of every position, the earlier ones read from the model's KV cache."""
    T = idx.size(1)
    if T < 2:
        return {"skipped": "the prompt is one token; the KV cache view needs at least two"}
    model.set_kv_cache(1)
    try:
        model.last_logits(idx[:, :-1])  # prefill: positions 0..T-2 written into every layer's cache
        prefilled = model.cache_length()
        x = embed(model, idx[:, -1:], start_pos=T - 1)[2]  # (1, 1, C)
        for block in model.transformer.h[:layer]:
            x = block(x, start_pos=T - 1)  # earlier layers read their own caches too
        attn = model.transformer.h[layer].attn
        q, k, v = attn.c_attn(model.transformer.h[layer].ln_1(x)).split(attn.n_embd, dim=2)
        q, k, v = (t.view(1, 1, attn.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (1, nh, 1, hs)
        keys, values, _ = attn.kv_cache.update(T - 1, k, v)  # (1, nh, S, hs): the cached positions and this one
        scores = q @ keys.transpose(-2, -1)  # (1, nh, 1, S), only for its shape: attend computes it again
        y = attn.attend(q, keys, values)  # one query, last of S: it may see every key, so no mask
        out = attn.resid_dropout(attn.c_proj(y.transpose(1, 2).contiguous().view(1, 1, attn.n_embd)))
        buffer = list(attn.kv_cache.k.shape)
    finally:
        model.clear_kv_cache()
    return {
        "prefill_tokens": prefilled,
        "cache_buffer_shape": buffer,
        "q_shape": list(q.shape),
        "k_shape": list(keys.shape),
        "v_shape": list(values.shape),
        "scores_shape": list(scores.shape),
        "output_shape": list(out.shape),
        "max_diff": max_diff(out[:, -1], full_out[:, -1]),
    }


# ---- printing ----------------------------------------------------------------------------------------


def columns(text: str) -> int:
    """The terminal columns text takes: two for a wide character (CJK, most emoji), none for a combining mark."""
    return sum(
        0 if unicodedata.category(c) in ("Mn", "Me") else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in text
    )


def short(label: str, width: int = 6) -> str:
    """label in at most width columns, cut with … where it is longer."""
    if columns(label) <= width:
        return label
    while columns(label) > width - 1:
        label = label[:-1]
    return label + "…"


def pad(text: str, width: int) -> str:
    """text and the spaces that fill it to width columns, so that what follows lines up."""
    return text + " " * (width - columns(text))


def wrap(text: str, indent: int = 4) -> list[str]:
    return textwrap.wrap(text, WIDTH - indent, break_on_hyphens=False) or [""]


def mask_grid(allowed: torch.Tensor, labels: list[str]) -> list[str]:
    """The causal mask of the first few tokens, labelled: ✓ may attend, · masked."""
    n = min(len(labels), MASK_TOKENS)
    names = [short(label) for label in labels[:n]]
    lines = wrap(
        f"the mask of the first {n} tokens (row: the token looking; column: the token looked at; "
        "✓ may attend, · set to -inf):"
    )
    lines.append((" " * 8 + "".join(pad(name, 7) for name in names)).rstrip())
    for i, name in enumerate(names):
        lines.append((pad(name, 8) + "".join(f"{'✓' if allowed[i, j] else '·':<7}" for j in range(n))).rstrip())
    return lines


def row_lines(row: list[float], labels: list[str], head: int) -> list[str]:
    """One row of a head's weights: the last token's, over every token (the largest, when there are many)."""
    T = len(row)
    shown = sorted(sorted(range(T), key=lambda s: -row[s])[:ROW_TOKENS])
    lines = wrap(
        f'head {head}, row of the last token "{labels[-1]}" (position {T - 1}): its weight on each token'
        + (f" (the {len(shown)} largest of {T}):" if len(shown) < T else ":")
    )
    lines += wrap("  ".join(f"{short(labels[s], 10)}={row[s]:.3f}" for s in shown), indent=6)
    rest = sum(row) - sum(row[s] for s in shown)
    tail = f"; the {T - len(shown)} not shown add up to {rest:.3f}" if len(shown) < T else ""
    return lines + [f"sum = {sum(row):.6f}{tail}"]


def shape_text(shape: list[int]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def heading(title: str) -> str:
    return f"\n-- {title} ".ljust(WIDTH + 1, "-")


def print_lines(lines: list[str], out) -> None:
    for line in lines:
        print("\n".join(wrap(line, indent=0)), file=out)


def print_text(report: dict, out=None) -> None:
    out = out or sys.stdout
    c, layer = report["config"], report["layer"]
    shape = (
        f"{c['n_layer']} layers of nh = {c['n_head']} heads, C = {c['n_embd']} wide (hs = C / nh = "
        f"{c['n_embd'] // c['n_head']}), block_size {c['block_size']}, vocab {c['vocab_size']}"
    )
    print_lines([f"model: {report['checkpoint']}", f"{shape}; explaining layer {layer}, head {report['head']}"], out)
    print(heading("embeddings"), file=out)
    for number, step in enumerate(report["steps"], 1):
        if step.name == "ln_1":
            print(heading(f"layer {layer}: attention, step by step"), file=out)
        print(f"{number:>2}. {step.code:<{CODE_WIDTH}} {shape_text(step.shape)}", file=out)
        for line in wrap(step.meaning) + step.lines:
            print("    " + line, file=out)
    print_lines(
        [
            "",
            (
                f"check: max |step by step - block.attn(block.ln_1(x))| = {report['layer_max_diff']:.3g} "
                "(float32 rounding: the same sums in another order)"
            ),
        ],
        out,
    )
    print_per_head(report, out)
    print_kv_cache(report, out)


def print_per_head(report: dict, out) -> None:
    c = report["config"]
    C, nh = c["n_embd"], c["n_head"]
    hs = C // nh
    print(heading("the same layer with separate per-head projections"), file=out)
    print_lines(
        [
            (
                f"c_attn.weight is ({3 * C}, {C}): rows 0..{C - 1} make q, {C}..{2 * C - 1} k, {2 * C}..{3 * C - 1} v, "
                f"and in each, head h owns the {hs} rows from h*{hs}. Cut into 3 x {nh} = {report['per_head_linears']} "
                f"separate Linear({C}, {hs}), each head computes its own q, k and v; attention recomputed with them:"
            ),
            f"max |per-head - combined| = {report['per_head_max_diff']:.3g}",
            (
                f"parameters: per-head {report['per_head_params']:,} = combined c_attn {report['combined_params']:,} "
                "(the same numbers; one matrix multiply instead of many small ones)"
            ),
        ],
        out,
    )


def print_kv_cache(report: dict, out) -> None:
    kv, T = report["kv_cache"], report["tokens"]
    print(heading("the same layer with the KV cache, as generation runs it"), file=out)
    if "skipped" in kv:
        print(kv["skipped"], file=out)
        return
    print_lines(
        [
            (
                f"prefill: model.set_kv_cache(1); model.last_logits(idx[:, :-1]) wrote the keys and values of the first "
                f"{kv['prefill_tokens']} tokens into every layer's cache (buffers {shape_text(kv['cache_buffer_shape'])}: "
                "block_size positions, filled by position). Then the last token alone:"
            ),
            f"  q of the new token       {shape_text(kv['q_shape']):<16} one query: only the newest position asks",
            f"  k, v after cache.update  {shape_text(kv['k_shape']):<16} S = {T}: every position so far",
            f"  scores q @ k^T           {shape_text(kv['scores_shape']):<16} no mask: the one query is the last",
            f"  output                   {shape_text(kv['output_shape'])}",
            f"max |cached step - full forward at the last position| = {kv['max_diff']:.3g}",
        ],
        out,
    )


def explain(model: GPT, tokenizer, ids: list[int], layer: int, head: int) -> dict:
    """The whole report on token ids (at most block_size of them): the walk through one layer, the
    per-head view and the KV-cache view. What --json prints, and what the studio's page shows."""
    idx = torch.tensor([ids], dtype=torch.long, device=model.transformer.wte.weight.device)
    labels = [token_label(tokenizer, i) for i in ids]
    walked = walk_layer(model, idx, layer, head, labels)
    attn = model.transformer.h[layer].attn
    return {
        "config": model.config.to_dict(),
        "layer": layer,
        "head": head,
        "tokens": len(ids),
        "steps": walked["steps"],
        "layer_max_diff": walked["layer_max_diff"],
        **per_head_view(attn, walked["x_ln"], walked["out"]),
        "kv_cache": kv_cache_view(model, idx, layer, walked["out"]),
    }


def to_json(report: dict) -> str:
    document = {key: value for key, value in report.items() if key != "steps"}
    document["steps"] = [step.to_json() for step in report["steps"]]
    return json.dumps(document)


# ---- the command line --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(description="Walk through one attention layer of a trained model, step by step.")
    p.add_argument("--prompt", default="", help="text to run through the model (empty: <|endoftext|>)")
    p.add_argument(
        "--ckpt",
        type=given_path,
        default=None,
        help="a run folder, .ckpt file or Hugging Face folder (default: outputs/latest)",
    )
    p.add_argument("--layer", type=whole_number, default=0, help="the layer to explain, from 0 (default 0)")
    p.add_argument(
        "--head", type=whole_number, default=0, help="the head whose attention weights are shown, from 0 (default 0)"
    )
    p.add_argument("--json", action="store_true", help="print the same as one JSON document")
    return p.parse_args(argv)


def check_index(option: str, value: int, count: int, what: str) -> None:
    if not 0 <= value < count:
        valid = "0" if count == 1 else f"0 to {count - 1}"
        raise UsageError(f"{option} {value} is out of range: this model has {count} {what}, so use {valid}")


def prompt_ids(session: Session, prompt: str) -> tuple[list[int], int]:
    """The prompt's token ids, cropped to the model's context; and how many there were before cropping."""
    ids = session.encode(prompt)
    return ids[-session.model.config.block_size :], len(ids)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; bad input ends with one `error:` line on stderr and exit status 1."""
    try:
        with stops_raised():  # Ctrl-C or SIGTERM from here: see the except below
            args = parse_args(argv)
            return run_program(lambda: run(args), UsageError, PromptError, CheckpointError)
    except (KeyboardInterrupt, Terminated) as stop:
        print(file=sys.stderr)
        return stopped_status(stop)


def run(args: argparse.Namespace) -> int:
    loaded = load_checkpoint(given_or_newest(args.ckpt))
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise CheckpointError(f"{loaded.path} carries no tokenizer, so the prompt cannot be turned into tokens")
    model, c = loaded.model, loaded.model.config
    check_index("--layer", args.layer, c.n_layer, "layers")
    check_index("--head", args.head, c.n_head, "heads per layer")
    ids, count = prompt_ids(Session(model, tokenizer, loaded.eos_token_id), args.prompt)
    if count > len(ids):
        print(
            f"[the prompt is {count} tokens, more than the model's context (block_size {c.block_size}); "
            f"explaining its last {len(ids)}]",
            file=sys.stderr,
        )
    say_what_it_learned(loaded.config)  # (the prompt and the layer and head chosen were taken)
    report = explain(model, tokenizer, ids, args.layer, args.head) | {
        "checkpoint": str(loaded.path),
        "prompt_tokens": count,
    }
    if args.json:
        print(to_json(report))
    else:
        print_text(report)
    return 0


if __name__ == "__main__":
    exit_quietly(main())
