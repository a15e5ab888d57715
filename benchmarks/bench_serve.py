"""Serving latency and throughput, fp32 against dynamic int8, on loopback.

For each of fp32 and int8 the server (``python -m crawl2chat.stages.inference.serve``)
runs in its own process on 127.0.0.1 and a client in this process measures:

* latency, one request at a time: time to first token (request sent -> first
  streamed text event of ``/generate``) and decode speed (tokens after the
  first / time from first to last event), median of ``--requests`` requests;
* throughput under concurrent load: ``C`` clients (asyncio + httpx) each send
  requests back to back for ``--load-requests`` requests in all; generated
  tokens per second of wall time, and median / p95 request latency and TTFT.

Every request: a ~``--prompt-tokens``-token prompt, ``max_tokens=--new-tokens``,
greedy decoding. The model is ``--model DIR``, or by default a randomly
initialised ``cpu`` preset (6 layers, 256 wide) with a tokenizer trained on Tiny
Shakespeare, which generates full-length answers (no early stop token) so every
request does the same work.

    python benchmarks/bench_serve.py [--model DIR] [--concurrency 1,4,8] [--json FILE]

Soak mode (``--soak SECONDS --clients N``) instead runs one fp32 server (API key
required, body limit ``--soak-body-limit``) for that long under ``N`` clients
that mix streaming and non-streaming ``/generate`` and chat requests, clients
that hang up mid-stream or before a non-streaming answer, oversized bodies
(413, declared and chunked), invalid requests (400) and requests without the
key (401), while ``/health`` is polled every 0.25 s. It prints requests/s, p50
and p99 latency of the completed generations, ``/health`` latency and
failures, the outcome counts, and the server process's RSS after warm-up, at
its peak and at the end; then checks that no slot leaked (``/health`` reports
nothing active or waiting once the clients stop) and that a normal request
still succeeds, and exits 1 if a check fails:

    python benchmarks/bench_serve.py --soak 60 --clients 32 [--preset cpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(out: Path, preset: str) -> Path:
    from crawl2chat.stages.inference.generation import init_model_dir

    text = SHAKESPEARE
    if not text.exists():
        text = out / "corpus.txt"
        text.write_text(" ".join(f"word{i % 997} line{i % 31}" for i in range(200_000)))
    return init_model_dir(out / f"model-{preset}", text, preset=preset, vocab_size=2048, seq_len=512)


def start_server(model: Path, quantize: str = "none", max_concurrent: int = 4, extra: tuple = (),
                 env: dict | None = None, entry: tuple = ("-m", "crawl2chat.stages.inference.serve", "--log-level", "warning"),
                 log: Path | None = None) -> tuple[subprocess.Popen, str]:
    """The server in its own process on 127.0.0.1 (a free port); ``entry``
    chooses the command line (``("-m", "crawl2chat.cli", "serve")`` for
    ``crawl2chat serve``), ``extra`` adds flags, ``log`` receives its output."""
    port = free_port()
    log = log or Path(tempfile.mkstemp(prefix="c2c-serve-", suffix=".log")[1])
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *entry, "--model", str(model), "--host", "127.0.0.1",
                                 "--port", str(port), "--quantize", quantize, "--max-concurrent", str(max_concurrent),
                                 "--max-queue", "64", *map(str, extra)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up")


async def one_request(client: httpx.AsyncClient, prompt: str, new_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0}
    t0 = time.perf_counter()
    first = last = None
    usage = None
    async with client.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            now = time.perf_counter()
            if ev.get("done"):
                usage = ev["usage"]
                last = last or now
                break
            if ev.get("text"):
                first = first or now
                last = now
    n = usage["completion_tokens"]
    return {"ttft": (first or last) - t0, "latency": last - t0, "tokens": n,
            "decode_tps": (n - 1) / (last - first) if first and last > first and n > 1 else float("nan")}


async def latency(url: str, prompt: str, new_tokens: int, requests: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await one_request(c, prompt, 4)  # warm-up
        rs = [await one_request(c, prompt, new_tokens) for _ in range(requests)]
    return {"ttft_ms": 1000 * statistics.median(r["ttft"] for r in rs),
            "decode_tokens_per_s": statistics.median(r["decode_tps"] for r in rs),
            "latency_s": statistics.median(r["latency"] for r in rs),
            "tokens": statistics.median(r["tokens"] for r in rs)}


async def load(url: str, prompt: str, new_tokens: int, concurrency: int, total: int) -> dict:
    results: list[dict] = []
    todo = list(range(total))

    async def worker(c):
        while todo:
            todo.pop()
            results.append(await one_request(c, prompt, new_tokens))

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat = sorted(r["latency"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "requests_per_s": len(results) / wall,
            "latency_p50_s": statistics.median(lat), "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
            "ttft_p50_ms": 1000 * statistics.median(r["ttft"] for r in results)}


# ---------------------------------------------------------------- soak


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid``."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    import psutil

    return psutil.Process(pid).memory_info().rss


SOAK_MIX = {  # request kind -> weight
    "stream": 4, "whole": 3, "chat_stream": 3, "chat_whole": 2,
    "hangup_stream": 2, "hangup_whole": 2, "oversized": 2, "invalid": 1, "no_key": 1,
}


async def soak(url: str, pid: int, duration: float, clients: int, api_key: str, body_limit: int,
               prompt: str = "the king spoke to the people of the city", max_new_tokens: int = 48,
               seed: int = 0) -> dict:
    """``clients`` clients sending the :data:`SOAK_MIX` of requests back to back
    for ``duration`` seconds (each request bounded by a 60 s timeout) while
    ``/health`` is polled and the server's RSS sampled; then the leak checks.
    Requests under way when the time is up finish, so the wall time reported
    can exceed ``duration``."""
    auth = {"Authorization": f"Bearer {api_key}"}
    kinds, weights = zip(*SOAK_MIX.items())
    outcomes: Counter = Counter()
    latencies: list[float] = []
    health_lat: list[float] = []
    health_fail = 0
    rss: list[int] = []
    stop_at = 0.0

    def gen_body(rng, n_tokens):
        return {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0.8, "seed": rng.randrange(1 << 30)}

    def chat_body(rng, n_tokens):
        return {"messages": [{"role": "user", "content": prompt}], "max_tokens": n_tokens, "temperature": 0.8,
                "seed": rng.randrange(1 << 30)}

    async def one(c: httpx.AsyncClient, rng: random.Random, kind: str) -> tuple[str, float | None]:
        n = rng.randint(8, max_new_tokens)
        t0 = time.perf_counter()
        if kind in ("stream", "chat_stream"):
            path, body = ("/generate", gen_body(rng, n)) if kind == "stream" else \
                ("/v1/chat/completions", {**chat_body(rng, n), "stream": True})
            async with c.stream("POST", path, json=body, headers=auth) as r:
                last = None
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        last = line[6:]
                if r.status_code != 200:
                    return f"http_{r.status_code}", None
                ok = last == "[DONE]" if kind == "chat_stream" else bool(last and json.loads(last).get("done"))
                return ("ok", time.perf_counter() - t0) if ok else ("bad_stream_end", None)
        if kind in ("whole", "chat_whole"):
            path, body = ("/generate", {**gen_body(rng, n), "stream": False}) if kind == "whole" else \
                ("/v1/chat/completions", chat_body(rng, n))
            r = await c.post(path, json=body, headers=auth)
            return ("ok", time.perf_counter() - t0) if r.status_code == 200 else (f"http_{r.status_code}", None)
        if kind == "hangup_stream":  # read a first event, then hang up
            async with c.stream("POST", "/generate", json=gen_body(rng, 200), headers=auth) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            return ("hangup", None) if r.status_code == 200 else (f"http_{r.status_code}", None)
        if kind == "hangup_whole":  # give up on a non-streaming answer before it comes
            try:
                r = await c.post("/generate", json={**gen_body(rng, 200), "stream": False}, headers=auth,
                                 timeout=httpx.Timeout(60, read=rng.uniform(0.05, 0.5)))
                return ("ok", time.perf_counter() - t0) if r.status_code == 200 else (f"http_{r.status_code}", None)
            except httpx.ReadTimeout:
                return "hangup", None
        if kind == "oversized":
            blob = "x" * (body_limit + rng.randint(1, body_limit))
            data = json.dumps({"prompt": blob}).encode()
            if rng.random() < 0.5:
                r = await c.post("/generate", content=data, headers={**auth, "content-type": "application/json"})
            else:  # chunked: no Content-Length to refuse it by

                async def chunks():
                    for k in range(0, len(data), 16384):
                        yield data[k:k + 16384]

                r = await c.post("/generate", content=chunks(), headers={**auth, "content-type": "application/json"})
            return ("413", None) if r.status_code == 413 else (f"http_{r.status_code}", None)
        if kind == "invalid":
            r = await c.post("/generate", json={**gen_body(rng, n), "seed": 2**70}, headers=auth)
            return ("400", None) if r.status_code == 400 else (f"http_{r.status_code}", None)
        if kind == "no_key":
            r = await c.post("/generate", json=gen_body(rng, n))
            return ("401", None) if r.status_code == 401 else (f"http_{r.status_code}", None)
        raise ValueError(kind)

    async def client(i: int):
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            while time.monotonic() < stop_at:
                kind = rng.choices(kinds, weights)[0]
                try:
                    outcome, lat = await one(c, rng, kind)
                except httpx.HTTPError as e:
                    outcome, lat = f"client_error_{type(e).__name__}", None
                outcomes[outcome] += 1
                outcomes[f"kind_{kind}"] += 1
                if lat is not None:
                    latencies.append(lat)

    async def health():
        nonlocal health_fail
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:  # a failure: no answer within 10 s
            while time.monotonic() < stop_at:
                t0 = time.perf_counter()
                try:
                    r = await c.get("/health")
                    r.raise_for_status()
                    health_lat.append(time.perf_counter() - t0)
                except httpx.HTTPError:
                    health_fail += 1
                await asyncio.sleep(0.25)

    async def sample_rss():
        while time.monotonic() < stop_at:
            rss.append(rss_bytes(pid))
            await asyncio.sleep(0.5)

    # warm-up: each kind once, so that lazily built state is in the baseline
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        rng = random.Random(seed)
        for kind in kinds:
            await one(c, rng, kind)
    await asyncio.sleep(1.0)
    rss_start = rss_bytes(pid)
    t0 = time.monotonic()
    stop_at = t0 + duration
    await asyncio.gather(health(), sample_rss(), *(client(i) for i in range(clients)))
    wall = time.monotonic() - t0

    # after the load: nothing may stay active or waiting, and a normal request must work
    in_flight = None
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        for _ in range(120):
            h = (await c.get("/health")).json()
            in_flight = h["active"] + h["waiting"]
            if in_flight == 0:
                break
            await asyncio.sleep(0.25)
        r = await c.post("/v1/chat/completions", json=chat_body(random.Random(1), 8), headers=auth)
        final_ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    rss_end = rss_bytes(pid)

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    done = sum(v for k, v in outcomes.items() if not k.startswith("kind_"))
    return {
        "duration_s": wall, "clients": clients, "requests": done, "requests_per_s": done / wall,
        "generations_ok": outcomes["ok"], "generations_per_s": outcomes["ok"] / wall,
        "latency_p50_s": pct(latencies, 0.5), "latency_p99_s": pct(latencies, 0.99),
        "health_polls": len(health_lat) + health_fail, "health_failures": health_fail,
        "health_p99_s": pct(health_lat, 0.99), "health_max_s": max(health_lat, default=float("nan")),
        "hangups": outcomes["hangup"], "status_413": outcomes["413"], "status_400": outcomes["400"],
        "status_401": outcomes["401"],
        "unexpected": {k: v for k, v in outcomes.items()
                       if not k.startswith("kind_") and k not in ("ok", "hangup", "413", "400", "401")},
        "kinds": {k[5:]: v for k, v in outcomes.items() if k.startswith("kind_")},
        "rss_start_mib": rss_start / 2**20, "rss_peak_mib": max(rss + [rss_end]) / 2**20,
        "rss_end_mib": rss_end / 2**20, "rss_growth_mib": (rss_end - rss_start) / 2**20,
        "in_flight_after": in_flight, "final_request_ok": final_ok,
    }


def soak_failures(res: dict, max_rss_growth_mib: float) -> list[str]:
    """The soak's checks that failed (empty: all passed)."""
    fails = []
    if res["health_failures"]:
        fails.append(f"/health failed {res['health_failures']} times")
    if res["in_flight_after"] != 0:
        fails.append(f"{res['in_flight_after']} requests still active or waiting after the load")
    if not res["final_request_ok"]:
        fails.append("a normal request after the load failed")
    if res["unexpected"]:
        fails.append(f"unexpected outcomes {res['unexpected']}")
    if res["rss_growth_mib"] > max_rss_growth_mib:
        fails.append(f"server RSS grew {res['rss_growth_mib']:.1f} MiB (> {max_rss_growth_mib} MiB)")
    return fails


def print_soak(res: dict) -> None:
    print(f"\nsoak: {res['duration_s']:.1f} s, {res['clients']} clients, {res['requests']} requests "
          f"({res['requests_per_s']:.1f}/s), {res['generations_ok']} completed generations "
          f"({res['generations_per_s']:.1f}/s)")
    print(f"  generation latency p50 {res['latency_p50_s']:.2f} s, p99 {res['latency_p99_s']:.2f} s")
    print(f"  /health: {res['health_polls']} polls, {res['health_failures']} failed, "
          f"p99 {1000 * res['health_p99_s']:.0f} ms, max {1000 * res['health_max_s']:.0f} ms")
    print(f"  client hang-ups {res['hangups']}, 413 {res['status_413']}, 400 {res['status_400']}, "
          f"401 {res['status_401']}, unexpected {res['unexpected'] or 'none'}")
    print(f"  server RSS {res['rss_start_mib']:.1f} MiB after warm-up, peak {res['rss_peak_mib']:.1f}, "
          f"end {res['rss_end_mib']:.1f} (growth {res['rss_growth_mib']:+.1f} MiB)")
    print(f"  after the load: {res['in_flight_after']} in flight, normal request "
          f"{'ok' if res['final_request_ok'] else 'FAILED'}")


def run_soak(a, model: Path) -> dict:
    key = os.urandom(16).hex()
    proc, url = start_server(model, "none", a.max_concurrent, env={"CRAWL2CHAT_API_KEY": key},
                             extra=("--max-body-bytes", a.soak_body_limit, "--max-tokens", 256,
                                    "--request-timeout", 60, "--queue-timeout", 60))
    try:
        return asyncio.run(soak(url, proc.pid, a.soak, a.clients, key, a.soak_body_limit))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder; default: a random model of --preset")
    p.add_argument("--preset", default="cpu")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=5, help="sequential requests for the latency figures")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--load-requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--max-concurrent", type=int, default=4, help="server's --max-concurrent")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--soak", type=float, default=0, help="soak for this many seconds instead (see above)")
    p.add_argument("--clients", type=int, default=32, help="soak clients")
    p.add_argument("--soak-body-limit", type=int, default=65536, help="the soak server's --max-body-bytes")
    p.add_argument("--max-rss-growth", type=float, default=64.0, help="soak check: server RSS growth, MiB")
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(a.model) if a.model else build_model(Path(tmp), a.preset)
        if a.soak:
            res = run_soak(a, model)
            print_soak(res)
            fails = soak_failures(res, a.max_rss_growth)
            print("\n" + json.dumps(res, indent=2))
            if a.json:
                Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
            print("checks: " + ("; ".join(fails) if fails else "all passed"))
            sys.exit(1 if fails else 0)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))
        words = "the king spoke to the people of the city about the war and the harvest".split()
        prompt = " ".join(words * 10)
        ids = tok(prompt, add_special_tokens=False)["input_ids"][: a.prompt_tokens]
        prompt = tok.decode(ids)
        res = {"model": str(model) if a.model else f"random {a.preset}", "machine": platform.processor() or platform.machine(),
               "cpus": os.cpu_count(), "torch_threads": None, "prompt_tokens": len(ids), "new_tokens": a.new_tokens,
               "server_max_concurrent": a.max_concurrent}
        import torch

        res["torch_threads"] = torch.get_num_threads()
        for quantize in ("none", "int8"):
            proc, url = start_server(model, quantize, a.max_concurrent)
            try:
                side = {"latency": asyncio.run(latency(url, prompt, a.new_tokens, a.requests))}
                side["load"] = [asyncio.run(load(url, prompt, a.new_tokens, int(c), a.load_requests))
                                for c in a.concurrency.split(",") if c]
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            res["fp32" if quantize == "none" else "int8"] = side

    print(f"\n{res['model']}: prompt {res['prompt_tokens']} tokens, {res['new_tokens']} new tokens, "
          f"{res['cpus']} CPUs, server max_concurrent {a.max_concurrent}\n")
    print(f"{'':5} {'TTFT ms':>8} {'decode tok/s':>13}   " + "   ".join(
        f"C={lv['concurrency']}: tok/s  p50 s  p95 s" for lv in res["fp32"]["load"]))
    for side in ("fp32", "int8"):
        lat = res[side]["latency"]
        row = f"{side:5} {lat['ttft_ms']:8.1f} {lat['decode_tokens_per_s']:13.1f}   "
        row += "   ".join(f"{'':5}{lv['tokens_per_s']:7.1f} {lv['latency_p50_s']:6.2f} {lv['latency_p95_s']:6.2f}"
                          for lv in res[side]["load"])
        print(row)
    text = json.dumps(res, indent=2)
    print("\n" + text)
    if a.json:
        Path(a.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
