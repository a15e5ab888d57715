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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
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


def start_server(model: Path, quantize: str, max_concurrent: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "crawl2chat.stages.inference.serve", "--model", str(model), "--port",
                             str(port), "--quantize", quantize, "--max-concurrent", str(max_concurrent),
                             "--max-queue", "64", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
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
    a = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(a.model) if a.model else build_model(Path(tmp), a.preset)
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
