"""Pretraining throughput and quality at fixed compute on this machine.

Throughput: for two or three model sizes, a short run through the real
``accelerate launch`` with one process and with 2-process DDP; reports
tokens/s, model-FLOPs utilisation against the peak dense fp32 matmul
throughput measured at the start of this same run (all cores), and peak
memory (resident set of a training process on CPU).

Quality: Tiny Shakespeare (last 10% of the file for validation), a 4-layer,
128-wide, 4-head model, 2000 steps of 12 x 64 tokens — nanoGPT's char-level
CPU setting, whose reference run reaches 1.88 nats/char = 2.71 bits per byte.
A byte-level BPE token carries more than one character, so at the same tokens
per step this run sees more text; bits per byte compares the two fairly.

Side by side with nanoGPT (``--with-peer`` creates its venv, see ``benchmarks/peers.py``):
nanoGPT's own ``train.py`` (the unmodified sources in ``../shared/peers/nanogpt``, run in a
scratch copy with the same ``input.txt``) at that shape, then ours, one after the other in
this invocation (ours: the whole ``crawl2chat pretrain`` command in a new project folder,
Prefect, MLflow and the end-of-stage evaluation included; nanoGPT: its data preparation and
``train.py``); prints tokens/s, whole-command wall time and bits per byte of both, and
the ratios, with the two figures that say why tokens/s alone misleads here: training FLOPs
a token (a 512-token vocabulary and SwiGLU's three matrices against 65 characters and a
GELU MLP's two) and text bytes a second (a BPE token carries a few characters).

    python benchmarks/bench_pretrain.py [--out DIR] [--quality-steps 2000] [--skip-quality]
        [--presets tiny,cpu-small,cpu] [--steps 30]   (--presets "" skips throughput)
    python benchmarks/bench_pretrain.py --presets "" --with-peer [--repeat 2]   # the paired nanoGPT run only
    python benchmarks/bench_pretrain.py --presets "" --with-peer --short-steps 500,1000   # and time to a quality
    python benchmarks/bench_pretrain.py --presets "" --with-peer --compile   # both sides torch.compile their step

Prints one JSON document and writes it to OUT/bench_pretrain.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import os
import platform
import shutil
import time
from pathlib import Path

import torch

from crawl2chat.tasks.train import launch_training
from crawl2chat.stages.training.trainer import measure_peak_flops

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/peers.py
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"
NANOGPT_REF_BPB = 2.71


def throughput(data: Path, out: Path, preset: str, steps: int, num_processes: int) -> dict:
    run = out / f"{preset}-np{num_processes}"
    shutil.rmtree(run, ignore_errors=True)  # a finished run folder would be reused, not timed
    t0 = time.perf_counter()
    launch_training("pretrain", {"data": str(data)}, str(run), max_steps=steps, num_processes=num_processes,
                    overrides=[f"preset={preset}", "vocab_size=2048", "val_fraction=0.1", "seq_len=256", "micro_batch_size=8",
                      "eval_every=0", "checkpoint_every=0", "eval_batches=2", "warmup_steps=5",
                      f"tokenizer={out / 'tokenizer'}"])
    m = json.loads((run / "metrics.json").read_text())
    return {
        "preset": preset, "processes": num_processes, "params_m": m["params"] / 1e6, "steps": m["steps"],
        "tokens_per_second": m["tokens_per_second"],
        "achieved_gflops": m["flops_per_token"] * m["tokens_per_second"] / 1e9,
        "mfu_vs_process_peak": m["mfu"], "peak_memory_mb_per_process": m["peak_memory_mb"],
        "wall_seconds_incl_launch": time.perf_counter() - t0,
    }


def quality(out: Path, steps: int, compile: bool = False) -> dict:
    """The whole ``crawl2chat pretrain`` command, as a user runs it in a new project folder:
    start-up, the Prefect flow and task runs, MLflow's records, tokenizer and packing, the
    training process, the model's registration and the end-of-stage evaluation."""
    import subprocess

    project = out / f"project-{steps}"
    shutil.rmtree(project, ignore_errors=True)  # a finished run folder would be reused, not timed
    project.mkdir(parents=True)
    settings = ["vocab_size=512", "val_fraction=0.1", "seq_len=64", "micro_batch_size=12", "grad_accum=1",
                "lr=1e-3", "min_lr=1e-4", "warmup_steps=100", "schedule=cosine", "weight_decay=0.1",
                # nanoGPT's evaluation and saving in this pairing: one evaluation at the end
                # (its eval_interval is the run's length; 20 batches of each split, 40 forward
                # passes, here 40 held-out batches) and one checkpoint.
                "betas=[0.9, 0.99]", f"eval_every={steps}", "eval_batches=40",
                f"checkpoint_every={steps}", f"compile={str(compile).lower()}"]
    cmd = [str(Path(sys.executable).with_name("crawl2chat")), "pretrain", "--data", str(SHAKESPEARE),
           "--out", "run", "--max-steps", str(steps), "--preset", "cpu-small",
           *[a for kv in settings for a in ("--set", f"pretrain.train.{kv}")]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (out / f"command-{steps}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"crawl2chat pretrain exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    run = project / "run" / "latest"
    m = json.loads((run / "metrics.json").read_text())
    train = json.loads((run / "data" / "index.json").read_text())["train"]
    return {"steps": m["steps"], "tokens_per_step": 12 * 64, "val_loss_nats_per_token": m["val_loss"],
            "bytes_per_token": train["bytes"] / train["tokens"], "flops_per_token": m["flops_per_token"],
            "bytes_per_second": m["tokens_per_second"] * train["bytes"] / train["tokens"],
            "val_bpb": m["val_bpb"], "nanogpt_char_reference_bpb": NANOGPT_REF_BPB,
            "train_wall_seconds": m["wall_seconds"], "wall_seconds_incl_launch": wall,
            "params_m": m["params"] / 1e6, "tokens_per_second": m["tokens_per_second"], "compile": compile,
            "first_step_seconds": m["first_step_seconds"]}


NANOGPT_ARGS = ["--device=cpu", "--eval_iters=20", "--log_interval=1", "--block_size=64",
                "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--dropout=0.0"]


def nanogpt(out: Path, steps: int, with_peer: bool, compile: bool = False) -> dict:
    """nanoGPT's char-level CPU recipe on Tiny Shakespeare, in its own venv; tokens/s from
    the median of its per-iteration times, bits per byte from its final validation loss
    (one character is one byte in this ASCII text)."""
    import re
    import statistics
    import subprocess

    from peers import peer_python, shared_peer_source

    python = peer_python("nanogpt", ["torch==2.13.0", "numpy", "requests"], with_peer)
    work = out / "nanogpt"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(shared_peer_source("nanogpt"), work)
    shutil.copy(SHAKESPEARE, work / "data" / "shakespeare_char" / "input.txt")  # present: prepare.py downloads nothing
    t0 = time.perf_counter()
    subprocess.run([str(python), "data/shakespeare_char/prepare.py"], cwd=work, check=True, capture_output=True)
    proc = subprocess.run([str(python), "train.py", "config/train_shakespeare_char.py", *NANOGPT_ARGS, f"--compile={compile}",
                           f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--eval_interval={steps}",
                           "--out_dir=out"], cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"nanoGPT failed ({proc.returncode}): {proc.stderr[-2000:]}")
    times = [float(t) for t in re.findall(r"^iter \d+: loss [\d.]+, time ([\d.]+)ms", proc.stdout, re.M)][1:]
    val = [float(v) for v in re.findall(r"val loss ([\d.]+)", proc.stdout)]
    dt = statistics.median(times) / 1000
    # Its model's training FLOPs per token by its own estimate_mfu formula (6N + 12 L H Q T),
    # N the parameters less the position embeddings, the 65-character vocabulary included.
    layers, width, vocab, block = 4, 128, 65, 64
    n_params = layers * 12 * width * width + vocab * width
    flops = 6 * n_params + 12 * layers * width * block
    return {"steps": steps, "tokens_per_step": 12 * 64, "tokens_per_second": 12 * 64 / dt,
            "bytes_per_token": 1.0, "bytes_per_second": 12 * 64 / dt, "flops_per_token": flops,
            "val_bpb": val[-1] / math.log(2), "wall_seconds_incl_launch": wall, "compile": compile}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/crawl2chat-bench-pretrain")
    ap.add_argument("--presets", default="tiny,cpu-small,cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quality-steps", type=int, default=2000)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--with-peer", action="store_true", help="run nanoGPT beside the quality run (its venv is made "
                                                             "on first use)")
    ap.add_argument("--repeat", type=int, default=1, help="with --with-peer: pairs of runs in alternating order "
                    "(nanoGPT first, then ours first, ...); each side's fastest run is compared")
    ap.add_argument("--compile", action="store_true", help="both sides compile their training step: ours "
                    "compile=true, nanoGPT --compile=True (torch.compile of its model)")
    ap.add_argument("--short-steps", default="", help="comma-separated step counts: after the quality run(s), ours "
                    "again with each (the same recipe, its schedule over that length), whole command and bits per "
                    "byte against the full-length run(s): the time each side takes to a quality")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.set_num_threads(os.cpu_count() or 1)
    machine_peak = measure_peak_flops("cpu", torch.float32, n=1024, seconds=2.0)
    result: dict = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                                "peak_fp32_matmul_gflops": machine_peak / 1e9,
                                "load_average_at_start": os.getloadavg()}}
    print(json.dumps(result["machine"]), flush=True)

    data = SHAKESPEARE
    if not data.exists():  # throughput does not depend on the text: any corpus will do
        data = out / "corpus.txt"
        data.write_text("".join(f"line {i} of a synthetic corpus for throughput\n" for i in range(100_000)))
    result["throughput"] = []
    for preset in filter(None, args.presets.split(",")):
        for n in (1, 2):
            row = throughput(data, out, preset, args.steps, n)
            print(json.dumps(row), flush=True)
            result["throughput"].append(row)
    # On a shared machine other work lowers any one measurement; the peak is the
    # best of the measurements before and after the runs.
    machine_peak = max(machine_peak, measure_peak_flops("cpu", torch.float32, n=1024, seconds=2.0))
    result["machine"]["peak_fp32_matmul_gflops"] = machine_peak / 1e9
    for row in result["throughput"]:
        row["mfu_vs_machine_peak"] = row["achieved_gflops"] * 1e9 / machine_peak
    if args.with_peer and SHAKESPEARE.exists() and not args.skip_quality:
        # The machine's speed drifts over minutes: alternate which side runs first and keep
        # each side's fastest run (by tokens/s), with every run listed.
        runs: dict[str, list[dict]] = {"nanogpt": [], "quality": []}
        for pair in range(max(1, args.repeat)):
            order = ("nanogpt", "quality") if pair % 2 == 0 else ("quality", "nanogpt")
            for side in order:
                row = (nanogpt(out, args.quality_steps, args.with_peer, args.compile) if side == "nanogpt"
                       else quality(out, args.quality_steps, args.compile))
                runs[side].append(row)
                print(json.dumps({side: row}), flush=True)
        for side, rows in runs.items():
            result[side] = max(rows, key=lambda r: r["tokens_per_second"])
        result["runs"] = runs
    elif not args.skip_quality and SHAKESPEARE.exists():
        result["quality"] = quality(out, args.quality_steps, args.compile)
        print(json.dumps(result["quality"]), flush=True)
    elif args.with_peer and SHAKESPEARE.exists():
        result["nanogpt"] = nanogpt(out, args.quality_steps, args.with_peer, args.compile)
        print(json.dumps({"nanogpt": result["nanogpt"]}), flush=True)
    short = [int(n) for n in args.short_steps.split(",") if n.strip()]
    if short and SHAKESPEARE.exists() and not args.skip_quality:
        result["quality_short"] = []
        for steps in short:
            row = quality(out, steps, args.compile)
            result["quality_short"].append(row)
            print(json.dumps({"quality_short": row}), flush=True)
    if "nanogpt" in result and "quality" in result:
        ours, peer = result["quality"], result["nanogpt"]
        result["vs_nanogpt"] = {"tokens_per_second": ours["tokens_per_second"] / peer["tokens_per_second"],
                                "bytes_per_second": ours["bytes_per_second"] / peer["bytes_per_second"],
                                "flops_per_second": (ours["tokens_per_second"] * ours["flops_per_token"])
                                / (peer["tokens_per_second"] * peer["flops_per_token"]),
                                "wall": ours["wall_seconds_incl_launch"] / peer["wall_seconds_incl_launch"],
                                "val_bpb": {"crawl2chat": ours["val_bpb"], "nanogpt": peer["val_bpb"]}}
        vs = result["vs_nanogpt"]
        print(f"vs nanoGPT, same run (fastest of {len(result.get('runs', {}).get('quality', [0]))} each): tokens/s x{vs['tokens_per_second']:.2f} ({ours['flops_per_token'] / 1e6:.1f} vs "
              f"{peer['flops_per_token'] / 1e6:.1f} MFLOP a token, so FLOP/s x{vs['flops_per_second']:.2f}), text bytes/s "
              f"x{vs['bytes_per_second']:.2f} ({ours['bytes_per_token']:.2f} bytes a BPE token, 1 a character), whole command "
              f"wall x{result['vs_nanogpt']['wall']:.2f}, bits per byte {ours['val_bpb']:.2f} vs {peer['val_bpb']:.2f}",
              flush=True)
        for row in result.get("quality_short", []):
            print(f"crawl2chat at {row['steps']} steps: {row['val_bpb']:.2f} bits per byte in "
                  f"{row['wall_seconds_incl_launch']:.1f} s whole command, against nanoGPT's {peer['val_bpb']:.2f} in "
                  f"{peer['wall_seconds_incl_launch']:.1f} s at {peer['steps']} steps "
                  f"(x{row['wall_seconds_incl_launch'] / peer['wall_seconds_incl_launch']:.2f} the wall time)", flush=True)
    result["machine"]["load_average_at_end"] = os.getloadavg()
    (out / "bench_pretrain.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
