"""The studio's web app: the page and the JSON API behind it, for one loaded model.

    GET  /                  the page (static/index.html), /static/... its script and style
    GET  /api/info          the model, the run, what the page may ask
    POST /api/generate      sampling streamed as server-sent events (web.talk)
    POST /api/attention     one head's weights (T, T), every head of its layer as a small picture, every
                            head's score and kind
    POST /api/lens          the logit lens: each layer's top guesses at each position
    POST /api/explain       explain.py's walk through one layer, as `explain.py --json` prints it
    POST /api/copies        spans that occur word for word in the training text
    GET  /api/history       the run's loss curves and samples
    POST /v1/completions    OpenAI's completions format (web.completions)

The model serves one request at a time (a lock): a request that comes meanwhile waits its turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import torch
from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from checkpoint import Loaded, trained_offline
from generation.lens import first_layer, head_scores, logit_lens
from generation.session import PromptError, Session
from web import copies, history
from web.completions import CompletionRequest, Completions
from web.requests import (
    BadRequest,
    BodyLimit,
    CopiesRequest,
    HeadRequest,
    Limits,
    TalkRequest,
    TokensRequest,
    bad_request,
    http_error,
    invalid_request,
)
from web.talk import Labels, talk

STATIC = Path(__file__).parent / "static"
SEND_EVERY = 0.05  # seconds: tokens reach the page in batches no one sees as such
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A layer's heads go to the page as pictures of at most this many cells a side: all of them in full at
# GPT-2's 1,024 tokens would be 12 million numbers, for pictures shown 96 pixels wide.
PICTURE_CELLS = 96


def rounded(weights: torch.Tensor) -> torch.Tensor:
    return (weights * 1e4).round() / 1e4  # four decimals: what the page shows


def pictures(weights: torch.Tensor) -> torch.Tensor:
    """(nh, T, T) -> (nh, S, S), S = min(T, PICTURE_CELLS): each cell the largest weight of the cells it
    stands for, so that a thin line (a head that looks at the token before) stays visible."""
    if weights.size(-1) <= PICTURE_CELLS:
        return weights
    return torch.nn.functional.adaptive_max_pool2d(weights.float().cpu(), PICTURE_CELLS)  # (MPS: even sizes only)


class Studio:
    """One loaded model and what serves it."""

    def __init__(self, loaded: Loaded, limits: Limits):
        self.loaded, self.limits = loaded, limits
        self.model = loaded.model
        self.session = Session(loaded.model, loaded.tokenizer, loaded.eos_token_id)
        self.labels = Labels(loaded.tokenizer)
        self.lock = threading.Lock()
        name = loaded.path.parent.parent.name if loaded.path and loaded.path.suffix == ".ckpt" else None
        self.name = name or (loaded.path.name if loaded.path else "tinygpt2")
        self.completions = Completions(self.session, self.name, limits)
        self.copies = copies.Finder(loaded.config, loaded.tokenizer)

    def info(self) -> dict:
        c = self.model.config
        return {
            "model": self.name,
            "checkpoint": str(self.loaded.path),
            "step": self.loaded.step,
            "config": {k: getattr(c, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")},
            "offline_corpus": trained_offline(self.loaded.config),
            "copies": self.copies.status(),
            "limits": {"max_new_tokens": self.limits.max_new_tokens, "max_prompt_chars": self.limits.max_prompt_chars},
        }

    def window(self, ids: list[int]) -> list[int]:
        """ids checked against the vocabulary, cut to the model's context (its last block_size)."""
        vocab = self.model.config.vocab_size
        wrong = next((i for i in ids if i >= vocab), None)
        if wrong is not None:
            raise BadRequest(f"ids: token id {wrong} is not in this model's vocabulary (0 to {vocab - 1})", "ids")
        return ids[-self.model.config.block_size :]

    def check_layer(self, layer: int, head: int | None = None) -> None:
        c = self.model.config
        if layer >= c.n_layer:
            raise BadRequest(f"layer: {layer} is out of range; this model has layers 0 to {c.n_layer - 1}", "layer")
        if head is not None and head >= c.n_head:
            raise BadRequest(f"head: {head} is out of range; this model has heads 0 to {c.n_head - 1}", "head")

    def idx(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.model.transformer.wte.weight.device)  # (1, T)

    def attention(self, request: HeadRequest) -> dict:
        self.check_layer(request.layer, request.head)
        ids = self.window(request.ids)
        with self.lock:
            weights = [w[0] for w in self.model.attention_weights(self.idx(ids))]  # each (nh, T, T)
        scores = head_scores(weights, ids)
        chosen = weights[request.layer]  # (nh, T, T)
        return {
            "layer": request.layer,
            "head": request.head,
            "labels": [self.labels(i) for i in ids],
            "ids": ids,
            "weights": rounded(chosen[request.head]).tolist(),  # (T, T)
            "heads": rounded(pictures(chosen)).tolist(),  # (nh, S, S), S = min(T, PICTURE_CELLS)
            "scores": [[vars(s) for s in layer] for layer in scores],
        }

    def lens(self, request: TokensRequest) -> dict:
        ids = self.window(request.ids)
        with self.lock:
            tokens, probs = logit_lens(self.model, self.idx(ids), k=3)  # (n_layer + 1, T, 3)
        top = [
            [
                [[t, self.labels(t), round(p, 5)] for t, p in zip(ts, ps, strict=True)]
                for ts, ps in zip(layer_t, layer_p, strict=True)
            ]
            for layer_t, layer_p in zip(tokens.tolist(), probs.tolist(), strict=True)
        ]
        return {"labels": [self.labels(i) for i in ids], "ids": ids, "top": top, "first_layer": first_layer(tokens)}

    def explain(self, request: HeadRequest) -> dict:
        import explain  # the script's walk: the page shows what `explain.py --json` prints

        self.check_layer(request.layer, request.head)
        ids = self.window(request.ids)
        with self.lock:
            report = explain.explain(self.model, self.session.tokenizer, ids, request.layer, request.head)
        return explain.json.loads(explain.to_json(report))

    def generate(self, request: TalkRequest) -> AsyncIterator[str]:
        sampling = request.model_dump()
        if sampling["seed"] is None:
            sampling["seed"] = random.randrange(2**31)
        try:
            self.session.encode(request.prompt)
        except PromptError as err:
            raise BadRequest(f"prompt: {err}", "prompt") from None
        return in_a_thread(locked(self.lock, talk(self.session, self.labels, request.prompt, sampling)))

    def complete(self, request: CompletionRequest):
        if not request.stream:
            with self.lock:
                return self.completions.answer(request)
        prompts, stops = self.completions.prompts(request), self.completions.check(request)
        return StreamingResponse(
            in_a_thread(locked(self.lock, self.completions.chunks(request, prompts, stops))),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )


def locked(lock: threading.Lock, events: Iterator[str]) -> Iterator[str]:
    """events, produced while holding lock."""
    with lock:
        yield from events


async def in_a_thread(events: Iterator[str]) -> AsyncIterator[str]:
    """events made in a thread of their own, while the server goes on answering. One thread for the whole
    stream keeps torch's CPU threads with it, and the events reach the server's loop at most every
    SEND_EVERY seconds, gathered: each time it wakes, it takes a core from the model's threads. A client
    that leaves part way stops the stream after the token under way, which ends the sampling and lets
    the model's lock go."""
    loop, queue, leave = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

    def give(item) -> None:
        with contextlib.suppress(RuntimeError):  # the server has closed its loop: nobody waits any more
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def produce() -> None:
        pending, given = "", 0.0
        try:
            for event in events:
                pending += event
                if time.monotonic() - given >= SEND_EVERY:
                    give(pending)
                    pending, given = "", time.monotonic()
                if leave.is_set():
                    break
            give(pending)
        except Exception as err:  # noqa: BLE001 (given to the response, which fails with it)
            give(pending)
            give(err)
        finally:
            events.close()
            give(None)

    threading.Thread(target=produce, name="studio-stream", daemon=True).start()
    try:
        while (event := await queue.get()) is not None:
            if isinstance(event, Exception):
                raise event
            yield event
    finally:
        leave.set()


def make_app(loaded: Loaded, limits: Limits | None = None) -> FastAPI:
    studio = Studio(loaded, limits or Limits())
    app = FastAPI(title="tinygpt2 studio", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(BadRequest, bad_request)
    app.add_exception_handler(Exception, failed)
    app.add_middleware(BodyLimit, limit=studio.limits.max_body_bytes)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.include_router(page_routes(studio))
    app.include_router(openai_routes(studio))
    app.state.studio = studio
    return app


def page_routes(studio: Studio) -> APIRouter:
    """The page, and the JSON calls it makes."""
    router = APIRouter()

    @router.get("/")
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @router.get("/api/info")
    def info() -> dict:
        return studio.info()

    @router.post("/api/generate")
    def generate(request: TalkRequest) -> StreamingResponse:
        return StreamingResponse(studio.generate(request), media_type="text/event-stream", headers=SSE_HEADERS)

    @router.post("/api/attention")
    def attention(request: HeadRequest) -> dict:
        return studio.attention(request)

    @router.post("/api/lens")
    def lens(request: TokensRequest) -> dict:
        return studio.lens(request)

    @router.post("/api/explain")
    def explain(request: HeadRequest) -> dict:
        return studio.explain(request)

    @router.post("/api/copies")
    def copied(request: CopiesRequest) -> dict:
        return studio.copies.find(request.ids, request.min_tokens)

    @router.get("/api/history")
    def learned() -> dict:
        return history.history(studio.loaded.path)

    return router


def openai_routes(studio: Studio) -> APIRouter:
    """What OpenAI's clients call: the model list and completions."""
    router = APIRouter()

    @router.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": studio.name, "object": "model", "owned_by": "tinygpt2"}]}

    @router.post("/v1/completions", response_model=None)
    def completions(request: CompletionRequest):
        return studio.complete(request)

    return router


async def failed(request, err: Exception) -> JSONResponse:
    """A bug of ours: said in a 500, and the server goes on."""
    return JSONResponse({"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error"}}, 500)
