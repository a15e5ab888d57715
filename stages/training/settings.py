"""Settings of the training stages: the knobs every stage shares (:class:`LoopConfig`,
and :class:`TrainConfig` for the stages run by the shared trainer) and each stage's
own. Pure pydantic, so validating them imports neither torch nor Accelerate.

Every field takes effect in its stage or is refused: PPO, which has its own loop,
refuses the trainer's sequence-length, evaluation and MFU fields and the rollback's
loss-spike fields with a message naming them (``tests/test_settings_used.py`` walks every field)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_serializer, field_validator, model_validator

# Lion's update is the sign of its momentum, so every entry has unit size: it needs a
# learning rate 3-10x below AdamW's (Chen et al., 2023). A stage's Lion default is its
# AdamW default times this.
LION_LR_FACTOR = 0.2
MIN_LR_FRACTION = 0.1  # min_lr default: this share of the peak learning rate


# ---------------------------------------------------------------- shared knobs

class RollbackConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_rollbacks: int = Field(3, ge=0)  # the run fails after this many rollbacks
    lr_factor: float = Field(0.5, gt=0, le=1)  # learning rate multiplier applied at each rollback
    spike_factor: float = Field(4.0, ge=0)  # a loss above spike_factor x mean(recent losses) is a spike; 0 disables
    spike_window: int = Field(32, ge=1)  # number of recent good losses that mean is taken over


class PPORollbackConfig(BaseModel):
    """PPO's rollback: on non-finite numbers only (a PPO loss moves with the rewards, so
    the trainer's loss-spike test would misfire; its fields are refused by name)."""

    model_config = ConfigDict(extra="forbid")

    max_rollbacks: int = Field(3, ge=0)  # the run fails after this many rollbacks in a row
    lr_factor: float = Field(0.5, gt=0, le=1)  # learning rate multiplier applied at each rollback


class LoopConfig(BaseModel):
    """Knobs of every training stage, PPO included: batch, optimizer, schedule,
    precision, checkpoints, seed."""

    model_config = ConfigDict(extra="forbid")

    # The stage's AdamW learning rate when ``lr`` is not set; subclasses set their own.
    default_lr: ClassVar[float] = 1e-3

    micro_batch_size: int = 8  # sequences per process per forward pass
    grad_accum: int = 1  # micro-batches per optimizer step; global batch = micro x accum x processes
    max_steps: int = 1000
    lr: float | None = Field(
        None, gt=0,
        description="Peak learning rate. Unset: the stage's AdamW default (pretrain 1e-3, or 6e-3 for the cpu-small "
                    "preset; SFT 1e-4, reward 5e-5, "
                    "DPO and PPO 1e-5), or a fifth of it with optimizer=lion (Lion needs a 3-10x smaller rate).")
    min_lr: float | None = Field(
        None, ge=0, description="Learning rate at the end of the decaying schedules. Unset: a tenth of lr.")
    warmup_steps: int = 100
    schedule: Literal["cosine", "linear", "polynomial", "step", "wsd", "constant"] = "cosine"
    poly_power: float = 2.0  # polynomial schedule exponent
    step_every: int = 1000  # step schedule: multiply by step_gamma every step_every steps
    step_gamma: float = 0.1
    decay_fraction: float = 0.2  # wsd: share of max_steps spent decaying
    optimizer: Literal["adamw", "lion"] = Field(
        "adamw", description="adamw, or lion (whose default lr is a fifth of the stage's AdamW default).")
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    clip_norm: float = 1.0  # 0 disables clipping (the norm is still measured)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML 1.1 reads an unquoted `no` as false
    grad_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass (less memory, ~30% more compute); "
                           "every stage's trained models.")
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 1
    seed: int = 1337

    # Whether lr / min_lr came from the defaults: they are then written back unset, so a
    # settings file keeps following the optimizer (and lr) it is later combined with.
    _lr_default: bool = PrivateAttr(False)
    _min_lr_default: bool = PrivateAttr(False)

    # Checked by name after validation, so a stage that redeclares a field's default keeps the range.
    _AT_LEAST_ONE: ClassVar[tuple[str, ...]] = ("micro_batch_size", "grad_accum", "max_steps", "log_every",
                                                 "keep_checkpoints", "step_every")
    _NOT_NEGATIVE: ClassVar[tuple[str, ...]] = ("warmup_steps", "checkpoint_every", "weight_decay", "clip_norm")
    _POSITIVE: ClassVar[tuple[str, ...]] = ("poly_power", "step_gamma", "decay_fraction")

    @model_validator(mode="after")
    def _check_ranges(self):
        bad = [f"{f} must be at least 1 (got {getattr(self, f)})" for f in self._AT_LEAST_ONE if getattr(self, f) < 1]
        bad += [f"{f} must not be negative (got {getattr(self, f)})" for f in self._NOT_NEGATIVE if getattr(self, f) < 0]
        bad += [f"{f} must be positive (got {getattr(self, f)})" for f in self._POSITIVE if getattr(self, f) <= 0]
        if self.decay_fraction > 1:
            bad.append(f"decay_fraction must be at most 1 (got {self.decay_fraction})")
        if bad:
            raise ValueError("; ".join(bad))
        return self

    @model_validator(mode="after")
    def _resolve_learning_rates(self):
        if self.lr is None:
            self.lr = self.adamw_default_lr() * (LION_LR_FACTOR if self.optimizer == "lion" else 1.0)
            self._lr_default = True
        if self.min_lr is None:
            self.min_lr = self.lr * MIN_LR_FRACTION
            self._min_lr_default = True
        return self

    def adamw_default_lr(self) -> float:
        """The AdamW learning rate an unset ``lr`` takes (before Lion's factor)."""
        return self.default_lr

    @field_serializer("lr", "min_lr")
    def _unset_when_default(self, value: float, info) -> float | None:
        return None if getattr(self, f"_{info.field_name}_default") else value


class TrainConfig(LoopConfig):
    """The knobs of the stages run by :class:`~crawl2chat.stages.training.trainer.Trainer`
    (pretraining, SFT, reward model, DPO); stages subclass it with their own."""

    seq_len: int = 256
    eval_every: int = 200
    eval_batches: int = 20
    peak_flops: float | None = None  # per device, for MFU; measured at start when unset
    rollback: RollbackConfig = Field(default_factory=RollbackConfig)
    tp_size: int = Field(
        1, ge=1,
        description="Tensor parallelism of the Llama decoder (attention heads and MLP split over this many "
                    "processes, DTensor); must divide the number of processes (groups of tp_size consecutive ranks, "
                    "data-parallel between groups) and the model's heads, key/value heads and intermediate size. "
                    "1: off (data parallelism only).")
    dp_shard: bool = Field(
        False,
        description="With tp_size > 1: shard parameters, gradients and optimizer state over the data-parallel "
                    "dimension (FSDP's fully_shard on the (dp, tp) mesh, FSDP x TP) instead of replicating them. "
                    "Without tensor parallelism, sharding is the fsdp or deepspeed accelerate_config's.")
    # Fault injection for exercising the rollback path: the loss of these
    # global batch indices is made NaN.
    inject_nan_at_batches: list[int] = Field(default_factory=list)

    _AT_LEAST_ONE: ClassVar[tuple[str, ...]] = LoopConfig._AT_LEAST_ONE + ("eval_batches",)
    _NOT_NEGATIVE: ClassVar[tuple[str, ...]] = LoopConfig._NOT_NEGATIVE + ("eval_every",)

    @model_validator(mode="after")
    def _check_window(self):
        if self.dp_shard and self.tp_size == 1:
            raise ValueError("dp_shard shards the data-parallel dimension of a tensor-parallel layout and needs "
                             "tp_size > 1; for sharding alone choose accelerate_config: fsdp (or deepspeed_zero3)")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 (got {self.seq_len})")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ValueError(f"peak_flops must be positive (got {self.peak_flops})")
        return self


# ---------------------------------------------------------------- pretrain

# The decoder presets of stages/training/models.py (a test keeps the two lists equal).
DECODER_PRESETS = ("tiny", "cpu-small", "cpu", "124m", "1b")


class PretrainConfig(TrainConfig):
    default_lr: ClassVar[float] = 1e-3
    # A model this small takes larger steps. Measured on the embedded corpus (240 steps of
    # 16 x 256 tokens): held-out bits per byte 2.03 at 1e-3, 1.99 at 3e-3, 1.96 at 6e-3, 2.01 at 1e-2.
    PRESET_LR: ClassVar[dict[str, float]] = {"cpu-small": 6e-3}

    def adamw_default_lr(self) -> float:
        return self.PRESET_LR.get(self.preset, self.default_lr)

    preset: Literal[DECODER_PRESETS] = "cpu"
    vocab_size: int = 8192  # tokenizer trained on the data when no tokenizer is given
    tokenizer: str | None = None  # an existing tokenizer folder to reuse instead
    tokenizer_max_docs: int | None = 200_000  # documents sampled to train the tokenizer
    val_fraction: float = Field(0.01, ge=0, lt=1)  # share of documents (by id hash) held out for validation
    tokenizer_type: Literal["bpe", "wordpiece", "unigram"] = "bpe"  # family of the trained (or given) tokenizer
    # Draw training documents by the data stage's sample_weight (balance.mode=weight), so each
    # language's (or source's) token share follows the balance target; False: uniform windows over
    # the packed tokens (the corpus's natural mixture). Data without weights is read uniformly.
    sample_by_weight: bool = True
    pp_size: int = Field(
        1, ge=1,
        description="Pipeline parallelism: the decoder layers split into this many contiguous stages, one per "
                    "process of a pipeline (torch.distributed.pipelining); must divide the number of processes "
                    "(pipelines of pp_size consecutive ranks, data-parallel between them) and be at most the "
                    "model's layers. The grad_accum micro-batches are the pipeline's micro-batches. 1: off.")
    pp_schedule: Literal["gpipe", "1f1b"] = Field(
        "1f1b", description="The pipeline schedule when pp_size > 1: GPipe (all forwards, then all backwards) or "
                            "1F1B (one forward then one backward per micro-batch once the pipeline is full).")
    compile: bool = Field(
        False,
        description="Compile the training step's forward and loss with torch.compile (inductor; the backward is "
                    "compiled with it). Measured on 2 CPU cores at nanoGPT's Tiny Shakespeare shape: steps ~16% "
                    "shorter, for ~30 s of compilation before the first step (~3 s when torch's compile cache in "
                    "/tmp already holds this model's kernels), so it pays from a few thousand steps. Evaluation "
                    "runs uncompiled. Not with tensor or pipeline parallelism, DeepSpeed or FSDP (refused).")

    @model_validator(mode="after")
    def _one_model_split(self):
        if self.tp_size > 1 and self.pp_size > 1:
            raise ValueError(f"tp_size={self.tp_size} and pp_size={self.pp_size} together are not supported; "
                             "choose tensor or pipeline parallelism")
        if self.compile and (self.tp_size > 1 or self.pp_size > 1):
            name, size = ("tp_size", self.tp_size) if self.tp_size > 1 else ("pp_size", self.pp_size)
            raise ValueError(f"compile=true is not supported with {name}={size}; set compile=false or {name}=1")
        return self


# ---------------------------------------------------------------- sft

class SFTConfig(TrainConfig):
    default_lr: ClassVar[float] = 1e-4

    seq_len: int = 512
    micro_batch_size: int = 8
    max_steps: int = 300
    warmup_steps: int = 10
    weight_decay: float = 0.0
    eval_every: int = 100
    checkpoint_every: int = 100
    pack: bool = True  # several conversations per row; False: one per row, padded
    val_fraction: float = Field(
        0.05, ge=0, lt=1,
        description="Share of conversations (by content hash) held out. When the hash holds out none of several "
                    "distinct conversations, the last of them in hash order are held out; 0: no held-out set.")


# ---------------------------------------------------------------- reward

class RewardConfig(TrainConfig):
    default_lr: ClassVar[float] = 5e-5

    seq_len: int = 512  # prompt + answer tokens per side; prompts are cut from the left
    micro_batch_size: int = 8  # pairs
    max_steps: int = 300
    warmup_steps: int = 10
    weight_decay: float = 0.0
    eval_every: int = 100
    checkpoint_every: int = 100
    val_fraction: float = Field(
        0.1, ge=0, lt=1,
        description="Share of pairs (by content hash) held out for eval_accuracy; as for SFT, a split that holds "
                    "out nothing falls back to the last distinct pairs in hash order; 0: no held-out set.")
    margin: float = Field(
        0.1, description="m in the pairwise loss -logsigmoid(r_chosen - r_rejected - m): how far the chosen answer "
                         "must score above the rejected one. A pair's own `margin` column wins.")


# ---------------------------------------------------------------- dpo

class DPOConfig(TrainConfig):
    default_lr: ClassVar[float] = 1e-5

    seq_len: int = 512
    micro_batch_size: int = 8  # pairs
    max_steps: int = 300
    warmup_steps: int = 10
    weight_decay: float = 0.0
    eval_every: int = 100
    checkpoint_every: int = 100
    val_fraction: float = Field(0.1, ge=0, lt=1, description="As for the reward model.")
    beta: float = 0.1  # strength of the implicit KL constraint to the reference
    label_smoothing: float = 0.0  # assumed share of flipped labels (conservative DPO)


# ---------------------------------------------------------------- ppo

# Trainer knobs PPO's own loop has no use for, with what it does instead.
NOT_FOR_PPO = {
    "seq_len": "answer lengths are max_prompt_len + max_new_tokens",
    "eval_every": "PPO has no held-out set; the end-of-stage evaluation judges the policy",
    "eval_batches": "PPO has no held-out set; the end-of-stage evaluation judges the policy",
    "peak_flops": "PPO reports no MFU",
    "tp_size": "PPO's actor and critic are data-parallel only",
    "dp_shard": "PPO's actor and critic are data-parallel only",
}
# PPO's rollback fires on non-finite numbers (sampling, scores, weights), not on loss spikes.
NOT_FOR_PPO_ROLLBACK = {
    "spike_factor": "a PPO loss moves with the rewards; PPO rolls back on non-finite numbers only",
    "spike_window": "a PPO loss moves with the rewards; PPO rolls back on non-finite numbers only",
}


class PPOConfig(LoopConfig):
    """Optimizer, schedule, clipping, precision, checkpoints and seed come from
    :class:`LoopConfig`. The trainer's ``seq_len``, evaluation and MFU fields and the
    rollback's loss-spike fields do not apply here and are refused by name
    (:data:`NOT_FOR_PPO`, :data:`NOT_FOR_PPO_ROLLBACK`)."""

    default_lr: ClassVar[float] = 1e-5

    max_steps: int = 100  # PPO steps (rollouts)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    schedule: Literal["cosine", "linear", "polynomial", "step", "wsd", "constant"] = "constant"
    micro_batch_size: int = 8  # answers per forward pass in the optimisation phase
    # optimizer step = micro_batch_size x grad_accum answers (per process)
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
    ent_coef: float = Field(0.01, description="Weight of the entropy bonus in the PPO loss (keeps sampling diverse).")
    kl_coef: float = 0.05  # initial coefficient of the per-token KL penalty
    adaptive_kl: bool = False
    kl_target: float = 6.0  # target per-answer KL of the adaptive controller
    kl_horizon: int = 10000
    missing_eos_penalty: float = -1.0  # added to the score of an answer that never ended
    save_value_model: bool = True
    # A rollout with non-finite sampling probabilities, scores or values, an update that
    # leaves non-finite weights, or one whose every minibatch had a non-finite gradient
    # rolls back to the last good checkpoint (max_rollbacks in a row, lr x lr_factor each).
    rollback: PPORollbackConfig = Field(default_factory=PPORollbackConfig)
    # Fault injection for exercising the rollback: after the update on these prompt
    # batches (rollout numbers, counted from 1) the actor's weights are made NaN.
    inject_nan_at_batches: list[int] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _refuse_trainer_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = [k for k in NOT_FOR_PPO if k in data]
            rollback = data.get("rollback")
            spikes = [k for k in NOT_FOR_PPO_ROLLBACK if isinstance(rollback, dict) and k in rollback]
            if given or spikes:
                raise ValueError("; ".join([f"{k} does not apply to PPO ({NOT_FOR_PPO[k]})" for k in given]
                                           + [f"rollback.{k} does not apply to PPO ({NOT_FOR_PPO_ROLLBACK[k]})"
                                              for k in spikes]))
        return data

# ---------------------------------------------------------------- encoder objectives (mlm, span)

class EncoderPretrainConfig(TrainConfig):
    """What the encoder objectives share: a model preset, the tokenizer trained on the
    data (or given), the held-out split, and windows of ``seq_len`` tokens."""

    seq_len: int = Field(128, ge=16)  # tokens per training row (MLM: with <|cls|> and <|sep|>; span: before corruption)
    max_steps: int = 1000
    default_lr: ClassVar[float] = 5e-4
    warmup_steps: int = 50
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    preset: Literal["tiny", "cpu-small", "cpu", "base"] = "cpu"
    vocab_size: int = 8192  # of the tokenizer trained on the data when no tokenizer is given
    tokenizer: str | None = None  # an existing tokenizer folder (with this objective's special tokens) to reuse
    tokenizer_type: Literal["bpe", "wordpiece", "unigram"] = "wordpiece"
    tokenizer_max_docs: int | None = 200_000  # documents sampled to train the tokenizer
    val_fraction: float = Field(0.01, ge=0, lt=1)  # share of documents (by id hash) held out for validation


class MLMConfig(EncoderPretrainConfig):
    """Masked language modelling (BERT's corruption, RoBERTa's recipe: dynamic masks, full windows, no NSP)."""

    mlm_probability: float = Field(0.15, gt=0, lt=1)  # share of a row's ordinary tokens selected for prediction
    mask_replace_prob: float = Field(0.8, ge=0, le=1)  # of the selected: replaced by <|mask|>
    random_replace_prob: float = Field(0.1, ge=0, le=1)  # of the selected: replaced by a random ordinary token
    whole_word_masking: bool = False  # select whole words (all their tokens), not single tokens

    @model_validator(mode="after")
    def _replacement_shares(self):
        if self.mask_replace_prob + self.random_replace_prob > 1:
            raise ValueError("mask_replace_prob + random_replace_prob must not exceed 1 (the rest is kept unchanged)")
        return self


class SpanConfig(EncoderPretrainConfig):
    """T5 span corruption for an encoder-decoder model."""

    tokenizer_type: Literal["bpe", "wordpiece", "unigram"] = "unigram"
    noise_density: float = Field(0.15, gt=0, lt=1)  # share of a row's tokens that are corrupted
    mean_span_length: float = Field(3.0, ge=1)  # mean length of a corrupted span
    num_sentinels: int = Field(100, ge=1)  # sentinel tokens in a trained tokenizer (>= spans per row)

    @model_validator(mode="after")
    def _enough_sentinels(self):
        from crawl2chat.stages.training.masking import span_counts

        noise, spans = span_counts(self.seq_len, self.noise_density, self.mean_span_length)
        if spans > self.num_sentinels:
            raise ValueError(f"num_sentinels={self.num_sentinels} is fewer than the {spans} spans a row of "
                             f"seq_len={self.seq_len} gets; raise num_sentinels or lower seq_len")
        if spans > self.seq_len - noise:
            raise ValueError(f"noise_density={self.noise_density} leaves fewer kept tokens than spans in a row")
        return self


# ---------------------------------------------------------------- contrastive sentence embeddings

MAX_QUEUE = 262_144  # queue entries at most: 768 MB of fp32 embeddings at BERT-base width


class ContrastiveConfig(EncoderPretrainConfig):
    """SimCSE-style training of a BERT encoder (Gao et al., 2021): InfoNCE at ``temperature``
    picks each row's positive (the kept document of its near-duplicate cluster, or the row
    itself encoded again with another dropout mask) among the batch's other positives and
    the queue of a momentum encoder's past embeddings (MoCo, He et al., 2020)."""

    seq_len: int = Field(64, ge=16)  # tokens per window, with <|cls|> and <|sep|>
    preset: Literal["tiny", "cpu-small", "cpu", "base"] = "tiny"  # a sentence encoder for CPUs by default
    vocab_size: int = 2048  # of the tokenizer trained on the data when no tokenizer or init_encoder is given
    temperature: float = Field(0.05, gt=0)  # InfoNCE temperature on cosine similarities
    pooling: Literal["mean", "cls"] = "mean"  # sentence embedding: mean of the token states, or <|cls|>'s
    dropout: float = Field(0.1, ge=0, lt=1)  # hidden and attention dropout: the augmentation
    queue_size: int = Field(65_536, ge=0, le=MAX_QUEUE)  # past momentum embeddings kept as negatives; 0: none
    momentum: float = Field(0.9, ge=0, le=1)  # momentum encoder: new = momentum * old + (1 - momentum) * online
    hard_negatives: int = Field(0, ge=0)  # per query, only its k most similar queue entries are negatives; 0: all
    hard_negative_weight: float = Field(1.0, gt=0)  # weight of each queue negative in the InfoNCE denominator
    # A row's positive: the kept document of its near-duplicate cluster (the data stage's dedup
    # clusters), or its own second dropout view; auto: clusters when the data has at least
    # micro_batch_size training pairs.
    positives: Literal["auto", "clusters", "dropout"] = "auto"
    init_encoder: str | None = None  # an `mlm` model folder to start from (its tokenizer and held-out split)
    retrieval_pairs: int = Field(200, ge=2)  # held-out positive pairs the retrieval figures are measured on

    @model_validator(mode="after")
    def _encoder_brings_its_shape(self):
        """With ``init_encoder`` the model's shape and tokenizer are the encoder's own: the
        fields that would build them are refused when set to anything but their default."""
        if self.init_encoder:
            moot = [f for f in ("preset", "vocab_size", "tokenizer_type", "tokenizer_max_docs")
                    if f in self.model_fields_set and getattr(self, f) != type(self).model_fields[f].default]
            if moot:
                raise ValueError(f"{', '.join(moot)} do(es) not apply with init_encoder (the encoder's own "
                                 "configuration and tokenizer are used)")
        return self

    @model_validator(mode="after")
    def _hard_negatives_in_queue(self):
        if self.hard_negatives > self.queue_size:
            raise ValueError(f"hard_negatives={self.hard_negatives} exceeds queue_size={self.queue_size}")
        return self


# ---------------------------------------------------------------- distillation

class DistillConfig(TrainConfig):
    """A smaller decoder trained on a teacher's soft targets (Hinton et al.): the loss is
    ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * cross-entropy`` with both
    distributions softened by the temperature ``T``. The student uses the teacher's
    tokenizer and held-out split."""

    default_lr: ClassVar[float] = 1e-3

    preset: Literal[DECODER_PRESETS] = "tiny"  # the student's shape (smaller than the teacher's)
    alpha: float = Field(0.5, ge=0, le=1)  # weight of the soft-target term (0: no teacher, plain training)
    temperature: float = Field(2.0, gt=0)  # softens both distributions in the soft-target term
    # Also train the same student (same seed, batches and steps) with alpha=0 into OUT/without_teacher,
    # so the summary says what the teacher added.
    compare_without_teacher: bool = True
    val_fraction: float = Field(0.01, ge=0, lt=1)  # held out by id hash when the teacher records no split of its own
    sample_by_weight: bool = True  # as in pretraining: documents drawn by the data stage's sample_weight
