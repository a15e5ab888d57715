"""HTTP serving of a model folder (FastAPI + uvicorn).

Endpoints:

* ``GET /health`` — model, quantisation, context length, active and waiting requests.
* ``POST /generate`` — raw text completion: ``{"prompt", "max_tokens", "temperature",
  "top_p", "top_k", "stop", "seed", "stream"}``. Streams by default as server-sent
  events, ``data: {"text": ...}`` per piece and a last ``data: {"done": true,
  "finish_reason", "usage"}``; with ``"stream": false`` one JSON object.
* ``GET /v1/models`` and ``POST /v1/chat/completions`` — the OpenAI chat API
  (streaming and not), applying the tokenizer's chat template, so the
  ``openai`` client and OpenAI-speaking tools work against it.

Requests are validated before any compute: an empty prompt, a prompt plus
``max_tokens`` beyond the model's context or the server's limit, or sampling
parameters out of range get a 400 with an OpenAI-style ``{"error": {...}}``
body. At most ``max_concurrent`` requests generate at once and at most
``max_queue`` more wait; beyond that the answer is 503 with ``Retry-After``.
Generation runs in worker threads with a KV cache (:mod:`.generation`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from typing import Any, Iterator, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool

from crawl2chat.stages.inference.generation import Engine, SamplingParams

DEFAULT_MAX_TOKENS = 128


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.headers = status, message, param, type_, headers


def _error_body(message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


# ---------------------------------------------------------------- request schemas


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > 4 or any(not s for s in v):
            raise ValueError("stop takes at most 4 non-empty strings")
        return v


class GenerateRequest(_Sampling):
    prompt: str
    max_new_tokens: Optional[int] = Field(None, ge=1)  # alias of max_tokens
    stream: bool = True

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("prompt must not be empty")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


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


# ---------------------------------------------------------------- admission


class Admission:
    """At most ``max_concurrent`` running and ``max_queue`` waiting requests."""

    def __init__(self, max_concurrent: int, max_queue: int):
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.active = self.waiting = 0
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def acquire(self) -> None:
        if self._sem is None:
            self._sem, self._loop = asyncio.Semaphore(self.max_concurrent), asyncio.get_running_loop()
        if self.active + self.waiting >= self.max_concurrent + self.max_queue:
            raise APIError(503, f"server busy: {self.active} requests running and {self.waiting} waiting",
                           type_="server_busy", headers={"Retry-After": "1"})
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.active += 1

    def release(self) -> None:
        """Thread-safe: called from the event loop or a worker thread."""
        def _release():
            self.active -= 1
            self._sem.release()

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            _release()
        else:
            self._loop.call_soon_threadsafe(_release)


# ---------------------------------------------------------------- app


def create_app(engine: Engine, max_concurrent: int = 4, max_queue: int = 16, max_tokens_limit: int = 1024,
               model_name: str | None = None) -> FastAPI:
    """The FastAPI application serving ``engine``."""
    app = FastAPI(title="crawl2chat", version="1")
    admission = Admission(max_concurrent, max_queue)
    name = model_name or engine.model_dir.rstrip("/").split("/")[-1] or "model"
    app.state.engine, app.state.admission = engine, admission

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs)
        return JSONResponse(status_code=400, content=_error_body(msg or "invalid request", "invalid_request_error", param))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(status_code=exc.status, content=_error_body(exc.message, exc.type, exc.param),
                            headers=exc.headers)

    def sampling(req: _Sampling, max_tokens: int | None) -> SamplingParams:
        n = max_tokens or DEFAULT_MAX_TOKENS
        if n > max_tokens_limit:
            raise APIError(400, f"max_tokens {n} exceeds this server's limit of {max_tokens_limit}", "max_tokens")
        return SamplingParams(max_new_tokens=n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              stop=tuple(req.stop or ()), seed=req.seed)

    def check(prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            engine.check_length(prompt_ids, params.max_new_tokens)
        except ValueError as e:
            raise APIError(400, str(e), "max_tokens" if prompt_ids else "prompt") from None

    async def run_stream(events: Iterator[Any]):
        """Async body over a sync event generator; releases the admission slot
        however the stream ends (finished, failed, client gone)."""
        try:
            while True:
                item = await run_in_threadpool(next, events, None)
                if item is None:
                    break
                yield item
        finally:
            try:
                await run_in_threadpool(events.close)
            finally:
                admission.release()

    async def admitted(fn, *args):
        await admission.acquire()
        try:
            return await run_in_threadpool(fn, *args)
        finally:
            admission.release()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "quantize": engine.quantize, "max_context": engine.max_context,
                "active": admission.active, "waiting": admission.waiting,
                "max_concurrent": admission.max_concurrent, "max_queue": admission.max_queue}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "crawl2chat"}]}

    @app.post("/generate")
    async def generate(req: GenerateRequest):
        params = sampling(req, req.max_new_tokens or req.max_tokens)
        prompt_ids = await run_in_threadpool(engine.prompt_ids, req.prompt)
        check(prompt_ids, params)

        def usage(ts):
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": ts.completion_tokens,
                    "total_tokens": len(prompt_ids) + ts.completion_tokens}

        if not req.stream:
            def run():
                ts = engine.stream(prompt_ids, params)
                text = "".join(ts.deltas())
                return {"text": text, "finish_reason": ts.finish_reason, "usage": usage(ts)}
            return await admitted(run)

        def events():
            ts = engine.stream(prompt_ids, params)
            for delta in ts.deltas():
                yield _sse({"text": delta})
            yield _sse({"done": True, "text": ts.text, "finish_reason": ts.finish_reason, "usage": usage(ts)})

        await admission.acquire()
        return StreamingResponse(run_stream(events()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        params = sampling(req, req.max_completion_tokens or req.max_tokens)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt_ids = await run_in_threadpool(engine.chat_prompt_ids, messages)
        check(prompt_ids, params)
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def usage(ts):
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": ts.completion_tokens,
                    "total_tokens": len(prompt_ids) + ts.completion_tokens}

        if not req.stream:
            def run():
                ts = engine.stream(prompt_ids, params)
                text = "".join(ts.deltas())
                return {"id": cid, "object": "chat.completion", "created": created, "model": name,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                     "finish_reason": ts.finish_reason, "logprobs": None}],
                        "usage": usage(ts)}
            return await admitted(run)

        def chunk(delta: dict, finish: str | None = None) -> str:
            return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def events():
            ts = engine.stream(prompt_ids, params)
            yield chunk({"role": "assistant", "content": ""})
            for delta in ts.deltas():
                yield chunk({"content": delta})
            yield chunk({}, ts.finish_reason)
            if include_usage:
                yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                            "choices": [], "usage": usage(ts)})
            yield "data: [DONE]\n\n"

        await admission.acquire()
        return StreamingResponse(run_stream(events()), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

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
          max_concurrent: int = 4, max_queue: int = 16, max_tokens_limit: int = 1024, log_level: str = "info") -> None:
    """Load ``model_dir`` and serve it until interrupted."""
    import uvicorn

    engine = Engine(model_dir, quantize=quantize)
    app = create_app(engine, max_concurrent=max_concurrent, max_queue=max_queue, max_tokens_limit=max_tokens_limit)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def main(argv: list[str] | None = None) -> None:
    """``python -m crawl2chat.stages.inference.serve --model DIR [--host H] [--port N] [--quantize int8]``"""
    import argparse

    p = argparse.ArgumentParser(prog="crawl2chat.stages.inference.serve", description="Serve a model folder over HTTP.")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--quantize", choices=["none", "int8"])
    p.add_argument("--max-concurrent", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--log-level", default="info")
    a = p.parse_args(argv)
    serve(a.model, host=a.host, port=a.port, quantize=a.quantize, max_concurrent=a.max_concurrent,
          max_queue=a.max_queue, max_tokens_limit=a.max_tokens, log_level=a.log_level)


if __name__ == "__main__":
    main()
