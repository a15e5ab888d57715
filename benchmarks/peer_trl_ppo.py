"""TRL's PPO on the inputs of ``bench_ppo.py``: the peer side of ``bench_ppo.py --with-peer``.

Run with the python of TRL's own venv (``benchmarks/peers.py``; never the project's venv,
which has no TRL), as ``python benchmarks/peer_trl_ppo.py SPEC.json RESULT.json``. SPEC is
written by ``bench_ppo.py`` and names the local model folders and the run's shape:

* models: the policy and the frozen reference are both loaded from ``policy`` (the
  random-weight Llama base that ``bench_ppo.py`` builds), the critic and the frozen reward
  model both from ``reward`` (the same weights with a scalar head), all with
  ``from_pretrained`` from disk; the tokenizer is the one saved beside the policy. Nothing
  is downloaded.
* prompts: the token ids of ``bench_ppo.py``'s prompts exactly as this project's PPO
  encodes them (chat template with the assistant generation prompt), passed in SPEC, so
  both sides sample answers to the same prompt tokens.
* shape: ``batch`` prompts per rollout, ``epochs`` PPO epochs over ``minibatches``
  minibatches (one optimizer step each, as in ours), answers of at most ``new_tokens``
  tokens stopped at the chat template's end-of-turn token, plain sampling at
  ``temperature`` (no top-k/top-p), ``rollouts`` rollouts, AdamW at a constant ``lr``
  with betas (0.9, 0.95) and no weight decay, ``kl_coef``, ``vf_coef``, clip ranges 0.2,
  gamma 1, lambda 0.95, no missing-EOS penalty, fp32, no gradient checkpointing, no
  evaluation, no sample generations, no checkpoints, no logging integrations.

Differences that TRL's ``PPOTrainer`` does not let a caller remove:

* no entropy bonus in the loss (ours adds ``0.01 x entropy``; both compute the entropy);
* no gradient clipping (ours clips the global norm at 1.0);
* generation keeps the logits of every sampled step (``output_scores``) and takes the
  answer's log-probabilities from them; ours recomputes them in a forward pass;
* the critic and the policy run as two forward passes per minibatch in both, but TRL
  asks both for every hidden state (``output_hidden_states``);
* prompts are drawn by a shuffled data loader (each prompt once per pass over the 64),
  ours draws each batch's prompts at random with replacement: same prompt set and lengths.

Figures written to RESULT (JSON): ``episodes_per_second`` (answers per second over
``trainer.train()``, the PPO loop: rollouts, scoring and updates), ``loop_seconds``,
``loop_cpu_seconds`` (user + system CPU time of that loop), ``setup_seconds``
(imports, model loading and trainer construction),
``peak_memory_mb`` (this process's peak resident set, ``getrusage``, MiB: the same
measure as ours on CPU), the last logged TRL metrics, and the library versions.
The caller times the whole command (start to exit, the final policy save included).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main(argv: list[str] | None = None) -> dict:
    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: peer_trl_ppo.py SPEC.json RESULT.json")
    spec = json.loads(Path(argv[0]).read_text())
    result_path = Path(argv[1])
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: nothing is fetched
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["policy"], padding_side="left")
    pad_id = spec["pad_token_id"]
    tok.pad_token_id = pad_id
    policy = AutoModelForCausalLM.from_pretrained(spec["policy"])
    ref = AutoModelForCausalLM.from_pretrained(spec["policy"])
    value = AutoModelForSequenceClassification.from_pretrained(spec["reward"], num_labels=1, pad_token_id=pad_id)
    reward = AutoModelForSequenceClassification.from_pretrained(spec["reward"], num_labels=1, pad_token_id=pad_id)
    for m in (value, reward):
        m.config.use_cache = False
    prompts = Dataset.from_dict({"input_ids": spec["prompts"]})

    out = Path(spec["out"])
    args = PPOConfig(
        output_dir=str(out), seed=spec["seed"], report_to="none", disable_tqdm=True, logging_steps=1,
        save_strategy="no", eval_strategy="no", push_to_hub=False, num_sample_generations=0,
        per_device_train_batch_size=spec["batch"], gradient_accumulation_steps=1,
        num_mini_batches=spec["minibatches"], num_ppo_epochs=spec["epochs"],
        total_episodes=spec["batch"] * spec["rollouts"], local_rollout_forward_batch_size=spec["batch"],
        response_length=spec["new_tokens"], temperature=spec["temperature"], stop_token_id=spec["stop_token_id"],
        missing_eos_penalty=None, learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, kl_coef=spec["kl_coef"], vf_coef=spec["vf_coef"],
        cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95, bf16=False, fp16=False,
        gradient_checkpointing=False, dataloader_num_workers=0,
    )

    kept: list[dict] = []  # TRL's per-rollout metrics

    class KeepLogs(TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **_kw):
            if logs:
                kept.append(dict(logs))

    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=prompts, eval_dataset=None, callbacks=[KeepLogs()])
    setup = time.perf_counter() - t_start
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    trainer.train()
    loop, loop_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    trainer.save_model(str(out / "model"))  # the policy, as ours saves its actor
    episodes = args.num_total_batches * args.batch_size
    last = kept[-1] if kept else {}
    res = {
        "library": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "rollouts": args.num_total_batches, "episodes": episodes, "optimizer_steps_per_rollout":
            args.num_ppo_epochs * args.num_mini_batches * args.gradient_accumulation_steps,
        "episodes_per_second": episodes / loop, "rollouts_per_second": args.num_total_batches / loop,
        "loop_seconds": loop, "loop_cpu_seconds": loop_cpu, "setup_seconds": setup, "peak_memory_mb": peak_rss_mb(),
        "torch_threads": torch.get_num_threads(), "last_log": last,
    }
    result_path.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main()
