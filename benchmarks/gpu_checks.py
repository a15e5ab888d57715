"""The checks to run on a GPU machine, in one go: bf16 training, NCCL DDP, FSDP, tensor
and pipeline parallelism, each a real ``accelerate launch`` of the pretraining stage
on the same generated corpus, with tokens/s, model-FLOPs utilisation (against the
peak the trainer measures on the device at start) and the loss, in one table.

    python benchmarks/gpu_checks.py                 # every check the visible GPUs allow
    python benchmarks/gpu_checks.py --steps 300 --preset 124m --only bf16,ddp
    python benchmarks/gpu_checks.py --cpu-smoke     # the same checks, tiny, on CPU processes (gloo)

With one GPU only the single-process checks run (NCCL needs one device per process;
the multi-process ones are listed as skipped, with the reason). ``--cpu-smoke`` runs
every check on CPU processes with the tiny preset, so the script itself is known to
work on a machine without a GPU. Exit status 1 when a check that ran failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the model reads pages and learns which word comes next from the words before it while the "
         "optimizer moves every weight a little against its gradient and the loss goes down slowly").split()

# name -> (processes wanted: "all" GPUs or a number, settings, accelerate config)
CHECKS = {
    "bf16": (1, ["mixed_precision=bf16"], None),
    "ddp": ("all", ["mixed_precision=bf16"], None),
    "fsdp": ("all", ["mixed_precision=bf16"], "fsdp"),
    "tp": ("all", ["mixed_precision=bf16", "tp_size={n}"], None),
    "pp": ("all", ["mixed_precision=bf16", "pp_size={n}", "grad_accum={accum}"], None),
}


def corpus(path: Path, lines: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))
                              for _ in range(lines)) + "\n")
    return path


def run_check(name: str, n: int, args, data: Path, tok: Path, root: Path) -> dict:
    from crawl2chat.tasks.train import launch_training

    procs, settings, acc_config = CHECKS[name]
    overrides = [s.format(n=n, accum=max(4, 2 * n)) for s in settings]
    if args.cpu_smoke:
        overrides = [o for o in overrides if not o.startswith("mixed_precision")]
    overrides += [f"preset={args.preset}", f"seq_len={args.seq_len}", f"micro_batch_size={args.micro_batch}",
                  "eval_every=0", "checkpoint_every=0", "eval_batches=2", f"tokenizer={tok}", "val_fraction=0.05"]
    out = root / name
    t0 = time.perf_counter()
    try:
        launch_training("pretrain", {"data": str(data)}, str(out), max_steps=args.steps, overrides=overrides,
                        num_processes=n, accelerate_config=acc_config)
    except Exception as e:  # noqa: BLE001 - a failed check is a row of the table, the others still run
        return {"check": name, "processes": n, "ok": False, "error": f"{type(e).__name__}: {str(e)[-300:]}"}
    m = json.loads((out / "metrics.json").read_text())
    return {"check": name, "processes": n, "ok": True, "wall_s": round(time.perf_counter() - t0, 1),
            "tokens_per_second": round(m.get("tokens_per_second", 0.0)), "mfu": m.get("mfu"),
            "final_loss": m.get("final_train_loss"), "val_loss": m.get("val_loss"),
            "peak_memory_mb": m.get("peak_memory_mb"), "device": m.get("device")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--preset", default=None, help="model preset (default 124m on GPUs, tiny with --cpu-smoke)")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--only", default=",".join(CHECKS), help="comma-separated checks: " + ", ".join(CHECKS))
    ap.add_argument("--cpu-smoke", action="store_true", help="run every check tiny on CPU processes (gloo)")
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args(argv)

    import torch

    gpus = torch.cuda.device_count()
    if args.cpu_smoke:
        args.preset, args.seq_len, args.micro_batch = args.preset or "tiny", args.seq_len or 64, args.micro_batch or 4
        args.steps, width = min(args.steps, 10), 2
    elif gpus == 0:
        print("no GPU visible; run on a GPU machine, or use --cpu-smoke", file=sys.stderr)
        return 2
    else:
        args.preset, args.seq_len, args.micro_batch = args.preset or "124m", args.seq_len or 1024, args.micro_batch or 8
        width = gpus
        props = torch.cuda.get_device_properties(0)
        print(f"{gpus} x {props.name}, {props.total_memory / 2**30:.0f} GiB, bf16 "
              f"{'yes' if torch.cuda.is_bf16_supported() else 'no'}, NCCL {torch.cuda.nccl.version()}")

    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-checks-"))
    root.mkdir(parents=True, exist_ok=True)
    from crawl2chat.stages.training.pretrain import prepare_data
    from crawl2chat.stages.training.settings import PretrainConfig

    data = corpus(root / "corpus.txt", 4000 if args.cpu_smoke else 60000)
    tok, _ = prepare_data(PretrainConfig(vocab_size=512 if args.cpu_smoke else 8192, val_fraction=0.05), data,
                          root / "prep")
    rows = []
    for name in [c.strip() for c in args.only.split(",") if c.strip()]:
        if name not in CHECKS:
            print(f"unknown check {name!r}; choose from {', '.join(CHECKS)}", file=sys.stderr)
            return 2
        want = CHECKS[name][0]
        n = width if want == "all" else want
        if n < 2 and want == "all":
            rows.append({"check": name, "processes": n, "ok": None,
                         "error": "skipped: needs 2 or more GPUs (one device per NCCL process)"})
            continue
        if args.cpu_smoke and CHECKS[name][2] == "fsdp":  # refused on CPU (infra.launch.accelerate_command)
            rows.append({"check": name, "processes": n, "ok": None,
                         "error": "skipped: Accelerate runs FSDP on GPUs only"})
            continue
        print(f"== {name}: {n} process(es)", flush=True)
        rows.append(run_check(name, n, args, data, tok, root))
        print(json.dumps(rows[-1]), flush=True)

    print("\n| check | processes | tokens/s | MFU | final loss | peak MiB | result |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{r['mfu']:.3f}" if isinstance(r.get("mfu"), float) else "-"
        result = "ok" if r["ok"] else ("skipped" if r["ok"] is None else "FAILED: " + r["error"])
        loss = f"{r['final_loss']:.4f}" if isinstance(r.get("final_loss"), float) else "-"
        peak = f"{r['peak_memory_mb']:.0f}" if isinstance(r.get("peak_memory_mb"), float) else "-"
        print(f"| {r['check']} | {r['processes']} | {r.get('tokens_per_second', '-')} | {mfu} | {loss} | {peak} "
              f"| {result} |")
    (root / "gpu_checks.json").write_text(json.dumps(rows, indent=2))
    print(f"\nruns and gpu_checks.json in {root}")
    return 1 if any(r["ok"] is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
