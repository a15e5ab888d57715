"""The HTTP server for real: uvicorn on 127.0.0.1 (free port) in a thread, httpx
and the openai client talking to it, streams read to the end, malformed requests
answered with 4xx, the concurrency bound, and KV-cache decoding against full
recomputation."""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest
import torch

from crawl2chat.stages.inference.generation import Engine, SamplingParams, TextStream, init_model_dir, stream_tokens
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
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": " "}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature"),
])
def test_malformed_requests_get_400(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_invalid_json_gets_400(client):
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


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
    bad = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "--top-p", "0"], input="/exit\n")
    assert bad.exit_code == 2 and "top_p" in bad.output
    missing = CliRunner().invoke(app, ["serve", "--model", str(model_dir.parent)])
    assert missing.exit_code == 2 and "not a model folder" in missing.output
