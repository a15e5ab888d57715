"""HTTP serving of a model folder (FastAPI + uvicorn).

Endpoints:

* ``GET /health`` — model, quantisation, context length, active and waiting requests.
* ``POST /generate`` — raw text completion: ``{"prompt", "max_tokens", "temperature",
  "top_p", "top_k", "stop", "seed", "repetition_penalty", "stream"}``. Streams by default as server-sent
  events, ``data: {"text": ...}`` per piece and a last ``data: {"done": true,
  "finish_reason", "usage"}``; with ``"stream": false`` one JSON object.
* ``GET /v1/models`` and ``POST /v1/chat/completions`` — the OpenAI chat API
  (streaming and not), applying the tokenizer's chat template, so the
  ``openai`` client and OpenAI-speaking tools work against it.

Requests are validated before any compute: an empty prompt, a prompt plus
``max_tokens`` beyond the model's context or the server's limit, or sampling
parameters out of range (``seed`` included) get a 400 with an OpenAI-style
``{"error": {...}}`` body naming the field. A request without ``max_tokens``
gets at most 128 tokens, fewer when the prompt leaves less room in the context. Generation runs in worker threads
with a KV cache (:mod:`.generation`).

Limits and access control (:class:`ServerSettings`, each a flag of ``crawl2chat serve``):

* a request body above ``max_body_bytes`` gets 413 before it is parsed; more
  than ``max_messages`` chat messages, or a prompt above ``max_prompt_chars``
  characters or ``max_prompt_tokens`` tokens, get 400;
* at most ``max_concurrent`` requests run at once (tokenisation included) and
  at most ``max_queue`` more wait for a slot; a full queue, or a wait beyond
  ``queue_timeout`` seconds, gets 503 with ``Retry-After``;
* an admitted request runs for at most ``request_timeout`` seconds: past it,
  generation stops and the answer is 504 (a stream ends with an ``error`` event);
* a client that disconnects, streaming or not, stops its generation at the
  next token and frees its slot;
* with ``api_key`` set, every route but ``/health`` needs ``Authorization:
  Bearer KEY`` (401 otherwise; the key is compared in constant time);
* CORS headers are sent only for the configured ``cors_origins`` (none by default).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable, Iterator, Literal, Optional, Union

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware

from crawl2chat.stages.inference.generation import SEED_MAX, SEED_MIN, Engine, SamplingParams, unicode_problem

DEFAULT_MAX_TOKENS = 128
API_KEY_ENV = "CRAWL2CHAT_API_KEY"
RETRY_AFTER = "1"  # seconds, in every 503
STREAM_GRACE_S = 5.0  # past its request timeout, a stream's last events may take this long to be read
OPEN_PATHS = ("/health",)  # routes that need no API key

log = logging.getLogger("crawl2chat.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.headers = status, message, param, type_, headers


def _error_body(message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


# ---------------------------------------------------------------- settings


_FLAGS = {"max_tokens_limit": "--max-tokens", "cors_origins": "--cors-origin"}
_ORIGIN = re.compile(r"^https?://[^/\s?#]+$")
_KEY = re.compile(r"^[\x21-\x7e]+$")  # visible ASCII: what an Authorization header can carry unchanged


@dataclasses.dataclass
class ServerSettings:
    """Limits and access control of the server. Every field is a flag of
    ``crawl2chat serve`` and ``python -m crawl2chat.stages.inference.serve``
    (``max_tokens_limit`` is ``--max-tokens``, ``cors_origins`` the repeatable
    ``--cors-origin``); :meth:`validated` refuses values that cannot work."""

    max_concurrent: int = 4  # requests generating at once
    max_queue: int = 16  # requests waiting for a slot beyond those
    max_tokens_limit: int = 1024  # largest max_tokens a request may ask for
    max_body_bytes: int = 1 << 20  # larger request bodies: 413
    max_messages: int = 256  # chat messages per request
    max_prompt_chars: int = 65_536  # prompt (or all message contents) in characters
    max_prompt_tokens: Optional[int] = None  # prompt in tokens; None: the model's context
    queue_timeout: float = 30.0  # seconds a request may wait for a slot: then 503
    request_timeout: float = 300.0  # seconds an admitted request may run: then generation stops
    api_key: Optional[str] = None  # required as a bearer token on every route but /health
    cors_origins: tuple[str, ...] = ()  # origins allowed cross-origin requests ("*": any)

    @staticmethod
    def flag(field: str) -> str:
        """The command-line flag of a field."""
        return _FLAGS.get(field, "--" + field.replace("_", "-"))

    def validated(self) -> "ServerSettings":
        """A checked copy; ``ValueError`` naming the flag for a value that cannot work."""
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"{self.flag(field)} {why}, got {getattr(self, field)!r}")

        for field, least in (("max_concurrent", 1), ("max_queue", 0), ("max_tokens_limit", 1),
                             ("max_body_bytes", 1), ("max_messages", 1), ("max_prompt_chars", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise bad(field, f"must be an integer of at least {least}")
        if self.max_prompt_tokens is not None and (not isinstance(self.max_prompt_tokens, int)
                                                   or self.max_prompt_tokens < 1):
            raise bad("max_prompt_tokens", "must be an integer of at least 1")
        for field in ("queue_timeout", "request_timeout"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise bad(field, "must be a positive number of seconds")
        if self.api_key is not None and not _KEY.match(self.api_key):
            raise ValueError(f"{self.flag('api_key')} (or {API_KEY_ENV}) must be non-empty visible ASCII "
                             "without spaces")
        origins = (self.cors_origins,) if isinstance(self.cors_origins, str) else tuple(self.cors_origins or ())
        for o in origins:
            if o != "*" and not _ORIGIN.match(o):
                raise ValueError(f"{self.flag('cors_origins')} takes '*' or scheme://host[:port] without a path, "
                                 f"got {o!r}")
        return dataclasses.replace(self, cors_origins=origins)


# ---------------------------------------------------------------- request schemas


def _unicode(text: str) -> str:
    if problem := unicode_problem(text):
        raise ValueError(problem)
    return text


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    repetition_penalty: float = Field(1.0, ge=1.0, le=2.0)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > 4 or any(not s for s in v):
            raise ValueError("stop takes at most 4 non-empty strings")
        return [_unicode(s) for s in v]


class GenerateRequest(_Sampling):
    prompt: str
    max_new_tokens: Optional[int] = Field(None, ge=1)  # alias of max_tokens
    stream: bool = True

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("prompt must not be empty")
        return _unicode(v)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]

    @field_validator("content")
    @classmethod
    def _valid_text(cls, v):
        _unicode(_joined(v))
        return v

    def text(self) -> str:
        return _joined(self.content)


def _joined(content: Union[str, list[TextPart]]) -> str:
    """A message's text: its string, or its text parts one after another."""
    return content if isinstance(content, str) else "".join(p.text for p in content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(_Sampling):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None

    @field_validator("messages")
    @classmethod
    def _has_content(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not any(m.text().strip() for m in v):
            raise ValueError("messages must contain some text")
        return v


# ---------------------------------------------------------------- stopping a generation


class GenerationStopped(Exception):
    """A generation ended early (raised in the generating thread between tokens)."""


class ClientGone(GenerationStopped):
    def __init__(self):
        super().__init__("the client disconnected")


class GenerationTimeout(GenerationStopped):
    pass


class RequestControl:
    """One request's stop switch and deadline, set on the event loop and read
    by the thread that generates for it between tokens."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.gone = asyncio.Event()
        self.deadline: float | None = None
        self.stopped: GenerationStopped | None = None

    def start(self) -> None:
        """The request got its slot: its time starts now."""
        self.deadline = time.monotonic() + self.timeout

    def remaining(self) -> float:
        return self.timeout if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def client_gone(self) -> None:
        self.gone.set()
        if self.stopped is None:
            self.stopped = ClientGone()

    def check(self) -> None:
        if self.stopped is not None:
            raise self.stopped
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.stopped = GenerationTimeout(f"the request ran past this server's request timeout of "
                                             f"{self.timeout:g} s")
            raise self.stopped


def guarded(tokens: Iterator[int], ctl: RequestControl) -> Iterator[int]:
    """``tokens`` while the request is wanted: raises :class:`GenerationStopped`
    between two tokens once the client has gone or the deadline has passed."""
    try:
        ctl.check()
        for tok in tokens:
            ctl.check()
            yield tok
    finally:
        close = getattr(tokens, "close", None)
        if close:
            close()


async def watch_disconnect(receive, ctl: RequestControl) -> None:
    """Wait for the client to hang up (the request body has been read), then stop its generation."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            ctl.client_gone()
            return


# ---------------------------------------------------------------- admission


class Admission:
    """At most ``max_concurrent`` running and ``max_queue`` waiting requests;
    a waiting request gets the next free slot in arrival order. Used from the
    event loop only."""

    def __init__(self, max_concurrent: int, max_queue: int):
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.active = 0
        self._queue: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def acquire(self, ctl: RequestControl | None = None, timeout: float | None = None) -> None:
        """A slot, or 503 (queue full, or no slot within ``timeout`` seconds),
        or :class:`ClientGone` when the client leaves while waiting."""
        if self.active < self.max_concurrent and not self._queue:
            self.active += 1
            return
        if len(self._queue) >= self.max_queue:
            raise APIError(503, f"server busy: {self.active} requests running and {self.waiting} waiting",
                           type_="server_busy", headers={"Retry-After": RETRY_AFTER})
        fut = asyncio.get_running_loop().create_future()
        self._queue.append(fut)
        gone = asyncio.ensure_future(ctl.gone.wait()) if ctl is not None else None
        try:
            await asyncio.wait({fut, gone} - {None}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._abandon(fut)
            raise
        finally:
            if gone is not None:
                gone.cancel()
        if fut.done():
            return  # a slot was handed over
        self._abandon(fut)
        if ctl is not None and ctl.gone.is_set():
            raise ClientGone()
        raise APIError(503, f"server busy: no generation slot became free within {timeout:g} s",
                       type_="server_busy", headers={"Retry-After": RETRY_AFTER})

    def _abandon(self, fut: asyncio.Future) -> None:
        if fut.done() and not fut.cancelled():
            self.release()  # the slot arrived just as the waiter left: pass it on
            return
        fut.cancel()
        try:
            self._queue.remove(fut)
        except ValueError:
            pass

    def release(self) -> None:
        while self._queue:
            fut = self._queue.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot goes straight to the next waiter
                return
        self.active -= 1


# ---------------------------------------------------------------- middleware (plain ASGI)


async def _send_error(scope, receive, send, status: int, message: str, type_: str, param: str | None = None,
                      headers: dict | None = None) -> None:
    await JSONResponse(status_code=status, content=_error_body(message, type_, param), headers=headers)(
        scope, receive, send)


class BodyLimit:
    """413 for a request body above ``max_bytes`` (announced or counted while
    reading, so chunked bodies are bounded too); 408 for a body that takes
    longer than ``timeout`` seconds to arrive. Smaller bodies are read here and
    handed to the application unchanged."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body exceeds this server's limit of {self.max_bytes} bytes"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(scope, receive, send, 413, too_large, "request_too_large")
        chunks, size, first = [], 0, None
        try:
            with anyio.fail_after(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        first = message  # the client left before sending its body
                        break
                    body = message.get("body", b"")
                    size += len(body)
                    if size > self.max_bytes:
                        return await _send_error(scope, receive, send, 413, too_large, "request_too_large")
                    chunks.append(body)
                    if not message.get("more_body", False):
                        first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                        break
        except TimeoutError:
            return await _send_error(scope, receive, send, 408, f"request body not received within {self.timeout:g} s",
                                     "timeout")
        pending = [first]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


class BearerAuth:
    """401 for every route but ``open_paths`` without ``Authorization: Bearer KEY``."""

    def __init__(self, app, api_key: str, open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app, self.open_paths = app, open_paths
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def authorised(self, header: bytes | None) -> bool:
        scheme, _, token = (header or b"").partition(b" ")
        # digests of equal length, compared in constant time: neither the key nor its length leaks
        ok = hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths or \
                self.authorised(dict(scope["headers"]).get(b"authorization")):
            return await self.app(scope, receive, send)
        await _send_error(scope, receive, send, 401, "missing or invalid API key: send 'Authorization: Bearer KEY'",
                          "authentication_error", headers={"WWW-Authenticate": "Bearer"})


# ---------------------------------------------------------------- streamed generations


class GenerationStream(Response):
    """A generation streamed as server-sent events. ``events`` is a sync
    iterator advanced in worker threads; the response listens for the client
    hanging up (the generation then stops at its next token), ends a
    generation stopped by its deadline with an ``error`` event, gives a client
    that stops reading ``STREAM_GRACE_S`` past the deadline, and releases the
    request's admission slot however the stream ends."""

    media_type = "text/event-stream"

    def __init__(self, events: Iterator[str], ctl: RequestControl, release: Callable[[], None]):
        self.events, self.ctl, self.release = events, ctl, release
        self.status_code, self.background = 200, None
        self._finished = False
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def watch():
                    await watch_disconnect(receive, self.ctl)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                with anyio.move_on_after(self.ctl.remaining() + STREAM_GRACE_S):
                    await self._stream(send)
                    await self._finish()  # the slot is free before the client sees the end of the stream
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:
            pass  # the connection broke under a write
        finally:
            await self._finish()

    async def _finish(self) -> None:
        """Stop and close the generation and release the slot (once)."""
        if self._finished:
            return
        self._finished = True
        if self.ctl.stopped is None:
            self.ctl.client_gone()  # whatever ended the response, the generation is not wanted any more
        with anyio.CancelScope(shield=True):
            try:
                await run_in_threadpool(self.events.close)
            finally:
                self.release()

    async def _stream(self, send) -> None:
        """The status line and every event (not the end of the body)."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        while True:
            last = False  # an error event ends the stream
            try:
                item = await run_in_threadpool(next, self.events, None)
            except ClientGone:
                return
            except GenerationTimeout as e:
                item, last = _sse(_error_body(str(e), "timeout")), True
            except Exception as e:  # noqa: BLE001 - the status line is sent: say so in the stream
                log.exception("generation failed")
                item, last = _sse(_error_body(f"generation failed: {type(e).__name__}", "server_error")), True
            if item is None:
                return
            await send({"type": "http.response.body", "body": item.encode(), "more_body": True})
            if last:
                return


# ---------------------------------------------------------------- app


def create_app(engine: Engine, settings: ServerSettings | None = None, *, model_name: str | None = None,
               **fields: Any) -> FastAPI:
    """The FastAPI application serving ``engine``. ``fields`` override single
    :class:`ServerSettings` fields (``max_concurrent=2``); invalid settings
    raise ``ValueError`` naming the flag."""
    settings = dataclasses.replace(settings or ServerSettings(), **fields).validated()
    app = FastAPI(title="crawl2chat", version="1")
    admission = Admission(settings.max_concurrent, settings.max_queue)
    name = model_name or engine.model_dir.rstrip("/").split("/")[-1] or "model"
    app.state.engine, app.state.admission, app.state.settings = engine, admission, settings
    # added innermost first: CORS (outermost) answers preflights, then the key, then the body bound
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout=settings.request_timeout)
    if settings.api_key is not None:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":  # its location is a character offset, not a field
            where = first.get("loc", ("body", "?"))[-1]
            why = (first.get("ctx") or {}).get("error", "JSON decode error")
            return JSONResponse(status_code=400, content=_error_body(
                f"the body is not valid JSON: {why} (at character {where})", "invalid_request_error"))
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs)
        return JSONResponse(status_code=400, content=_error_body(msg or "invalid request", "invalid_request_error", param))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(status_code=exc.status, content=_error_body(exc.message, exc.type, exc.param),
                            headers=exc.headers)

    def sampling(req: _Sampling, max_tokens: int | None) -> SamplingParams:
        n = max_tokens or DEFAULT_MAX_TOKENS
        if n > settings.max_tokens_limit:
            raise APIError(400, f"max_tokens {n} exceeds this server's limit of {settings.max_tokens_limit}",
                           "max_tokens")
        params = SamplingParams(max_new_tokens=n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                stop=tuple(req.stop or ()), seed=req.seed,
                                repetition_penalty=req.repetition_penalty)
        try:
            params.validate()
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return params

    def check_chars(n_chars: int, field: str) -> None:
        if n_chars > settings.max_prompt_chars:
            raise APIError(400, f"{field} is {n_chars} characters; this server accepts at most "
                           f"{settings.max_prompt_chars} characters", field)

    def check(prompt_ids: list[int], params: SamplingParams, field: str, fit: bool) -> None:
        limit = settings.max_prompt_tokens
        if limit is not None and len(prompt_ids) > limit:
            raise APIError(400, f"{field} is {len(prompt_ids)} tokens; this server accepts at most {limit} tokens",
                           field)
        if fit and len(prompt_ids) >= engine.max_context:  # no max_tokens asked for: the prompt alone fills it
            raise APIError(400, f"{field} is {len(prompt_ids)} tokens, which leaves no room for a reply in the "
                           f"model's context of {engine.max_context} tokens", field)
        if fit:  # no max_tokens asked for: the default, or what the context leaves when that is less
            params.max_new_tokens = max(1, min(params.max_new_tokens, engine.max_context - len(prompt_ids)))
        try:
            engine.check_length(prompt_ids, params.max_new_tokens)
        except ValueError as e:
            raise APIError(400, str(e), "max_tokens" if prompt_ids else field) from None

    async def run(request: Request, field: str, tokenize: Callable[[], list[int]], params: SamplingParams,
                  stream: bool, produce: Callable[[list[int], RequestControl], Any], fit: bool = False):
        """Admit the request, tokenise and check its prompt inside its slot,
        then generate: ``produce(prompt_ids, ctl)`` is the response body (in a
        worker thread) or, with ``stream``, the event iterator of a
        :class:`GenerationStream` that takes the slot over."""
        ctl = RequestControl(settings.request_timeout)
        watcher = asyncio.ensure_future(watch_disconnect(request.receive, ctl))
        held = False
        try:
            await admission.acquire(ctl, settings.queue_timeout)
            held = True
            ctl.start()
            prompt_ids = await run_in_threadpool(tokenize)
            check(prompt_ids, params, field, fit)
            ctl.check()
            if not stream:
                return await run_in_threadpool(produce, prompt_ids, ctl)
            watcher.cancel()
            await asyncio.wait({watcher})  # the response listens to the connection from here on
            response, held = GenerationStream(produce(prompt_ids, ctl), ctl, admission.release), False
            return response
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except GenerationTimeout as e:
            raise APIError(504, str(e), type_="timeout") from None
        finally:
            watcher.cancel()
            if held:
                admission.release()

    def text_stream(prompt_ids: list[int], params: SamplingParams, ctl: RequestControl):
        ts = engine.stream(prompt_ids, params)
        ts.tokens = guarded(ts.tokens, ctl)
        return ts

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "quantize": engine.quantize, "max_context": engine.max_context,
                "active": admission.active, "waiting": admission.waiting,
                "max_concurrent": admission.max_concurrent, "max_queue": admission.max_queue}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "crawl2chat"}]}

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request):
        params = sampling(req, req.max_new_tokens or req.max_tokens)
        check_chars(len(req.prompt), "prompt")

        def usage(prompt_ids, ts):
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": ts.completion_tokens,
                    "total_tokens": len(prompt_ids) + ts.completion_tokens}

        def whole(prompt_ids, ctl):
            ts = text_stream(prompt_ids, params, ctl)
            text = "".join(ts.deltas())
            return {"text": text, "finish_reason": ts.finish_reason, "usage": usage(prompt_ids, ts)}

        def events(prompt_ids, ctl):
            ts = text_stream(prompt_ids, params, ctl)
            for delta in ts.deltas():
                yield _sse({"text": delta})
            yield _sse({"done": True, "text": ts.text, "finish_reason": ts.finish_reason,
                        "usage": usage(prompt_ids, ts)})

        return await run(request, "prompt", lambda: engine.prompt_ids(req.prompt), params, req.stream,
                         events if req.stream else whole, fit=not (req.max_new_tokens or req.max_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        params = sampling(req, req.max_completion_tokens or req.max_tokens)
        if len(req.messages) > settings.max_messages:
            raise APIError(400, f"messages has {len(req.messages)} entries; this server accepts at most "
                           f"{settings.max_messages}", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        check_chars(sum(len(m["content"]) for m in messages), "messages")
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def usage(prompt_ids, ts):
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": ts.completion_tokens,
                    "total_tokens": len(prompt_ids) + ts.completion_tokens}

        def whole(prompt_ids, ctl):
            ts = text_stream(prompt_ids, params, ctl)
            text = "".join(ts.deltas())
            return {"id": cid, "object": "chat.completion", "created": created, "model": name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": ts.finish_reason, "logprobs": None}],
                    "usage": usage(prompt_ids, ts)}

        def chunk(delta: dict, finish: str | None = None) -> str:
            return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def events(prompt_ids, ctl):
            ts = text_stream(prompt_ids, params, ctl)
            yield chunk({"role": "assistant", "content": ""})
            for delta in ts.deltas():
                yield chunk({"content": delta})
            yield chunk({}, ts.finish_reason)
            if include_usage:
                yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                            "choices": [], "usage": usage(prompt_ids, ts)})
            yield "data: [DONE]\n\n"

        return await run(request, "messages", lambda: engine.chat_prompt_ids(messages), params, req.stream,
                         events if req.stream else whole, fit=not (req.max_completion_tokens or req.max_tokens))

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------- running


class ServerThread:
    """uvicorn serving ``app`` in a background thread on an already bound
    socket (port 0 picks a free port); ``url`` is where it listens."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, quantize: str | None = None,
          log_level: str = "info", settings: ServerSettings | None = None, **fields: Any) -> None:
    """Load ``model_dir`` and serve it until interrupted. ``settings`` and
    ``fields`` as for :func:`create_app`; they are checked before the model loads."""
    import uvicorn

    settings = dataclasses.replace(settings or ServerSettings(), **fields).validated()
    engine = Engine(model_dir, quantize=quantize)
    uvicorn.run(create_app(engine, settings), host=host, port=port, log_level=log_level)


def add_arguments(p) -> None:
    """The server's flags on an ``argparse`` parser (defaults from :class:`ServerSettings`)."""
    d = ServerSettings()
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent, help="requests generating at once")
    p.add_argument("--max-queue", type=int, default=d.max_queue, help="requests waiting beyond those; more get 503")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens_limit, help="largest max_tokens a request may ask")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get 413")
    p.add_argument("--max-messages", type=int, default=d.max_messages, help="chat messages per request")
    p.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars, help="prompt length in characters")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="prompt length in tokens (default: context)")
    p.add_argument("--queue-timeout", type=float, default=d.queue_timeout, help="seconds waiting for a slot: 503")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds an admitted request may run before its generation stops")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"bearer token required on every route but /health (default: ${API_KEY_ENV})")
    p.add_argument("--cors-origin", action="append", default=[], help="origin allowed cross-origin requests "
                   "(repeatable; '*' for any); none by default")


def settings_from_args(a) -> ServerSettings:
    return ServerSettings(max_concurrent=a.max_concurrent, max_queue=a.max_queue, max_tokens_limit=a.max_tokens,
                          max_body_bytes=a.max_body_bytes, max_messages=a.max_messages,
                          max_prompt_chars=a.max_prompt_chars, max_prompt_tokens=a.max_prompt_tokens,
                          queue_timeout=a.queue_timeout, request_timeout=a.request_timeout, api_key=a.api_key,
                          cors_origins=tuple(a.cors_origin))


def main(argv: list[str] | None = None) -> None:
    """``python -m crawl2chat.stages.inference.serve --model DIR [--host H] [--port N] [--quantize int8] [limits...]``"""
    import argparse

    p = argparse.ArgumentParser(prog="crawl2chat.stages.inference.serve", description="Serve a model folder over HTTP.")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--quantize", choices=["none", "int8"])
    p.add_argument("--log-level", default="info")
    add_arguments(p)
    a = p.parse_args(argv)
    try:
        settings = settings_from_args(a).validated()
    except ValueError as e:
        p.error(str(e))  # exit status 2
    serve(a.model, host=a.host, port=a.port, quantize=a.quantize, log_level=a.log_level, settings=settings)


if __name__ == "__main__":
    main()
