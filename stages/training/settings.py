"""Settings of the training stages: the knobs every stage shares (:class:`TrainConfig`)
and each stage's own. Pure pydantic, so validating them imports neither torch nor
Accelerate."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


# ---------------------------------------------------------------- trainer

class RollbackConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_rollbacks: int = 3  # the run fails after this many rollbacks
    lr_factor: float = 0.5  # learning rate multiplier applied at each rollback
    spike_factor: float = 4.0  # a loss above spike_factor x mean(recent losses) is a spike; 0 disables
    spike_window: int = 32  # number of recent good losses that mean is taken over


class TrainConfig(BaseModel):
    """Knobs common to every training stage; stages subclass it with their own."""

    model_config = ConfigDict(extra="forbid")

    seq_len: int = 256
    micro_batch_size: int = 8  # sequences per process per forward pass
    grad_accum: int = 1  # micro-batches per optimizer step; global batch = micro x accum x processes
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    schedule: Literal["cosine", "linear", "polynomial", "step", "wsd", "constant"] = "cosine"
    poly_power: float = 2.0  # polynomial schedule exponent
    step_every: int = 1000  # step schedule: multiply by step_gamma every step_every steps
    step_gamma: float = 0.1
    decay_fraction: float = 0.2  # wsd: share of max_steps spent decaying
    optimizer: Literal["adamw", "lion"] = "adamw"
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    clip_norm: float = 1.0  # 0 disables clipping (the norm is still measured)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    grad_checkpointing: bool = False
    eval_every: int = 200
    eval_batches: int = 20
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 1
    seed: int = 1337
    peak_flops: float | None = None  # per device, for MFU; measured at start when unset
    rollback: RollbackConfig = Field(default_factory=RollbackConfig)
    # Fault injection for exercising the rollback path: the loss of these
    # global batch indices is made NaN.
    inject_nan_at_batches: list[int] = Field(default_factory=list)


# ---------------------------------------------------------------- pretrain

class PretrainConfig(TrainConfig):
    preset: str = "cpu"
    vocab_size: int = 8192  # tokenizer trained on the data when no tokenizer is given
    tokenizer: str | None = None  # an existing tokenizer folder to reuse instead
    tokenizer_max_docs: int | None = 200_000  # documents sampled to train the tokenizer
    val_fraction: float = 0.01  # share of documents (by id hash) held out for validation
    # Draw training documents by the data stage's sample_weight (balance.mode=weight), so each
    # language's (or source's) token share follows the balance target; False: uniform windows over
    # the packed tokens (the corpus's natural mixture). Data without weights is read uniformly.
    sample_by_weight: bool = True


# ---------------------------------------------------------------- sft

class SFTConfig(TrainConfig):
    seq_len: int = 512
    micro_batch_size: int = 8
    max_steps: int = 300
    lr: float = 1e-4
    min_lr: float = 1e-5
    warmup_steps: int = 10
    weight_decay: float = 0.0
    eval_every: int = 100
    checkpoint_every: int = 100
    pack: bool = True  # several conversations per row; False: one per row, padded
    val_fraction: float = 0.05  # share of conversations (by content hash) held out


# ---------------------------------------------------------------- reward

class RewardConfig(TrainConfig):
    seq_len: int = 512  # prompt + answer tokens per side; prompts are cut from the left
    micro_batch_size: int = 8  # pairs
    max_steps: int = 300
    lr: float = 5e-5
    min_lr: float = 5e-6
    warmup_steps: int = 10
    weight_decay: float = 0.0
    eval_every: int = 100
    checkpoint_every: int = 100
    val_fraction: float = 0.1  # share of pairs (by content hash) held out for eval_accuracy


# ---------------------------------------------------------------- dpo

class DPOConfig(TrainConfig):
    seq_len: int = 512
    micro_batch_size: int = 8  # pairs
    max_steps: int = 300
    lr: float = 1e-5
    min_lr: float = 1e-6
    warmup_steps: int = 10
    weight_decay: float = 0.0
    eval_every: int = 100
    checkpoint_every: int = 100
    val_fraction: float = 0.1
    beta: float = 0.1  # strength of the implicit KL constraint to the reference
    label_smoothing: float = 0.0  # assumed share of flipped labels (conservative DPO)


# ---------------------------------------------------------------- ppo

class PPOConfig(TrainConfig):
    """Optimizer, schedule, clipping, checkpoints and seed come from :class:`TrainConfig`;
    its ``seq_len``, evaluation and rollback fields do not apply here (lengths are
    ``max_prompt_len`` + ``max_new_tokens``; a non-finite gradient skips its minibatch)."""

    max_steps: int = 100  # PPO steps (rollouts)
    lr: float = 1e-5
    min_lr: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.0
    schedule: Literal["cosine", "linear", "polynomial", "step", "wsd", "constant"] = "constant"
    micro_batch_size: int = 8  # answers per forward pass in the optimisation phase
    # optimizer step = micro_batch_size x grad_accum answers (per process)
    eval_every: int = 0  # unused by PPO (no held-out set)
    checkpoint_every: int = 20  # rollouts between checkpoints (0: none); a rerun resumes from the newest
    rollout_batch_size: int = 16  # prompts per process per rollout
    ppo_epochs: int = 4
    max_prompt_len: int = 256  # longer prompts keep their end
    max_new_tokens: int = 64
    temperature: float = 1.0
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.5
    ent_coef: float = 0.0
    kl_coef: float = 0.05  # initial coefficient of the per-token KL penalty
    adaptive_kl: bool = False
    kl_target: float = 6.0  # target per-answer KL of the adaptive controller
    kl_horizon: int = 10000
    missing_eos_penalty: float = -1.0  # added to the score of an answer that never ended
    save_value_model: bool = True
