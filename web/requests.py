"""What a client may send the studio, and how a bad request is answered: a 4xx JSON error in OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`, whose `param` names the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; a request over a limit is refused, not cut."""

    max_new_tokens: int = 2048  # tokens one completion may generate
    max_prompt_chars: int = 100_000  # characters of prompt text
    max_body_bytes: int = 1_000_000  # bytes of one request
    max_choices: int = 64  # completions one request may ask for (n x prompts): lm-eval's --batch_size
    max_stops: int = 16  # stop strings (lm-eval sends a task's `until` and <|endoftext|>)
    max_logprobs: int = 20  # alternatives per token in `logprobs`


Seed = Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]
TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TalkRequest(Strict):
    """POST /api/generate: continue a prompt, token by token."""

    prompt: str = Field("", max_length=Limits.max_prompt_chars)
    max_new_tokens: StrictInt = Field(100, ge=1, le=Limits.max_new_tokens)
    temperature: float = Field(0.8, ge=0, le=100)
    top_k: StrictInt | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: Seed | None = None


class TokensRequest(Strict):
    """POST /api/lens: a sequence of token ids the page already has."""

    ids: TokenIds = Field(min_length=1, max_length=100_000)


class HeadRequest(TokensRequest):
    """POST /api/attention, /api/explain: the ids, and one layer and head to look at."""

    layer: StrictInt = Field(0, ge=0)
    head: StrictInt = Field(0, ge=0)


class CopiesRequest(Strict):
    """POST /api/copies: spans of generated tokens that occur word for word in the training text."""

    ids: TokenIds = Field(min_length=1, max_length=100_000)
    min_tokens: StrictInt = Field(8, ge=1, le=10_000)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def field_name(location: tuple) -> str | None:
    """`body.prompt.0` -> "prompt[0]"; None for the body as a whole."""
    parts = [p for p in location if p != "body"]
    if not parts:
        return None
    name = str(parts[0])
    for part in parts[1:]:
        name += f"[{part}]" if isinstance(part, int) else f".{part}"
    return name


async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
    """pydantic's complaint about the first wrong field, as one line that names it."""
    errors = err.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        return JSONResponse(error_body("the request body is not valid JSON", None), status_code=400)
    location = tuple(first.get("loc", ()))
    param = field_name(location[:2])
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == location[:2]]
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        message = "this field is not one this server takes; leave it out"
    elif len(same_field) > 1:  # a field of several accepted forms (a union): none fits
        message = f"not one of the accepted forms ({message.lower()}, ...)"
    elif len(location) > 2:
        message = f"{field_name(location)}: {message}"
    where = f"{param}: " if param else ""
    return JSONResponse(error_body(f"{where}{message}", param), status_code=400)


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(
        error_body(str(err.detail), kind="not_found" if err.status_code == 404 else "error"), err.status_code
    )


class BadRequest(ValueError):
    """A request that passed the field checks but cannot be served; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


async def bad_request(request: Request, err: BadRequest) -> JSONResponse:
    return JSONResponse(error_body(str(err), err.param), status_code=err.status)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 before it is read whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self.refuse(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except BodyTooLarge:
            await self.refuse(send)

    async def refuse(self, send) -> None:
        body = JSONResponse(error_body(f"the request is larger than {self.limit:,} bytes; send less", None), 413)
        await body({"type": "http"}, None, send)


class BodyTooLarge(Exception):
    pass
