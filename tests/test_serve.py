"""The HTTP server for real: uvicorn on 127.0.0.1 (free port) in a thread, httpx
and the openai client talking to it, streams read to the end, malformed requests
answered with 4xx, the concurrency bound, and KV-cache decoding against full
recomputation; the server's limits (body size, prompt length, message count,
queue and request timeouts, client hang-ups), API key and CORS, every server
flag refused or passed through, and a short soak of ``crawl2chat serve``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from crawl2chat.stages.inference.generation import (SERVING_FILE, Engine, SamplingParams, TextStream, init_model_dir,
                                                   stream_tokens)
from crawl2chat.stages.inference.serve import ServerThread, create_app


def corpus_text(n_lines: int = 1500, seed: int = 0) -> str:
    words = ("the king queen night day sword crown river stone bright dark speak answer gentle noble "
             "fool heart blood honour tomorrow love death war peace lord lady").split()
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(n_lines)) + "\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    (root / "corpus.txt").write_text(corpus_text())
    return init_model_dir(root / "model", root / "corpus.txt", preset="tiny", vocab_size=320, seq_len=256)


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir)


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, max_concurrent=2, max_queue=2, max_tokens_limit=200)) as s:
        yield s


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def sse_events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health(client, engine):
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["quantize"] == "none" and h["max_context"] == 256
    assert client.get("/v1/models").json()["data"][0]["id"] == h["model"]


def test_kv_cache_decoding_matches_full_recomputation(engine):
    prompt = engine.encode("the king speaks to the queen")
    cached = list(stream_tokens(engine.model, prompt, SamplingParams(max_new_tokens=12, temperature=0)))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(engine.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert cached == ids[len(prompt):]


def test_sampling_is_seeded(engine):
    p = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    a, b = engine.complete("the night", p), engine.complete("the night", p)
    assert a == b
    assert engine.complete("the night", SamplingParams(max_new_tokens=16, seed=8)) != a


def test_text_stream_stop_string_and_utf8(engine):
    tok = engine.tokenizer
    ids = tok("héllo wörld. stop here", add_special_tokens=False)["input_ids"]
    ts = TextStream(tok, iter(ids), max_new_tokens=100, stop=("stop",))
    pieces = list(ts.deltas())
    assert "".join(pieces) == "héllo wörld. " == ts.text
    assert ts.finish_reason == "stop"
    assert all("\ufffd" not in p for p in pieces)  # multi-byte characters never split


def test_generate_streaming_read_to_end(client):
    body = {"prompt": "the king", "max_tokens": 20, "temperature": 0}
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    *pieces, last = events
    assert last["done"] and last["finish_reason"] in ("length", "stop")
    assert "".join(p["text"] for p in pieces) == last["text"]
    assert 1 <= last["usage"]["completion_tokens"] <= 20
    whole = client.post("/generate", json={**body, "stream": False}).json()
    assert whole["text"] == last["text"] and whole["usage"] == last["usage"]


def test_chat_completions(client):
    body = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "speak of the river"}],
            "max_tokens": 16, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    res = r.json()
    assert res["object"] == "chat.completion" and res["choices"][0]["message"]["role"] == "assistant"
    assert res["usage"]["prompt_tokens"] > 8  # the chat template's role markers count too
    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == res["choices"][0]["finish_reason"]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == res["choices"][0]["message"]["content"]
    assert events[-2]["usage"] == res["usage"]


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"prompt": ""}, "prompt"),
    ("/generate", {"prompt": "   "}, "prompt"),
    ("/generate", {}, "prompt"),
    ("/generate", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/generate", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/generate", {"prompt": "x", "top_k": -1}, "top_k"),
    ("/generate", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/generate", {"prompt": "x", "max_tokens": 201}, "max_tokens"),  # above the server limit
    ("/generate", {"prompt": "the king " * 60, "max_tokens": 200}, "max_tokens"),  # beyond the context
    ("/generate", {"prompt": "the king " * 130}, "prompt"),  # the prompt alone fills it: no max_tokens to blame
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the king " * 130}]}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": " "}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
    # A lone surrogate (JSON's \ud800) used to fail in the tokenizer: a 500.
    ("/generate", {"prompt": "x \ud800"}, "prompt"),
    ("/generate", {"prompt": "x", "stop": ["\udfff"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content"),
])
def test_malformed_requests_get_400(client, path, body, param):
    # JSON with its non-ASCII characters escaped, as most clients send it (a lone surrogate included).
    r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_an_unset_max_tokens_fits_what_the_context_leaves(client):
    prompt = "the king " * 28  # ~200 of the 256 tokens: the default 128 would not fit
    ids = client.post("/generate", json={"prompt": prompt, "max_tokens": 1, "stream": False}).json()
    room = 256 - ids["usage"]["prompt_tokens"]
    assert 0 < room < 128
    r = client.post("/generate", json={"prompt": prompt, "stream": False, "temperature": 0,
                                       "repetition_penalty": 1.0})
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= room
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": prompt}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["total_tokens"] <= 256
    # Asked for explicitly, the same length is refused by name.
    r = client.post("/generate", json={"prompt": prompt, "max_tokens": 128})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_invalid_json_gets_400(client):
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]  # the decoder's offset is no field name
    assert err["param"] is None and err["message"].startswith("the body is not valid JSON: "), err


class GatedEngine:
    """The engine with generation held at a gate, so that requests stay running."""

    def __init__(self, engine, gate: threading.Event):
        self.engine, self.gate = engine, gate

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, prompt_ids, params):
        ts = self.engine.stream(prompt_ids, params)
        inner = ts.tokens

        def gated():
            self.gate.wait(60)
            yield from inner

        ts.tokens = gated()
        return ts


def test_concurrency_bound(engine):
    """2 running + 2 waiting fill the server; the next request gets 503, the
    waiting ones run once slots free up, and all slots come back."""
    gate = threading.Event()
    app = create_app(GatedEngine(engine, gate), max_concurrent=2, max_queue=2)
    body = {"prompt": "the king", "max_tokens": 5, "temperature": 0}
    results = []

    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        def request(stream):
            with httpx.Client(base_url=s.url, timeout=60) as own:
                if stream:
                    with own.stream("POST", "/generate", json=body) as r:
                        results.append((r.status_code, sse_events(r)[-1]["done"]))
                else:
                    r = own.post("/generate", json={**body, "stream": False})
                    results.append((r.status_code, r.json()["usage"]["completion_tokens"] > 0))

        threads = [threading.Thread(target=request, args=(i % 2 == 0,)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in range(400):
            h = c.get("/health").json()
            if (h["active"], h["waiting"]) == (2, 2):
                break
            threading.Event().wait(0.05)
        assert (h["active"], h["waiting"]) == (2, 2)
        busy = c.post("/generate", json={**body, "stream": False})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "busy" in busy.json()["error"]["message"]
        gate.set()
        for t in threads:
            t.join(timeout=60)
        assert results == [(200, True)] * 4
        h = c.get("/health").json()
        assert h["active"] == h["waiting"] == 0


def test_client_disconnect_frees_the_slot(engine):
    gate = threading.Event()
    app = create_app(GatedEngine(engine, gate), max_concurrent=1, max_queue=0)
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}) as r:
            assert r.status_code == 200
            assert c.get("/health").json()["active"] == 1
        # the client hung up mid-stream; the server notices on its next write
        gate.set()
        for _ in range(200):
            if c.get("/health").json()["active"] == 0:
                break
            threading.Event().wait(0.05)
        assert c.get("/health").json()["active"] == 0
        assert c.post("/generate", json={"prompt": "x", "max_tokens": 2, "stream": False}).status_code == 200


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "tell of the crown"}]
    res = client.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0)
    text = res.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(model="m", messages=msgs, max_tokens=12, temperature=0,
                                                      stream=True) if c.choices)
    assert streamed == text
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=msgs, top_p=0)


def test_int8_server_output_close_to_fp32(model_dir, engine):
    q = Engine(model_dir, quantize="int8")
    with ServerThread(create_app(q)) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        assert c.get("/health").json()["quantize"] == "int8"
        r = c.post("/generate", json={"prompt": "the king", "max_tokens": 8, "stream": False})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    ids = torch.tensor([engine.encode(corpus_text(20, seed=3))[:200]])
    with torch.no_grad():
        lp32 = torch.log_softmax(engine.model(input_ids=ids).logits, -1)
        lp8 = torch.log_softmax(q.model(input_ids=ids).logits, -1)
    kl = (lp32.exp() * (lp32 - lp8)).sum(-1).mean().item()
    assert kl < 1e-2, kl
    assert (lp32.argmax(-1) == lp8.argmax(-1)).float().mean().item() > 0.8


def test_chat_command_on_the_serving_path(model_dir):
    import typer
    from typer.testing import CliRunner

    from crawl2chat.serving_cli import register

    app = typer.Typer()
    register(app)
    r = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--temperature", "0", "--max-tokens", "6"],
                           input="hello there\n/reset\nthe king\n/exit\n")
    assert r.exit_code == 0, r.output
    assert r.output.count("bot> ") == 2 and "quantize" not in r.output
    # The default --max-tokens (256) on a model whose context is 256 tokens: replies are
    # given half the context, and a conversation longer than the window forgets its oldest turns.
    full = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--temperature", "0"],
                              input="hello there\n" + "the king and the queen " * 12 + "\nthe end\n/exit\n")
    assert full.exit_code == 0, full.output
    assert "replies up to 128 tokens (the model's context is 256)" in full.output
    assert full.output.count("bot> ") == 3 and "error" not in full.output, full.output
    bad = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--top-p", "0"], input="/exit\n")
    assert bad.exit_code == 2 and "top_p" in bad.output
    missing = CliRunner().invoke(app, ["serve", "--model", str(model_dir.parent)])
    assert missing.exit_code == 2 and "not a model folder" in missing.output


# ---------------------------------------------------------------- limits, timeouts, access control


def wait_for(predicate, timeout: float = 10.0, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


class SlowEngine:
    """The engine generating one fixed token every ``delay`` seconds (never a
    stop token), counting the tokens it produced."""

    def __init__(self, engine, delay: float = 0.05):
        self.engine, self.delay, self.produced = engine, delay, 0
        self.token = engine.encode("the")[0]

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def stream(self, prompt_ids, params):
        ts = self.engine.stream(prompt_ids, params)
        ts.tokens.close()

        def slow():
            for _ in range(params.max_new_tokens):
                time.sleep(self.delay)
                self.produced += 1
                yield self.token

        ts.tokens = slow()
        return ts


class CountingEngine(GatedEngine):
    """A gated engine that counts how many prompts it tokenised."""

    def __init__(self, engine, gate):
        super().__init__(engine, gate)
        self.tokenised = 0

    def prompt_ids(self, text):
        self.tokenised += 1
        return self.engine.prompt_ids(text)


@pytest.fixture(scope="module")
def limited(engine):
    app = create_app(engine, max_body_bytes=4096, max_messages=3, max_prompt_chars=300, max_prompt_tokens=40,
                     max_tokens_limit=200)
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        yield c


def test_oversized_bodies_get_413(limited):
    big = json.dumps({"prompt": "x" * 5000}).encode()
    for body in (big, iter([big[i:i + 1000] for i in range(0, len(big), 1000)])):  # declared, then chunked
        r = limited.post("/generate", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "request_too_large" and "4096 bytes" in r.json()["error"]["message"]
    huge = b"x" * (8 << 20)  # the server answers before reading it all; the connection stays usable
    assert limited.post("/v1/chat/completions", content=huge).status_code == 413
    ok = limited.post("/generate", json={"prompt": "the king", "max_tokens": 2, "stream": False})
    assert ok.status_code == 200
    assert limited.get("/health").json()["active"] == 0


@pytest.mark.parametrize("path,body,param,words", [
    ("/generate", {"prompt": "the king " * 40}, "prompt", "300 characters"),  # 360 characters
    ("/generate", {"prompt": "a b c d e f g h i j " * 14}, "prompt", "40 tokens"),  # 280 characters, >40 tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the king " * 20}] * 2}, "messages",
     "300 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 4}, "messages", "at most 3"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b c d e f g " * 6}]}, "messages",
     "40 tokens"),
])
def test_prompt_limits_get_400_naming_the_field(limited, path, body, param, words):
    for stream in (False, True):
        r = limited.post(path, json={**body, "max_tokens": 4, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], err
    assert limited.get("/health").json()["active"] == 0


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_seed_out_of_range_gets_400(client, seed):
    for path, body in (("/generate", {"prompt": "the king"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stream in (False, True):
            r = client.post(path, json={**body, "max_tokens": 2, "seed": seed, "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed).validate()
    r = client.post("/generate", json={"prompt": "the king", "max_tokens": 2, "seed": 2**63 - 1, "stream": False})
    assert r.status_code == 200


def test_tokenisation_waits_for_a_slot(engine):
    """A queued request is not tokenised before it gets its slot."""
    gate = threading.Event()
    counting = CountingEngine(engine, gate)
    app = create_app(counting, max_concurrent=1, max_queue=2)
    body = {"prompt": "the king", "max_tokens": 3, "stream": False}
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        results = []
        threads = [threading.Thread(target=lambda: results.append(httpx.post(s.url + "/generate", json=body,
                                                                             timeout=60).status_code))
                   for _ in range(2)]
        for t in threads:
            t.start()
        assert wait_for(lambda: (c.get("/health").json()["waiting"]) == 1)
        assert counting.tokenised == 1
        gate.set()
        for t in threads:
            t.join(timeout=60)
        assert results == [200, 200] and counting.tokenised == 2


def test_non_streaming_request_stops_when_its_client_leaves(engine):
    slow = SlowEngine(engine, delay=0.05)  # 200 tokens would take 10 s
    app = create_app(slow, max_concurrent=1, max_queue=1)
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/generate", json={"prompt": "the king", "max_tokens": 200, "stream": False},
                       timeout=httpx.Timeout(60, read=0.5))
        assert wait_for(lambda: c.get("/health").json()["active"] == 0, timeout=5)
        stopped_at = slow.produced
        assert stopped_at < 100, stopped_at
        time.sleep(0.3)
        assert slow.produced == stopped_at  # nothing is generated for it any more
        assert c.post("/generate", json={"prompt": "x", "max_tokens": 2, "stream": False}).status_code == 200


def test_request_timeout_stops_generation(engine):
    slow = SlowEngine(engine, delay=0.05)
    app = create_app(slow, max_concurrent=2, request_timeout=0.5)
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        t0 = time.monotonic()
        r = c.post("/generate", json={"prompt": "the king", "max_tokens": 200, "stream": False})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
        assert "0.5 s" in r.json()["error"]["message"] and time.monotonic() - t0 < 5
        with c.stream("POST", "/generate", json={"prompt": "the king", "max_tokens": 200}) as st:
            events = sse_events(st)
        assert st.status_code == 200 and events[-1]["error"]["type"] == "timeout"
        assert not any(e.get("done") for e in events) and any(e.get("text") for e in events[:-1])
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}) as st:
            events = sse_events(st)
        assert events[-1]["error"]["type"] == "timeout" and "[DONE]" not in events
        assert wait_for(lambda: c.get("/health").json()["active"] == 0, timeout=5)
        assert slow.produced < 3 * 0.5 / 0.05 + 10  # each stopped after about 10 tokens
    openai = pytest.importorskip("openai")
    with ServerThread(create_app(slow, request_timeout=0.5)) as s:
        oc = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIError):  # a stream ended by the timeout raises in the client
            for _ in oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=200, stream=True):
                pass


def test_queue_timeout_gets_503(engine):
    gate = threading.Event()
    app = create_app(GatedEngine(engine, gate), max_concurrent=1, max_queue=4, queue_timeout=0.3)
    body = {"prompt": "the king", "max_tokens": 3, "stream": False}
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        first = []
        holder = threading.Thread(target=lambda: first.append(httpx.post(s.url + "/generate", json=body,
                                                                         timeout=60).status_code))
        holder.start()
        assert wait_for(lambda: c.get("/health").json()["active"] == 1)
        t0 = time.monotonic()
        r = c.post("/generate", json=body)
        waited = time.monotonic() - t0
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert "0.3 s" in r.json()["error"]["message"] and 0.25 <= waited < 5
        # a queued client that hangs up leaves the queue at once
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/generate", json=body, timeout=httpx.Timeout(60, read=0.1))
        assert wait_for(lambda: c.get("/health").json()["waiting"] == 0, timeout=2)
        gate.set()
        holder.join(timeout=60)
        assert first == [200]
        h = c.get("/health").json()
        assert h["active"] == h["waiting"] == 0


def test_api_key(engine):
    key = "s3cret-key"
    with ServerThread(create_app(engine, api_key=key, max_body_bytes=4096)) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        assert c.get("/health").status_code == 200  # open, for load balancers and probes
        body = {"prompt": "the king", "max_tokens": 2, "stream": False}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {key}"},
                        {"Authorization": key}, {"Authorization": f"Bearer {key}x"}):
            for method, path, kw in (("GET", "/v1/models", {}), ("POST", "/generate", {"json": body}),
                                     ("GET", "/docs", {}), ("GET", "/openapi.json", {})):
                r = c.request(method, path, headers=headers, **kw)
                assert r.status_code == 401, (headers, path, r.text)
                assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
        # the key is checked before the body is read
        assert c.post("/generate", content=b"x" * 10000).status_code == 401
        good = {"Authorization": f"Bearer {key}"}
        assert c.get("/v1/models", headers=good).status_code == 200
        assert c.post("/generate", json=body, headers=good).status_code == 200
        assert c.post("/generate", content=b"x" * 10000, headers=good).status_code == 413
        openai = pytest.importorskip("openai")
        msgs = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
                model="m", messages=msgs, max_tokens=2)
        res = openai.OpenAI(base_url=s.url + "/v1", api_key=key).chat.completions.create(
            model="m", messages=msgs, max_tokens=2)
        assert res.usage.completion_tokens >= 1


def test_cors_off_by_default_and_on_for_configured_origins(engine):
    origin = "http://ui.example:3000"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with ServerThread(create_app(engine)) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.get("/v1/models", headers={"Origin": origin})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    app = create_app(engine, cors_origins=[origin], api_key="k")
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.options("/v1/chat/completions", headers=preflight)  # preflights carry no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = c.get("/v1/models", headers={"Origin": origin, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        r = c.get("/v1/models", headers={"Origin": "http://elsewhere.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers
        r = c.get("/v1/models", headers={"Origin": origin})  # a 401 is readable by the page too
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin


BAD_FLAGS = [
    ("--max-concurrent", "0"), ("--max-concurrent", "-1"), ("--max-queue", "-1"), ("--max-tokens", "0"),
    ("--max-body-bytes", "0"), ("--max-messages", "0"), ("--max-prompt-chars", "0"), ("--max-prompt-tokens", "0"),
    ("--queue-timeout", "0"), ("--queue-timeout", "nan"), ("--request-timeout", "-1"), ("--api-key", ""),
    ("--api-key", "two words"), ("--cors-origin", "ui.example"), ("--cors-origin", "http://ui.example/"),
]


@pytest.mark.parametrize("flag,value", BAD_FLAGS)
def test_bad_server_flags_are_refused(model_dir, flag, value, monkeypatch, capsys):
    import typer
    from typer.testing import CliRunner

    import crawl2chat.stages.inference.serve as serve_mod
    from crawl2chat.serving_cli import register

    monkeypatch.setattr(serve_mod, "Engine", lambda *a, **k: pytest.fail("the model must not load"))
    app = typer.Typer()
    register(app)
    r = CliRunner().invoke(app, ["serve", "--model", str(model_dir), flag, value])
    assert r.exit_code == 2 and flag in r.output, r.output
    with pytest.raises(SystemExit) as e:
        serve_mod.main(["--model", str(model_dir), flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_an_address_the_server_cannot_listen_on_is_refused_before_the_model_loads(model_dir, monkeypatch):
    import socket

    import typer
    from typer.testing import CliRunner

    import crawl2chat.stages.inference.serve as serve_mod
    from crawl2chat.serving_cli import register

    monkeypatch.setattr(serve_mod, "Engine", lambda *a, **k: pytest.fail("the model must not load"))
    app = typer.Typer()
    register(app)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--port", str(port)])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1] == \
        f"error: --host/--port: cannot listen on 127.0.0.1:{port} (address already in use)"
    for flag, value in (("--port", "70000"), ("--port", "-1"), ("--host", "no-such-host.invalid")):
        r = CliRunner().invoke(app, ["serve", "--model", str(model_dir), flag, value])
        assert r.exit_code == 2 and r.output.strip().splitlines()[-1].startswith(f"error: {flag}"), r.output


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8:surrogateescape"])
def test_chat_command_says_what_it_cannot_read_and_goes_on(model_dir, encoding):
    import subprocess
    import sys
    from pathlib import Path

    # Bytes that are not UTF-8 on the terminal: a traceback before (UnicodeDecodeError, or the
    # tokenizer's TypeError on the lone surrogates Python makes of them in a C locale).
    r = subprocess.run([str(Path(sys.executable).parent / "crawl2chat"), "chat", "--model", str(model_dir),
                        "--temperature", "0", "--max-tokens", "4"], input=b"bad \xff\xfe\nthe king\n/exit\n",
                       capture_output=True, timeout=300, env={**os.environ, "PYTHONIOENCODING": encoding})
    out = (r.stdout + r.stderr).decode(errors="replace")
    assert r.returncode == 0, out[-2000:]
    assert "the message is not valid Unicode text" in out and out.count("bot> ") == 1, out[-2000:]


def test_create_app_refuses_zero_slots(engine):
    with pytest.raises(ValueError, match="--max-concurrent"):
        create_app(engine, max_concurrent=0)


def test_serve_command_passes_every_flag(model_dir, monkeypatch):
    import typer
    from typer.testing import CliRunner

    import crawl2chat.stages.inference.serve as serve_mod
    from crawl2chat.serving_cli import register
    from crawl2chat.stages.inference.serve import ServerSettings

    seen = {}
    monkeypatch.setattr(serve_mod, "serve", lambda model, **kw: seen.update(kw))
    monkeypatch.delenv("CRAWL2CHAT_API_KEY", raising=False)
    app = typer.Typer()
    register(app)
    r = CliRunner().invoke(app, ["serve", "--model", str(model_dir)])
    assert r.exit_code == 0, r.output
    assert seen["settings"] == ServerSettings()  # the command's defaults are the server's
    argv = ["serve", "--model", str(model_dir), "--max-concurrent", "3", "--max-queue", "5", "--max-tokens", "77",
            "--max-body-bytes", "5000", "--max-messages", "7", "--max-prompt-chars", "900",
            "--max-prompt-tokens", "99", "--queue-timeout", "2.5", "--request-timeout", "12",
            "--cors-origin", "http://a.example", "--cors-origin", "https://b.example:8443"]
    r = CliRunner().invoke(app, argv, env={"CRAWL2CHAT_API_KEY": "from-env"})
    assert r.exit_code == 0, r.output
    assert "API key required" in r.output and "from-env" not in r.output
    assert seen["settings"] == ServerSettings(
        max_concurrent=3, max_queue=5, max_tokens_limit=77, max_body_bytes=5000, max_messages=7,
        max_prompt_chars=900, max_prompt_tokens=99, queue_timeout=2.5, request_timeout=12.0, api_key="from-env",
        cors_origins=("http://a.example", "https://b.example:8443"))
    r = CliRunner().invoke(app, argv + ["--api-key", "from-flag"], env={"CRAWL2CHAT_API_KEY": "from-env"})
    assert seen["settings"].api_key == "from-flag"


def load_bench_serve():
    spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).parents[1] / "benchmarks" / "bench_serve.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_short_soak(model_dir, tmp_path):
    """`crawl2chat serve` in its own process, API key from the environment,
    under ~10 s of mixed load with hang-ups and oversized bodies: /health
    answers throughout, no slot leaks, a normal request works afterwards, and
    the server's memory stays flat."""
    bench = load_bench_serve()
    key = "soak-" + "k" * 16
    proc, url = bench.start_server(model_dir, "none", 2, env={"CRAWL2CHAT_API_KEY": key},
                                   extra=("--max-body-bytes", 8192, "--max-tokens", 200, "--request-timeout", 60),
                                   entry=("-m", "crawl2chat.cli", "serve"), log=tmp_path / "server.log")
    try:
        res = bench.soak(url, proc.pid, duration=10, clients=6, api_key=key, body_limit=8192)
        res = asyncio.run(res)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bench.print_soak(res)
    assert bench.soak_failures(res, max_rss_growth_mib=48) == []
    assert res["health_polls"] >= 10 and res["generations_ok"] > 0
    assert res["hangups"] > 0 and res["status_413"] > 0 and res["status_401"] > 0


@pytest.mark.parametrize("damage", ["truncated weights", "no tokenizer", "bad serving.json"])
def test_a_damaged_model_folder_without_checksums_is_said_in_one_sentence(model_dir, tmp_path, damage):
    # Without checksums.json to catch it first, each ended in the library's traceback.
    import shutil

    import typer
    from typer.testing import CliRunner

    from crawl2chat.serving_cli import register

    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    (folder / "checksums.json").unlink(missing_ok=True)
    if damage == "truncated weights":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no tokenizer":
        (folder / "tokenizer.json").unlink()
    else:
        (folder / SERVING_FILE).write_text('{"quantize": "int4"}')
    app = typer.Typer()
    register(app)
    commands = [["chat", "--model", str(folder)], ["serve", "--model", str(folder), "--port", "0"]]
    if damage != "bad serving.json":  # export writes its own serving.json
        commands.append(["export", "--model", str(folder), "--out", str(tmp_path / "e")])
    for argv in commands:
        r = CliRunner().invoke(app, argv, input="/exit\n")
        last = r.output.strip().splitlines()[-1]
        assert r.exit_code == 2 and last.startswith("error: ") and str(folder) in last, (argv, r.output[-1500:])


def test_serve_stopped_with_sigterm_says_only_that_it_stopped(model_dir, tmp_path):
    # It used to end "rerunning the same command resumes where it stopped", words for a pipeline.
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    log = tmp_path / "serve.log"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "crawl2chat"), "serve", "--model", str(model_dir),
                             "--port", "0"], stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while "Uvicorn running on" not in log.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = log.read_text().strip().splitlines()
    assert proc.returncode == 128 + signal.SIGTERM and said[-1] == "stopped (SIGTERM)", said[-5:]
