"""POST /v1/completions in OpenAI's completions format, so that the OpenAI client, lm-evaluation-harness's
`local-completions` model and other tools can talk to a tinygpt2 model.

Taken: model (any name: one model is served), prompt (a string, a list of them, token ids, or a list of
those), max_tokens, temperature, top_p, n, stop, seed, logprobs, echo, stream. presence_penalty,
frequency_penalty and best_of are taken at their neutral values only; anything else is refused by name.
logprobs are the model's own (temperature 1, nothing cut), whatever temperature the text was sampled at.
With echo, the prompt's tokens come first in `logprobs` (the first has none), which is how
lm-evaluation-harness scores a text: echo=true, max_tokens=1, logprobs=1, then it drops the last entry as
the new token's. So a new <|endoftext|> is listed in `logprobs` too (and counted), though the text ends
before it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from pydantic import Field, StrictBool, StrictInt

from generation.session import Session, not_utf8
from generation.text import BYTE_LEVEL_ALPHABET, TextStream
from web.requests import BadRequest, Limits, Seed, Strict
from web.talk import sampled


class CompletionRequest(Strict):
    model: str | None = None
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = ""
    max_tokens: StrictInt = Field(16, ge=0, le=Limits.max_new_tokens)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    n: StrictInt = Field(1, ge=1, le=Limits.max_choices)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=Limits.max_logprobs)
    echo: StrictBool = False
    stream: StrictBool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    best_of: StrictInt | None = None
    user: str | None = None


@dataclass
class Choice:
    text: str = ""
    finish_reason: str = "length"
    tokens: list[int] = field(default_factory=list)  # as logprobs lists them: the echoed prompt's, then the new
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)  # where each token's text begins in `text`
    completion_tokens: int = 0


@dataclass
class Sent:
    """How many of a choice's tokens the stream has sent the `logprobs` of."""

    tokens: int = 0


class Completions:
    """The endpoint's work for one model; `serve` runs under the server's model lock."""

    def __init__(self, session: Session, name: str, limits: Limits):
        self.session, self.name, self.limits = session, name, limits
        self.vocab = session.model.config.vocab_size

    def prompts(self, request: CompletionRequest) -> list[list[int]]:
        """Each prompt as token ids, checked."""
        given = request.prompt
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if not given:
            raise BadRequest("prompt: give at least one prompt", "prompt")
        if len(given) * request.n > self.limits.max_choices:
            raise BadRequest(
                f"prompt: {len(given)} prompts x n = {request.n} is more than {self.limits.max_choices} completions",
                "prompt",
            )
        return [self.prompt_ids(p, f"prompt[{i}]" if len(given) > 1 else "prompt") for i, p in enumerate(given)]

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, list):
            wrong = [t for t in prompt if not 0 <= t < self.vocab]
            if wrong:
                raise BadRequest(
                    f"{param}: token id {wrong[0]} is not in this model's vocabulary (0 to {self.vocab - 1})", param
                )
            if not prompt and self.session.eot is None:
                raise BadRequest(f"{param}: empty, and this model has no <|endoftext|> to start from", param)
            return prompt or [self.session.eot]
        if len(prompt) > self.limits.max_prompt_chars:
            raise BadRequest(f"{param}: longer than {self.limits.max_prompt_chars:,} characters", param)
        if (wrong := not_utf8(prompt)) is not None:
            raise BadRequest(f"{param}: not valid UTF-8 ({wrong})", param)
        try:
            return self.session.encode(prompt)
        except ValueError as err:
            raise BadRequest(f"{param}: {err}", param) from None

    def check(self, request: CompletionRequest) -> list[str]:
        """The stop strings; refuses what this server does not do."""
        if request.presence_penalty or request.frequency_penalty:
            param = "presence_penalty" if request.presence_penalty else "frequency_penalty"
            raise BadRequest(f"{param}: penalties are not supported; leave it out or give 0", param)
        if request.best_of not in (None, 1, request.n):
            raise BadRequest("best_of: not supported; leave it out", "best_of")
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        if len(stops) > self.limits.max_stops or any(not s for s in stops):
            raise BadRequest(f"stop: up to {self.limits.max_stops} non-empty strings", "stop")
        if request.stream and request.echo:
            raise BadRequest("echo: not supported with stream; leave one out", "echo")
        return stops

    def choices(
        self, request: CompletionRequest, prompts: list[list[int]], stops: list[str]
    ) -> Iterator[tuple[int, Choice, str]]:
        """(index, choice so far, new text) as each token comes, for every prompt x n."""
        seed = request.seed if request.seed is not None else int(torch.randint(0, 2**62, ()).item())
        for p, ids in enumerate(prompts):
            for i in range(request.n):
                index = p * request.n + i
                choice = Choice()
                if request.echo:
                    self.echo(choice, ids, request.logprobs)
                    yield index, choice, choice.text
                if request.max_tokens == 0:
                    continue
                for piece in self.sample(choice, ids, request, stops, seed + index):
                    yield index, choice, piece

    def echo(self, choice: Choice, ids: list[int], logprobs: int | None) -> None:
        """The prompt as the start of the choice: its text and, with logprobs, each token's."""
        block = self.session.model.config.block_size
        if logprobs is not None and len(ids) > block:
            raise BadRequest(
                f"prompt: {len(ids)} tokens is longer than the model's context ({block}) for echo with logprobs",
                "prompt",
            )
        choice.text = self.session.tokenizer.decode(ids)
        if logprobs is None:
            return
        device = self.session.model.transformer.wte.weight.device
        with torch.inference_mode():
            logits, _ = self.session.model(torch.tensor([ids], device=device))  # (1, T, vocab)
        choice.tokens.extend(ids)
        choice.token_logprobs.append(None)
        choice.top_logprobs.append(None)
        text = TextStream(self.session.tokenizer)
        for token in ids:  # (a token that ends a character begins at it; <|endoftext|> adds nothing)
            choice.text_offset.append(text.chars)
            text.add(token)
        for position in range(1, len(ids)):
            self.add_logprobs(choice, logits[0, position - 1], ids[position], logprobs)

    def add_logprobs(self, choice: Choice, logits: torch.Tensor, token: int, k: int) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (vocab,)
        choice.token_logprobs.append(logprobs[token].item())
        top = torch.topk(logprobs, min(k, logprobs.numel())) if k else None
        choice.top_logprobs.append(
            {self.token_text(t): v for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)}
            if top
            else {}
        )

    def sample(
        self, choice: Choice, ids: list[int], request: CompletionRequest, stops: list[str], seed: int
    ) -> Iterator[str]:
        session, model = self.session, self.session.model
        device = model.transformer.wte.weight.device
        generator = torch.Generator(device=device).manual_seed(seed)
        text = TextStream(session.tokenizer, stops)
        top_p = request.top_p if request.top_p < 1 else None
        before = len(choice.text)  # the echoed prompt's
        steps = sampled(
            model, torch.tensor([ids], device=device), request.max_tokens, temperature=request.temperature,
            top_p=top_p, generator=generator, stop_tokens=None if session.eot is None else [session.eot],
        )  # fmt: skip
        try:
            for logits, token in steps:
                token = token.item()
                choice.completion_tokens += 1
                if request.logprobs is not None:  # <|endoftext|> too: lm-eval drops the last entry as the new token's
                    choice.tokens.append(token)
                    choice.text_offset.append(before + text.chars)
                    self.add_logprobs(choice, logits[0], token, request.logprobs)
                if token == session.eot:
                    choice.finish_reason = "stop"
                    break
                piece = text.add(token)
                choice.text += piece
                yield piece
                if text.stopped:
                    choice.finish_reason = "stop"
                    break
        finally:
            steps.close()
        tail = text.finish()
        choice.text += tail
        if tail:
            yield tail

    # ---- the answer ------------------------------------------------------------------------------

    def token_text(self, token: int) -> str:
        """A token as `logprobs` lists it: its text, or where it holds part of a character, its bytes
        written as OpenAI's API writes them (bytes:\\xe2\\x80); <|endoftext|> as itself."""
        if token == self.session.eot:
            return self.session.tokenizer.decode([token], skip_special_tokens=False)
        text = self.session.tokenizer.decode([token])
        if "\ufffd" not in text:
            return text
        entry = self.session.tokenizer.id_to_token(token) or ""
        if entry and all(c in BYTE_LEVEL_ALPHABET for c in entry):
            return "bytes:" + "".join(f"\\x{BYTE_LEVEL_ALPHABET[c]:02x}" for c in entry)
        return text

    def logprobs_body(self, choice: Choice, sent: Sent | None = None) -> dict:
        """`logprobs` of the choice's tokens; given `sent`, of those after it (a streamed chunk's), and
        sent then moves past them."""
        sent = sent or Sent()
        start, sent.tokens = sent.tokens, len(choice.tokens)
        return {
            "tokens": [self.token_text(t) for t in choice.tokens[start:]],
            "token_logprobs": choice.token_logprobs[start:],
            "top_logprobs": choice.top_logprobs[start:],
            "text_offset": choice.text_offset[start:],
        }

    def head(self) -> dict:
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.name,
        }

    def answer(self, request: CompletionRequest) -> dict:
        prompts, stops = self.prompts(request), self.check(request)
        done: dict[int, Choice] = {}
        for index, choice, _ in self.choices(request, prompts, stops):
            done[index] = choice
        for index in range(len(prompts) * request.n):  # max_tokens=0 without echo yields nothing
            done.setdefault(index, Choice())
        choices = [self.choice_body(i, done[i], request) for i in sorted(done)]
        generated = sum(c.completion_tokens for c in done.values())
        prompt_tokens = sum(len(p) for p in prompts) * request.n
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated,
        }
        return self.head() | {"choices": choices, "usage": usage}

    def choice_body(self, index: int, choice: Choice, request: CompletionRequest) -> dict:
        logprobs = self.logprobs_body(choice) if request.logprobs is not None else None
        return {"text": choice.text, "index": index, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    def chunks(self, request: CompletionRequest, prompts: list[list[int]], stops: list[str]) -> Iterator[str]:
        """The streamed answer: one `data:` chunk per piece of text (with, given `logprobs`, those of the
        tokens since the last chunk), one with each finish_reason, then [DONE]."""
        head, current, sent = self.head(), None, Sent()
        for index, choice, piece in self.choices(request, prompts, stops):
            if current is not None and current[0] != index:
                yield self.chunk(head, *current, "", request, sent, finished=True)
                sent = Sent()
            current = (index, choice)
            if piece:
                yield self.chunk(head, index, choice, piece, request, sent)
        if current is not None:
            yield self.chunk(head, *current, "", request, sent, finished=True)
        yield "data: [DONE]\n\n"

    def chunk(
        self, head: dict, index: int, choice: Choice, piece: str, request: CompletionRequest, sent: Sent, finished=False
    ) -> str:
        body = {
            "text": piece,
            "index": index,
            "logprobs": self.logprobs_body(choice, sent) if request.logprobs is not None else None,
            "finish_reason": choice.finish_reason if finished else None,
        }
        return f"data: {json.dumps(head | {'choices': [body]}, ensure_ascii=False)}\n\n"
