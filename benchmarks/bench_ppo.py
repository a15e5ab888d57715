"""PPO throughput on a small model: rollouts/s, optimizer steps/s, peak memory, and
where the time goes (generation vs scoring vs training).

For each preset, a base model (random weights, a byte-level BPE trained on
Tiny Shakespeare when present, else on a synthetic word corpus) serves as
policy and reference; the reward model and critic are the same weights with a
fresh scalar head (throughput does not depend on what the reward means). PPO
then runs for ``--rollouts`` rollouts through the real ``accelerate launch``
(one process) with the settings below, and the run's own ``metrics.json``
supplies the figures: wall time per rollout, optimizer steps per second of
training time, the share of time spent generating (sampling with the KV
cache), scoring (actor/reference/critic/reward forward passes, GAE) and
training (``ppo_epochs`` passes of minibatches), and the training process's
peak resident set.

A second measurement isolates sampling: the same ``generate`` call with and
without the KV cache, in this process.

    python benchmarks/bench_ppo.py [--out DIR] [--presets tiny,cpu-small] [--rollouts 8]
        [--batch 16] [--new-tokens 32] [--epochs 4] [--minibatch 8]

Prints one JSON document and writes it to OUT/bench_ppo.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


def make_models(root: Path, preset: str, vocab: int, seq_len: int) -> tuple[Path, Path]:
    from transformers import AutoTokenizer

    from crawl2chat.stages.training.models import build_model, model_config, num_params
    from crawl2chat.stages.training.stage import save_model
    from crawl2chat.stages.training.reward import load_reward_model
    from crawl2chat.stages.training.tokenizer import train_tokenizer

    tok_dir = root / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        corpus = root / "corpus.txt"
        if SHAKESPEARE.exists():
            corpus.write_text(SHAKESPEARE.read_text()[:300_000])
        else:
            rng = random.Random(0)
            words = [f"w{i}" for i in range(3000)]
            corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(20000)))
        train_tokenizer(corpus, tok_dir, vocab_size=vocab)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    base = root / preset / "base"
    if not (base / "config.json").exists():
        torch.manual_seed(0)
        model = build_model(model_config(preset, vocab_size=len(tok), seq_len=seq_len, pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id))
        print(f"{preset}: {num_params(model) / 1e6:.2f}M parameters")
        save_model(model, model.state_dict(), tok_dir, base)
    rm = root / preset / "rm"
    if not (rm / "config.json").exists():
        m = load_reward_model(base, tok.pad_token_id)
        save_model(m, m.state_dict(), tok_dir, rm)
    return base, rm


def sampling_with_and_without_cache(base: Path, batch: int, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    msgs = [{"role": "user", "content": "Tell me of the king and the crown."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = {k: v.repeat(batch, 1) for k, v in ids.items()}
    out = {}
    for cache in (True, False):
        kw = dict(do_sample=True, top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  pad_token_id=tok.pad_token_id, use_cache=cache)
        with torch.no_grad():
            model.generate(**ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
            times = []
            for _ in range(3):  # the best of three: the machine may be shared
                t0 = time.perf_counter()
                model.generate(**ids, **kw)
                times.append(time.perf_counter() - t0)
            dt = min(times)
        out["kv_cache" if cache else "no_cache"] = {"seconds": dt, "tokens_per_second": batch * new_tokens / dt}
    out["cache_speedup"] = out["no_cache"]["seconds"] / out["kv_cache"]["seconds"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/bench_ppo")
    p.add_argument("--presets", default="tiny,cpu-small")
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="prompts per rollout")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--minibatch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    args = p.parse_args()

    from crawl2chat.tasks.train import launch_training

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    rng = random.Random(0)
    subjects = "king queen crown sword river night day love war peace".split()
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me of the {rng.choice(subjects)} and the "
                                                     f"{rng.choice(subjects)}."}) + "\n" for _ in range(64)))
    results = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                           "platform": platform.platform(), "torch": torch.__version__},
               "settings": vars(args), "runs": {}}
    for preset in [s for s in args.presets.split(",") if s]:
        base, rm = make_models(out, preset, args.vocab, seq_len=512)
        run = out / preset / "ppo"
        import shutil

        shutil.rmtree(run, ignore_errors=True)
        t0 = time.perf_counter()
        launch_training("ppo", {"policy": str(base), "reward": str(rm), "prompts": str(prompts)}, str(run), max_steps=args.rollouts,
               overrides=[f"rollout_batch_size={args.batch}", f"micro_batch_size={args.minibatch}",
                          f"ppo_epochs={args.epochs}", f"max_new_tokens={args.new_tokens}", "lr=1e-5",
                          "missing_eos_penalty=0", "save_value_model=false"])
        launch_wall = time.perf_counter() - t0
        m = json.loads((run / "metrics.json").read_text())
        per_rollout = m["wall_seconds"] / m["steps"]
        results["runs"][preset] = {
            "rollouts_per_second": m["rollouts_per_second"], "seconds_per_rollout": per_rollout,
            "optimizer_steps_per_second": m["optimizer_steps_per_second"],
            "generated_tokens_per_second": args.batch * m["response_length_last"] / (m["time_generate"] / m["steps"]),
            "time_share": {k: round(m[f"time_share_{k}"], 3) for k in ("generate", "score", "train")},
            "peak_memory_mb": m["peak_memory_mb"], "launch_wall_seconds": launch_wall,
            "sampling": sampling_with_and_without_cache(base, args.batch, args.new_tokens),
        }
        print(preset, json.dumps(results["runs"][preset]), flush=True)
    text = json.dumps(results, indent=2)
    (out / "bench_ppo.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
