"""How many pretraining steps fit in a few minutes of this machine.

A fixed step count that suits a recent CPU runs two or three times as long on an older
one (AVX2 without AVX-512 does a half to a third of the fp32 matmul work a second), so a job with
a wall-clock budget, such as the embedded default, gives pretraining minutes
instead: :func:`time_train_step` times the real training step of the model the run
will build (its preset, vocabulary and batch shape; forward, backward and a fused
AdamW step on random tokens) in this process, with the threads one training process
gets, and :func:`steps_within` turns that into a step count, never above the run's
``max_steps``. Hand-written: no library sizes a run to a time budget from a timed step.
"""

from __future__ import annotations

import os
import time
from typing import Any


def time_train_step(settings: dict[str, Any], vocab_size: int, num_processes: int = 1, steps: int = 8,
                    warmup: int = 3) -> float:
    """Seconds of one optimizer step (``grad_accum`` micro-batches of
    ``micro_batch_size`` x ``seq_len`` tokens) of a freshly built ``preset`` model in
    fp32, on the first GPU when there is one, else on the CPU threads one of
    ``num_processes`` training processes gets, with the pretraining stage's own loss
    (:func:`~crawl2chat.stages.training.pretrain.causal_lm_loss`)."""
    import torch

    from crawl2chat.stages.training.models import build_model, model_config
    from crawl2chat.stages.training.pretrain import causal_lm_loss

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, num_processes)))
    try:
        rows, seq_len = int(settings["micro_batch_size"]), int(settings["seq_len"])
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = build_model(model_config(settings["preset"], vocab_size=vocab_size, seq_len=seq_len)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        generator = torch.Generator().manual_seed(0)
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            for _ in range(int(settings.get("grad_accum", 1))):
                tokens = torch.randint(0, vocab_size, (rows, seq_len + 1), generator=generator)
                causal_lm_loss(model, {"tokens": tokens.to(device)})[0].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        # The fastest step: other work on the machine while these few steps run only slows
        # them, and must not cost the run its steps (the loop's own average sits 5-10% above it).
        return min(times)
    finally:
        torch.set_num_threads(threads)


def steps_within(minutes: float, step_seconds: float, max_steps: int, least: int) -> int:
    """The steps of ``step_seconds`` that fit in ``minutes``: at most ``max_steps``, at
    least ``least`` (a run shorter than its warm-up learns little)."""
    return max(min(least, max_steps), min(max_steps, int(minutes * 60 / step_seconds)))
