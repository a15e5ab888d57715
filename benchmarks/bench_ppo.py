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

Side by side with TRL (``--with-peer`` creates its venv on first use, see
``benchmarks/peers.py``): for each preset, beside our run, TRL's ``PPOTrainer``
(``benchmarks/peer_trl_ppo.py``, run with the python of TRL's own venv) trains the same
base and reward-model folders from disk on the same prompt token ids, with the same
prompts per rollout, epochs, minibatches (``batch / minibatch`` of them, one optimizer
step each), response length, sampling temperature, learning rate, KL and value
coefficients and number of rollouts; the script's docstring lists what TRL does
differently. Printed per preset, for both and as ratios ours / TRL: episodes (answers)
per second over the PPO loop, peak resident set of the training process, and the whole
command's wall time and CPU time (start, model loading and the final save included).
``--repeat N`` runs N pairs in alternating order (ours first, then TRL first, ...) and
compares each side's fastest run: on a shared machine the least disturbed one.

    python benchmarks/bench_ppo.py [--out DIR] [--presets tiny,cpu-small] [--rollouts 8]
        [--batch 16] [--new-tokens 32] [--epochs 4] [--minibatch 8] [--vocab 2048]
        [--with-peer [--repeat 1]]
    python benchmarks/bench_ppo.py --presets cpu-small --vocab 6144 --batch 8 --minibatch 4 \\
        --epochs 4 --new-tokens 24 --rollouts 20 --with-peer   # the paired TRL run (1.6M-parameter policy)

Prints one JSON document and writes it to OUT/bench_ppo.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/peers.py
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"
# TRL's venv: 1.12.0 is the last TRL release with a PPOTrainer (trl.experimental.ppo; 1.13
# removed it); the model code, accelerate and torch are pinned to the project's own versions,
# so the two sides differ in their PPO loops only.
TRL_REQUIREMENTS = ["torch==2.13.0", "trl==1.12.0", "transformers==5.24.0", "accelerate==1.16.0", "datasets==4.8.5"]
PEER_SCRIPT = Path(__file__).resolve().parent / "peer_trl_ppo.py"
LR = 1e-5  # both sides, constant


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


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished (waited-for) children so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def trl_ppo(out: Path, base: Path, rm: Path, prompts: Path, args, with_peer: bool) -> dict:
    """TRL's PPO on our models and prompt token ids, in its own venv; the whole command timed here."""
    from transformers import AutoTokenizer

    from crawl2chat.stages.training.chat_data import encode_prompt, end_of_turn_id, load_prompts
    from crawl2chat.stages.training.settings import PPOConfig

    from peers import peer_python

    python = peer_python("trl", TRL_REQUIREMENTS, with_peer)
    cfg = PPOConfig()
    tok = AutoTokenizer.from_pretrained(base)
    msgs, _ = load_prompts(prompts)
    work = out / "trl"
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spec = {"policy": str(base), "reward": str(rm), "out": str(work / "run"), "seed": cfg.seed,
            "prompts": [encode_prompt(tok, m, cfg.max_prompt_len) for m in msgs],
            "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
            "stop_token_id": end_of_turn_id(tok), "batch": args.batch, "minibatches": args.batch // args.minibatch,
            "epochs": args.epochs, "new_tokens": args.new_tokens, "rollouts": args.rollouts, "lr": LR,
            "temperature": cfg.temperature, "kl_coef": cfg.kl_coef, "vf_coef": cfg.vf_coef}
    (work / "spec.json").write_text(json.dumps(spec))
    t0, cpu0 = time.perf_counter(), children_cpu_seconds()
    proc = subprocess.run([str(python), str(PEER_SCRIPT), str(work / "spec.json"), str(work / "result.json")],
                          cwd=work, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, children_cpu_seconds() - cpu0
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"TRL's PPO failed ({proc.returncode}): {proc.stderr[-3000:]}")
    res = json.loads((work / "result.json").read_text())
    res["wall_seconds_incl_launch"], res["cpu_seconds_incl_launch"] = wall, cpu
    return res


def ours_ppo(out: Path, base: Path, rm: Path, prompts: Path, args) -> dict:
    """Our PPO stage through ``accelerate launch`` (one process); figures from its ``metrics.json``,
    the whole command timed here."""
    import shutil

    from crawl2chat.tasks.train import launch_training

    run = out / "ppo"
    shutil.rmtree(run, ignore_errors=True)
    t0, cpu0 = time.perf_counter(), children_cpu_seconds()
    launch_training("ppo", {"policy": str(base), "reward": str(rm), "prompts": str(prompts)}, str(run),
                    max_steps=args.rollouts,
                    overrides=[f"rollout_batch_size={args.batch}", f"micro_batch_size={args.minibatch}",
                               f"ppo_epochs={args.epochs}", f"max_new_tokens={args.new_tokens}", f"lr={LR}",
                               "missing_eos_penalty=0", "save_value_model=false"])
    launch_wall, launch_cpu = time.perf_counter() - t0, children_cpu_seconds() - cpu0
    m = json.loads((run / "metrics.json").read_text())
    return {
        "rollouts_per_second": m["rollouts_per_second"], "seconds_per_rollout": m["wall_seconds"] / m["steps"],
        "episodes_per_second": m["rollouts_per_second"] * args.batch * m["world_size"],
        "optimizer_steps_per_second": m["optimizer_steps_per_second"],
        "generated_tokens_per_second": args.batch * m["response_length_last"] / (m["time_generate"] / m["steps"]),
        "time_share": {k: round(m[f"time_share_{k}"], 3) for k in ("generate", "score", "train")},
        "peak_memory_mb": m["peak_memory_mb"], "launch_wall_seconds": launch_wall, "launch_cpu_seconds": launch_cpu,
    }


def compare(preset: str, ours: dict, peer: dict) -> dict:
    """Ours / TRL for episodes per second, peak memory, whole-command wall and CPU time; printed."""
    vs = {"episodes_per_second": ours["episodes_per_second"] / peer["episodes_per_second"],
          "peak_memory": ours["peak_memory_mb"] / peer["peak_memory_mb"],
          "wall": ours["launch_wall_seconds"] / peer["wall_seconds_incl_launch"],
          "cpu": ours["launch_cpu_seconds"] / peer["cpu_seconds_incl_launch"]}
    print(f"{preset} vs TRL {peer['library']['trl']}, same models, prompts and shape: episodes/s "
          f"{ours['episodes_per_second']:.2f} vs {peer['episodes_per_second']:.2f} (x{vs['episodes_per_second']:.2f}); "
          f"peak memory {ours['peak_memory_mb']:.0f} vs {peer['peak_memory_mb']:.0f} MiB (x{vs['peak_memory']:.2f}); "
          f"whole command wall {ours['launch_wall_seconds']:.1f} vs {peer['wall_seconds_incl_launch']:.1f} s "
          f"(x{vs['wall']:.2f}), CPU {ours['launch_cpu_seconds']:.1f} vs {peer['cpu_seconds_incl_launch']:.1f} s "
          f"(x{vs['cpu']:.2f})", flush=True)
    return vs


def pair_ratios(tries: dict[str, list[dict]]) -> list[float]:
    """Ours / TRL episodes per second for each pair of runs (the i-th run of each side,
    taken one after the other), in the order they ran: the spread the machine gives a
    single pairing, beside the fastest-against-fastest ratio."""
    return [o["episodes_per_second"] / t["episodes_per_second"] for o, t in zip(tries["ours"], tries["trl"])]


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
    p.add_argument("--with-peer", action="store_true", help="run TRL's PPOTrainer beside ours on the same models and "
                                                             "prompts (its venv is made on first use)")
    p.add_argument("--repeat", type=int, default=1, help="with --with-peer: pairs of runs, in alternating order; "
                                                         "each side's fastest run is compared")
    args = p.parse_args()
    if args.with_peer and args.batch % args.minibatch:
        p.error("--with-peer needs --batch to be a multiple of --minibatch (TRL's minibatches are equal)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    rng = random.Random(0)
    subjects = "king queen crown sword river night day love war peace".split()
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me of the {rng.choice(subjects)} and the "
                                                     f"{rng.choice(subjects)}."}) + "\n" for _ in range(64)))
    results = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                           "platform": platform.platform(), "torch": torch.__version__,
                           "load_average_at_start": os.getloadavg()},
               "settings": vars(args), "runs": {}}
    for preset in [s for s in args.presets.split(",") if s]:
        base, rm = make_models(out, preset, args.vocab, seq_len=512)
        sides = {"ours": lambda: ours_ppo(out / preset, base, rm, prompts, args)}
        if args.with_peer:
            sides["trl"] = lambda: trl_ppo(out / preset, base, rm, prompts, args, args.with_peer)
        tries: dict[str, list[dict]] = {k: [] for k in sides}
        for r in range(max(1, args.repeat) if args.with_peer else 1):
            # Alternating order: a machine that gets busier or quieter favours neither side.
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                tries[name].append(sides[name]())
                print(preset, name, json.dumps(tries[name][-1]), flush=True)
        best = {k: max(v, key=lambda t: t["episodes_per_second"]) for k, v in tries.items()}
        results["runs"][preset] = best["ours"]
        if args.with_peer:
            results.setdefault("trl", {})[preset] = best["trl"]
            results.setdefault("vs_trl", {})[preset] = compare(preset, best["ours"], best["trl"])
            if len(tries["ours"]) > 1:
                results.setdefault("tries", {})[preset] = tries
                pairs = results.setdefault("pairs", {})[preset] = pair_ratios(tries)
                print(f"{preset} episodes/s ours / TRL by pair, in run order: "
                      f"{', '.join(f'x{r:.2f}' for r in pairs)} (smallest x{min(pairs):.2f})", flush=True)
        results["runs"][preset]["sampling"] = sampling_with_and_without_cache(base, args.batch, args.new_tokens)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    text = json.dumps(results, indent=2)
    (out / "bench_ppo.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
