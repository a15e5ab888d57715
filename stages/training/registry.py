"""The training stages, declared once.

Each :class:`TrainingStage` names its script, its inputs, the MLflow registered
model it produces and how it is evaluated at the end. The CLI commands, the Prefect
tasks and single-stage flows, and the ``prefect.yaml`` deployments are all made
from this table, so a new stage is a script plus one entry here (and its settings
section in :class:`crawl2chat.stages.settings.Config`).

Pure data: importing it starts no torch, Ray or Prefect.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Evaluation = Literal["lm", "chat", "policy"]


@dataclass(frozen=True)
class StageInput:
    """One input of a stage: a ``--NAME`` flag of the script and the CLI, a flow parameter."""

    name: str
    help: str
    default: str  # where the pipeline leaves it; the single-stage flow's default
    model_role: str | None = None  # lineage role when the input is a model folder another stage made
    setting: str | None = None  # the stage's settings field that supplies it when not given (e.g. "data")


@dataclass(frozen=True)
class TrainingStage:
    name: str
    module: str  # run as ``accelerate launch -m MODULE``
    goal: str  # one sentence: CLI help, deployment description, MLflow record
    inputs: tuple[StageInput, ...]
    registered_name: str
    evaluation: Evaluation | None  # the end-of-stage evaluation (see tasks.train)
    report: Callable[[dict], str]  # one line summing up a finished run
    max_steps_help: str = "Optimizer steps."
    prepare_on_host: bool = False  # the module's prepare_on_host(argv) runs before the launch (Ray lives there)
    artifact_dirs: tuple[str, ...] = ()  # summary keys naming further folders logged as artifacts
    options: tuple[tuple[str, str], ...] = ()  # (setting under ``train``, help): a CLI shortcut ``--SETTING``
    # (setting under ``train``, lineage role): settings naming a folder another stage made (a model
    # to start from, a tokenizer); a run is keyed by the folder they resolve to and linked to its run.
    folder_settings: tuple[tuple[str, str], ...] = ()

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)


def _fmt(summary: dict, key: str, spec: str = ".3f") -> str:
    """A summary figure for a report line; "n/a" when it is missing or not a finite number."""
    value = summary.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return format(value, spec)
    return "n/a"


def _held_out(summary: dict, key: str) -> str:
    """``key`` on the held-out set, or a plain statement that there was none."""
    if key not in summary:
        return "no held-out set" if summary.get("held_out", 0) == 0 else f"{key} n/a"
    return f"{key} {_fmt(summary, key)}"


STAGES: dict[str, TrainingStage] = {s.name: s for s in (
    TrainingStage(
        name="pretrain",
        module="crawl2chat.stages.training.pretrain",
        goal="Train a BPE tokenizer and a decoder-only base model from scratch on the shards.",
        inputs=(StageInput("data", "A data-stage output folder (its current version) or a plain text file.",
                           "runs/data"),),
        registered_name="crawl2chat-base",
        evaluation="lm",
        report=lambda s: f"val_loss {_fmt(s, 'val_loss')}  val_bpb {_fmt(s, 'val_bpb')}  "
                         f"{_fmt(s, 'tokens_per_second', '.0f')} tokens/s, {s.get('steps')} steps",
        prepare_on_host=True,
        artifact_dirs=("tokenizer",),
        options=(("preset", "Model preset: tiny, cpu-small, cpu, 124m, 1b."),),
        folder_settings=(("tokenizer", "tokenizer"),),
        max_steps_help="Optimizer steps, all of them (unset: pretrain.train.max_steps, or as many of them as fit "
                       "in pretrain.minutes of this machine when that is set).",
    ),
    TrainingStage(
        name="sft",
        module="crawl2chat.stages.training.sft",
        goal="Fine-tune the base model on chat data, loss on assistant tokens only.",
        inputs=(StageInput("base", "Base model folder (Hugging Face causal LM + tokenizer).", "runs/pretrain/model",
                           model_role="base"),
                StageInput("data", "Chat data: JSONL or Parquet (messages | prompt+response | "
                           "instruction+input+output).", "", setting="data")),
        registered_name="crawl2chat-sft",
        evaluation="chat",
        report=lambda s: f"{s.get('steps')} steps, {_held_out(s, 'val_loss')}",
    ),
    TrainingStage(
        name="reward",
        module="crawl2chat.stages.training.reward",
        goal="Train a scalar reward model on preference pairs (pairwise logistic loss).",
        inputs=(StageInput("base", "Base (or SFT) model folder.", "runs/pretrain/model", model_role="base"),
                StageInput("data", "Preference pairs: prompt+chosen+rejected[+margin], prompt+ranked (answers best first), "
                           "or HH transcripts.", "",
                           setting="data")),
        registered_name="crawl2chat-reward",
        evaluation=None,
        report=lambda s: _held_out(s, "eval_accuracy"),
    ),
    TrainingStage(
        name="ppo",
        module="crawl2chat.stages.training.ppo",
        goal="Optimise the SFT policy against the reward model with PPO and a KL penalty to the reference.",
        inputs=(StageInput("policy", "SFT model folder (actor start and frozen reference).", "runs/sft/model",
                           model_role="sft"),
                StageInput("reward", "Reward model folder (scorer and critic start).", "runs/reward/model",
                           model_role="reward"),
                StageInput("prompts", "Prompts: JSONL or Parquet with `prompt` or `messages`.", "",
                           setting="prompts")),
        registered_name="crawl2chat-policy",
        evaluation="policy",
        report=lambda s: f"reward {_fmt(s, 'reward_mean_first')} -> {_fmt(s, 'reward_mean_last')}, "
                         f"KL {_fmt(s, 'kl_last')}",
        max_steps_help="PPO rollouts.",
    ),
    TrainingStage(
        name="dpo",
        module="crawl2chat.stages.training.dpo",
        goal="Optimise the SFT policy directly on preference pairs (DPO) against a frozen reference.",
        inputs=(StageInput("policy", "SFT model folder (policy start and frozen reference).", "runs/sft/model",
                           model_role="sft"),
                StageInput("data", "Preference pairs.", "", setting="data")),
        registered_name="crawl2chat-dpo",
        evaluation="chat",
        report=lambda s: _held_out(s, "eval_reward_accuracy"),
    ),
    TrainingStage(
        name="mlm",
        module="crawl2chat.stages.training.mlm",
        goal="Train a tokenizer and a BERT encoder from scratch by masked language modelling "
             "(15% selected: 80% masked, 10% random, 10% kept; optional whole-word masking).",
        inputs=(StageInput("data", "A data-stage output folder (its current version) or a plain text file.",
                           "runs/data"),),
        registered_name="crawl2chat-mlm",
        evaluation=None,  # held-out masked loss and accuracy are measured in training (metrics.json)
        report=lambda s: f"val_loss {_fmt(s, 'val_loss')} (untrained {_fmt(s, 'initial_val_loss')}), "
                         f"masked accuracy {_fmt(s, 'val_masked_accuracy')} "
                         f"(untrained {_fmt(s, 'initial_val_masked_accuracy')})",
        prepare_on_host=True,
        artifact_dirs=("tokenizer",),
        options=(("preset", "Model preset: tiny, cpu-small, cpu, base."),),
        folder_settings=(("tokenizer", "tokenizer"),),
    ),
    TrainingStage(
        name="span",
        module="crawl2chat.stages.training.span",
        goal="Train a tokenizer and a T5 encoder-decoder from scratch by span corruption "
             "(15% noise in spans of mean length 3, replaced by sentinels).",
        inputs=(StageInput("data", "A data-stage output folder (its current version) or a plain text file.",
                           "runs/data"),),
        registered_name="crawl2chat-span",
        evaluation=None,  # held-out target loss and token accuracy are measured in training (metrics.json)
        report=lambda s: f"val_loss {_fmt(s, 'val_loss')} (untrained {_fmt(s, 'initial_val_loss')}), "
                         f"target token accuracy {_fmt(s, 'val_token_accuracy')}",
        prepare_on_host=True,
        artifact_dirs=("tokenizer",),
        options=(("preset", "Model preset: tiny, cpu-small, cpu, base."),),
        folder_settings=(("tokenizer", "tokenizer"),),
    ),
    TrainingStage(
        name="distill",
        module="crawl2chat.stages.training.distill",
        goal="Distil a teacher model into a smaller student (KL on temperature-softened targets mixed with "
             "the next-token loss), beside the same student trained without the teacher.",
        inputs=(StageInput("teacher", "Teacher model folder (a causal LM with its tokenizer).", "runs/pretrain/model",
                           model_role="teacher"),
                StageInput("data", "A data-stage output folder (its current version) or a plain text file.",
                           "runs/data")),
        registered_name="crawl2chat-distilled",
        evaluation="lm",
        report=lambda s: f"val_bpb {_fmt(s, 'val_bpb')} (teacher {_fmt(s, 'teacher_val_bpb')}"
                         + (f", same student without the teacher {_fmt(s, 'without_teacher_val_bpb')}"
                            if "without_teacher_val_bpb" in s else "") + ")",
        prepare_on_host=True,
        options=(("preset", "Student preset: tiny, cpu-small, cpu, 124m, 1b."),),
    ),
    TrainingStage(
        name="contrastive",
        module="crawl2chat.stages.training.contrastive",
        goal="Train a BERT sentence encoder by contrastive learning (SimCSE: the data stage's near-duplicate "
             "clusters as positives, else two dropout views; InfoNCE over in-batch negatives and a momentum "
             "encoder's queue, optional hard negatives).",
        inputs=(StageInput("data", "A data-stage output folder (its current version) or a plain text file.",
                           "runs/data"),),
        registered_name="crawl2chat-embedder",
        evaluation=None,  # held-out retrieval (top-1, MRR) is measured in training (metrics.json)
        report=lambda s: f"retrieval top-1 {_fmt(s, 'retrieval_top1')} (untrained {_fmt(s, 'initial_retrieval_top1')}, "
                         f"chance {_fmt(s, 'retrieval_chance_top1')}), MRR {_fmt(s, 'retrieval_mrr')} "
                         f"(untrained {_fmt(s, 'initial_retrieval_mrr')}) on {s.get('retrieval_pairs', 'n/a')} "
                         f"held-out {s.get('retrieval_positives', '')} pairs; positives: {s.get('positives', 'n/a')}",
        prepare_on_host=True,
        artifact_dirs=("tokenizer",),
        options=(("preset", "Model preset: tiny, cpu-small, cpu, base."),),
        folder_settings=(("tokenizer", "tokenizer"), ("init_encoder", "encoder")),
    ),
)}
