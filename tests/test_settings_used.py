"""No training setting is accepted and ignored.

Every field of every stage's settings model is either read by the code that stage
runs (the table names where) or refused with a message naming it; a new field
without an entry here fails the walk. The settings this project wired or seeded
lately are also checked by what they do: gradient checkpointing in the post-training
models, the reward margin, PPO's entropy bonus, Lion's own default learning rate and
the held-out split of small post-training sets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from crawl2chat.stages.settings import Config, SettingsError, load_settings
from crawl2chat.stages.training import settings as S

SRC = Path(S.__file__).parent
REFUSED = "refused"

# The modules each stage's script runs its settings through.
MODULES = {
    S.PretrainConfig: ("pretrain", "trainer"),
    S.SFTConfig: ("sft", "sampling", "trainer"),
    S.RewardConfig: ("reward", "sampling", "trainer"),
    S.DPOConfig: ("dpo", "reward", "sampling", "trainer"),
    S.PPOConfig: ("ppo", "trainer"),
    S.MLMConfig: ("mlm", "encoders", "trainer"),
    S.SpanConfig: ("span", "encoders", "trainer"),
    S.ContrastiveConfig: ("contrastive", "encoders", "trainer"),
}

# What every stage run by the shared Trainer reads, and where.
LOOP = {
    "micro_batch_size": "trainer", "grad_accum": "trainer", "max_steps": "trainer", "lr": "trainer",
    "min_lr": "trainer", "warmup_steps": "trainer", "schedule": "trainer", "poly_power": "trainer",
    "step_every": "trainer", "step_gamma": "trainer", "decay_fraction": "trainer", "optimizer": "trainer",
    "betas": "trainer", "weight_decay": "trainer", "clip_norm": "trainer", "mixed_precision": "trainer",
    "checkpoint_every": "trainer", "keep_checkpoints": "trainer", "log_every": "trainer", "seed": "trainer",
}
TRAINER = {**LOOP, "eval_every": "trainer", "eval_batches": "sampling", "peak_flops": "trainer",
           "rollback": "trainer", "inject_nan_at_batches": "trainer", "tp_size": "trainer",
           "dp_shard": "trainer"}

EVIDENCE: dict[type, dict[str, str]] = {
    S.PretrainConfig: {**TRAINER, "seq_len": "pretrain", "eval_batches": "pretrain", "grad_checkpointing": "pretrain",
                       "preset": "pretrain", "vocab_size": "pretrain", "tokenizer": "pretrain",
                       "tokenizer_max_docs": "pretrain", "val_fraction": "pretrain", "tokenizer_type": "pretrain",
                       "sample_by_weight": "pretrain", "pp_size": "trainer", "pp_schedule": "trainer",
                       "compile": "trainer"},
    S.SFTConfig: {**TRAINER, "seq_len": "sft", "grad_checkpointing": "sft", "pack": "sft", "val_fraction": "sft"},
    S.RewardConfig: {**TRAINER, "seq_len": "reward", "grad_checkpointing": "reward", "val_fraction": "reward",
                     "margin": "reward"},
    S.DPOConfig: {**TRAINER, "seq_len": "reward", "grad_checkpointing": "dpo", "val_fraction": "reward",
                  "beta": "dpo", "label_smoothing": "dpo"},
    S.PPOConfig: {**LOOP, "micro_batch_size": "ppo", "grad_accum": "ppo", "max_steps": "ppo", "clip_norm": "ppo",
                  "checkpoint_every": "ppo", "keep_checkpoints": "ppo", "log_every": "ppo", "seed": "ppo",
                  "grad_checkpointing": "ppo",
                  **{f: "ppo" for f in ("rollout_batch_size", "ppo_epochs", "max_prompt_len", "max_new_tokens",
                                        "temperature", "gamma", "lam", "cliprange", "cliprange_value", "vf_coef",
                                        "ent_coef", "kl_coef", "adaptive_kl", "kl_target", "kl_horizon",
                                        "missing_eos_penalty", "save_value_model", "rollback",
                                        "inject_nan_at_batches")},
                  # The trainer's fields PPO's own loop has no use for.
                  **{f: REFUSED for f in S.NOT_FOR_PPO}},
    S.MLMConfig: {**TRAINER, **{f: "encoders" for f in ("seq_len", "vocab_size", "tokenizer", "tokenizer_type",
                                                        "tokenizer_max_docs", "val_fraction", "eval_batches")},
                  **{f: "mlm" for f in ("preset", "grad_checkpointing", "mlm_probability", "mask_replace_prob",
                                        "random_replace_prob", "whole_word_masking")}},
    S.SpanConfig: {**TRAINER, **{f: "encoders" for f in ("seq_len", "vocab_size", "tokenizer", "tokenizer_type",
                                                         "tokenizer_max_docs", "val_fraction", "eval_batches",
                                                         "noise_density", "mean_span_length", "num_sentinels")},
                   **{f: "span" for f in ("preset", "grad_checkpointing")}},
    S.ContrastiveConfig: {**TRAINER, **{f: "encoders" for f in ("vocab_size", "tokenizer_type", "tokenizer_max_docs",
                                                                "val_fraction", "eval_batches")},
                          **{f: "contrastive" for f in ("seq_len", "tokenizer", "preset", "grad_checkpointing",
                                                        "temperature", "pooling", "dropout", "queue_size", "momentum",
                                                        "hard_negatives", "hard_negative_weight", "positives",
                                                        "init_encoder", "retrieval_pairs")}},
    S.RollbackConfig: {"max_rollbacks": "trainer", "lr_factor": "trainer", "spike_factor": "trainer",
                       "spike_window": "trainer"},
    S.PPORollbackConfig: {"max_rollbacks": "ppo", "lr_factor": "ppo"},
}
MODULES[S.RollbackConfig] = ("trainer",)
MODULES[S.PPORollbackConfig] = ("ppo",)


def _source(module: str) -> str:
    return (SRC / f"{module}.py").read_text()


def _reads(module: str, field: str) -> bool:
    """``module`` reads ``field`` off a settings object (``cfg.x``, ``c.x``, ``self.cfg.x``,
    ``cfg.rollback.x`` / ``rb.x`` for the rollback section)."""
    return re.search(rf"\b(?:cfg|c|rb|rollback)\.{field}\b", _source(module)) is not None


def _fields(model: type) -> set[str]:
    """The fields a user can set on ``model``: its own, plus, for PPO, the trainer
    fields it refuses (they are a TrainConfig's, so a user may well try them)."""
    names = set(model.model_fields)
    if model is S.PPOConfig:
        names |= set(S.TrainConfig.model_fields)
    return names


@pytest.mark.parametrize("model", list(EVIDENCE), ids=lambda m: m.__name__)
def test_every_setting_is_used_by_its_stage_or_refused(model):
    table = EVIDENCE[model]
    assert set(table) == _fields(model), (
        f"{model.__name__}: fields without evidence {sorted(_fields(model) - set(table))}, "
        f"evidence for no field {sorted(set(table) - _fields(model))}")
    for field, where in table.items():
        if where == REFUSED:
            value = S.TrainConfig.model_fields[field].get_default(call_default_factory=True)
            with pytest.raises(ValidationError, match=rf"\b{field}\b does not apply"):
                model(**{field: value})  # refused even at its trainer default: it would mean nothing here
            continue
        assert where in MODULES[model], f"{model.__name__}.{field}: {where} is not among the stage's modules"
        assert _reads(where, field), f"{model.__name__}.{field} is never read in {where}.py"


def test_ppo_script_hands_its_settings_to_the_shared_builders():
    """The loop fields PPO leaves to trainer.py reach it: the optimizer, the schedule and
    the accelerator (precision, seed) are built from PPO's own settings object."""
    src = _source("ppo")
    for call in ("build_optimizer(ac, cfg, ", "build_scheduler(self.optimizer, cfg.model_copy(",
                 "make_accelerator(cfg)"):
        assert call in src, call


def test_ppo_refuses_trainer_settings_by_name_in_the_project_tree():
    with pytest.raises(SettingsError, match=r"ppo\.train: .*seq_len does not apply to PPO"):
        load_settings(Config, None, {"ppo.train.seq_len": 128})
    with pytest.raises(SettingsError, match=r"rollback\.spike_factor does not apply to PPO"):
        load_settings(Config, None, {"ppo.train.rollback.spike_factor": 2.0})
    cfg = load_settings(Config, None, {"ppo.train.rollback.max_rollbacks": 2})  # PPO rolls back too
    assert cfg.ppo.train.rollback.max_rollbacks == 2
    cfg = load_settings(Config, None, {"ppo.train.grad_checkpointing": True})  # applies to PPO: accepted
    assert cfg.ppo.train.grad_checkpointing


def test_grad_checkpointing_takes_effect_on_the_post_training_models():
    """The helper SFT, reward, DPO and PPO call turns checkpointing on in a causal LM and
    in a sequence classifier (reward model, PPO critic) alike, and backward still runs."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from crawl2chat.stages.training.models import enable_grad_checkpointing, is_checkpointing, model_config

    for cls in (AutoModelForCausalLM, AutoModelForSequenceClassification):
        conf = model_config("tiny", vocab_size=64, seq_len=16, pad_token_id=0, eos_token_id=1)
        conf.num_labels = 1
        model = cls.from_config(conf)
        assert not is_checkpointing(model)
        enable_grad_checkpointing(model).train()
        assert is_checkpointing(model) and not model.config.use_cache
        model(input_ids=torch.randint(2, 64, (2, 16))).logits.float().sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_reward_margin_setting_and_per_pair_margin():
    from crawl2chat.stages.training.chat_data import preference_pair
    from crawl2chat.stages.training.reward import collate_pairs

    assert S.RewardConfig().margin == 0.1
    own = preference_pair({"prompt": "q", "chosen": "a", "rejected": "b", "margin": 0.7})
    none = preference_pair({"prompt": "q", "chosen": "a", "rejected": "b"})
    null = preference_pair({"prompt": "q", "chosen": "a", "rejected": "b", "margin": None})  # a Parquet null
    assert (own["margin"], none["margin"], null["margin"]) == (0.7, None, None)
    enc = [{"chosen": [1, 2], "rejected": [1, 3], "chosen_mask": [0, 1], "rejected_mask": [0, 1], "margin": p["margin"]}
           for p in (own, none, null)]
    assert collate_pairs(enc, 0, S.RewardConfig().margin)["margin"].tolist() == pytest.approx([0.7, 0.1, 0.1])
    assert collate_pairs(enc, 0, 0.0)["margin"].tolist() == pytest.approx([0.7, 0.0, 0.0])


def test_seeded_defaults_ent_coef_and_lion_learning_rates():
    assert S.PPOConfig().ent_coef == 0.01
    for cls in (S.PretrainConfig, S.SFTConfig, S.RewardConfig, S.DPOConfig, S.PPOConfig):
        adamw, lion = cls(), cls(optimizer="lion")
        assert adamw.lr == cls.default_lr and adamw.min_lr == pytest.approx(adamw.lr / 10)
        assert lion.lr == pytest.approx(cls.default_lr * S.LION_LR_FACTOR) and 3 <= adamw.lr / lion.lr <= 10
        assert lion.min_lr == pytest.approx(lion.lr / 10)
        assert cls(optimizer="lion", lr=3e-4).lr == 3e-4  # an explicit lr always wins
    # Through the project tree, where every section starts from its full defaults: choosing
    # Lion alone still moves lr to Lion's default, and the settings file a stage script
    # reads keeps following the optimizer.
    # The embedded default's cpu-small preset takes its own AdamW default (6e-3), a fifth of it with Lion.
    assert load_settings(Config, None, {}).pretrain.train.lr == pytest.approx(6e-3)
    assert S.PretrainConfig(preset="tiny").lr == S.PretrainConfig.default_lr
    cfg = load_settings(Config, None, {"pretrain.train.optimizer": "lion"})
    assert cfg.pretrain.train.lr == pytest.approx(1.2e-3)
    dumped = cfg.pretrain.train.model_dump(mode="json")
    assert dumped["lr"] is None and dumped["min_lr"] is None
    assert S.PretrainConfig.model_validate(dumped).lr == pytest.approx(1.2e-3)
    assert S.PretrainConfig.model_validate({**dumped, "optimizer": "adamw"}).lr == pytest.approx(6e-3)
    explicit = load_settings(Config, None, {"pretrain.train.optimizer": "lion", "pretrain.train.lr": 5e-4})
    assert explicit.pretrain.train.model_dump()["lr"] == 5e-4


def test_small_post_training_sets_hold_out_a_tail_or_say_there_is_none():
    from crawl2chat.stages.training.chat_data import (SPLIT_HASH, SPLIT_HASH_TAIL, SPLIT_NONE, is_held_out,
                                                      split_held_out)

    many = [f"row {i}" for i in range(400)]
    held, rule = split_held_out(many, 0.1)
    assert rule == SPLIT_HASH and held == [is_held_out(k, 0.1) for k in many]
    # Three distinct rows, each repeated: the hash holds none of them out at 5%.
    few = ["a", "b", "c"] * 10
    assert not any(is_held_out(k, 0.05) for k in set(few))
    held, rule = split_held_out(few, 0.05)
    assert rule == SPLIT_HASH_TAIL and len({k for k, h in zip(few, held) if h}) == 1
    assert all(h == held[few.index(k)] for k, h in zip(few, held))  # copies of a row stay on one side
    assert split_held_out(list(reversed(few)), 0.05)[0] == list(reversed(held))  # row order does not matter
    assert split_held_out(["a"] * 5, 0.05) == ([False] * 5, SPLIT_NONE)
    assert split_held_out(many, 0.0) == ([False] * 400, SPLIT_NONE)


def test_reports_say_there_is_no_held_out_set_instead_of_nan():
    from crawl2chat.stages.training.registry import STAGES

    assert STAGES["sft"].report({"steps": 5, "held_out": 0}) == "5 steps, no held-out set"
    assert STAGES["reward"].report({"held_out": 0}) == "no held-out set"
    assert STAGES["dpo"].report({"held_out": 0}) == "no held-out set"
    assert "nan" not in STAGES["ppo"].report({"reward_mean_first": float("nan")}).lower()
    assert STAGES["reward"].report({"held_out": 4, "eval_accuracy": 0.75}) == "eval_accuracy 0.750"


def test_mixed_precision_and_held_out_share_are_refused_where_they_could_not_take_effect():
    """fp16 on a CPU would train in fp32 under the name fp16: refused. A held-out share outside
    [0, 1) is refused with the field named. YAML's unquoted ``no`` (read as false) means "no"."""
    from crawl2chat.stages.settings import load_config, parse_override
    from crawl2chat.stages.training.trainer import resolve_mixed_precision

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="mixed_precision=fp16 needs a CUDA GPU"):
            resolve_mixed_precision("fp16")
        assert resolve_mixed_precision("auto") == "no" and resolve_mixed_precision("bf16") == "bf16"
    cfg = load_config(overrides=dict([parse_override("pretrain.train.mixed_precision=no")]))
    assert cfg.pretrain.train.mixed_precision == "no"
    for stage in ("pretrain", "mlm", "span", "distill"):
        for bad, why in ((1.5, "less than 1"), (-0.5, "greater than or equal to 0")):
            with pytest.raises(SettingsError, match=rf"{stage}\.train\.val_fraction: Input should be {why}"):
                load_config(overrides={f"{stage}.train.val_fraction": bad})


def test_a_stage_command_refuses_another_stages_setting(tmp_path):
    """``crawl2chat sft`` reads the sft, home and tracking settings only: a --set of another
    stage's would be accepted and never read, so it is refused, naming the command that reads it."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "crawl2chat.cli", "sft", "--base", "b", "--data", "d",
                           "--set", "pretrain.train.lr=5"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --set pretrain.train.lr: the sft command reads only sft.*, home and tracking.* "
        "(the pretrain settings take effect in crawl2chat pretrain)")
