"""Settings: one pydantic system for the CLI, the Prefect flows and every stage script.

The project's settings are one tree (:class:`Config`) composed of the steps' and
stages' own models (:mod:`crawl2chat.stages.data.settings`,
:mod:`crawl2chat.stages.training.settings`). Everything that reads settings goes
through :func:`load_settings`: a YAML file, then ``KEY.PATH=VALUE`` overrides (the
value read as YAML), merged into the model's defaults and validated. The CLI loads
the whole tree (``--set pretrain.train.lr=3e-4``); a stage script loads its own
stage's model with the same syntax (``--set lr=3e-4``). Unknown or ill-typed fields
are refused with a message naming each one, e.g.
``data.dedup.num_bands: Input should be greater than 0``.

This module imports only pydantic and YAML: validating settings starts no Ray,
torch or Accelerate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from crawl2chat.stages.data.settings import (BalanceConfig, CrawlConfig, DedupConfig, ExtractConfig, LangIdConfig,
                                             QualityConfig, ReviewConfig)
from crawl2chat.stages.training.registry import STAGES
from crawl2chat.stages.training.settings import DPOConfig, PPOConfig, PretrainConfig, RewardConfig, SFTConfig
from crawl2chat.stages.training.settings import MLMConfig, SpanConfig

M = TypeVar("M", bound=BaseModel)


class SettingsError(ValueError):
    """Settings that cannot be used; the message names each bad field."""


def set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``set_path(d, "data.dedup.num_bands", 20)`` on nested dicts."""
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise SettingsError(f"{dotted}: cannot set a field inside a non-mapping value")
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``key.path=value`` with the value read as YAML (numbers, lists, booleans)."""
    if "=" not in item:
        raise SettingsError(f"override {item!r}: expected KEY=VALUE, e.g. data.dedup.num_bands=20")
    key, raw = item.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise SettingsError(f"override {item!r}: the value is not valid YAML ({e.problem})") from None


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["lr=3e-4", "rollback.max_rollbacks=2"]`` -> ``{"lr": 3e-4, "rollback.max_rollbacks": 2}``."""
    return dict(parse_override(item) for item in items)


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def format_errors(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        where = ".".join([prefix] * bool(prefix) + [str(p) for p in e["loc"]]) or "(top level)"
        lines.append(f"{where}: {e['msg']}")
    return "invalid settings:\n  " + "\n  ".join(lines)


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise SettingsError(f"cannot read settings file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise SettingsError(f"settings file {path} is not valid YAML: {e}") from e
    if not isinstance(tree, dict):
        raise SettingsError(f"settings file {path} must hold a mapping at the top level")
    return tree


def load_settings(model: type[M], path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                  prefix: str = "") -> M:
    """``model`` from a YAML file (optional) with dotted ``overrides`` on top.

    Both are merged into the model's full defaults, so setting one field of a
    section (``pretrain.train.max_steps``) keeps that section's other defaults.
    ``prefix`` names where the model sits in the project tree, for messages."""
    tree = read_yaml(path) if path else {}
    for key, value in (overrides or {}).items():
        if value is not None:
            set_path(tree, key, value)
    try:
        return model.model_validate(deep_merge(model().model_dump(mode="json"), tree))
    except ValidationError as e:
        raise SettingsError(format_errors(e, prefix)) from None


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: list[str] = Field(
        default_factory=list,
        description="WARC/WET files or folders of them (local paths or fsspec URLs such as s3://).",
    )
    seed_urls: list[str] = Field(
        default_factory=list,
        description="Crawl these first. With neither inputs nor seed URLs, the local Python "
        "documentation server is crawled.",
    )
    out: str = Field("runs/data", description="Output folder: manifest.json, shards/, rejected/, versions/.")
    shard_bytes: int = Field(
        128 * 2**20, gt=0, description="Upper bound of text bytes per Parquet shard."
    )
    refresh: bool = Field(
        False,
        description="Add a version to the dataset in `out`: read only input files no earlier version read "
        "(a re-crawl's new and changed pages) and deduplicate them against every earlier version. "
        "Without it, every input is read into a new version that stands alone.",
    )
    previous_index: list[str] = Field(
        default_factory=list,
        description="Further dedup index folders (e.g. another dataset's versions/<v>/dedup_index) to deduplicate against.",
    )
    crawl: CrawlConfig = Field(default_factory=CrawlConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    langid: LangIdConfig = Field(default_factory=LangIdConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    review: ReviewConfig = Field(default_factory=ReviewConfig)

    @field_validator("out")
    @classmethod
    def _local_out(cls, value: str) -> str:
        # Versions are committed by renaming folders, which object stores cannot do atomically.
        if "://" in value:
            raise ValueError("must be a local or mounted folder (shared by every Ray node on a cluster), not a URL")
        return value


def _demo_pretrain() -> PretrainConfig:
    # Sized for the embedded default: a small corpus and a 2-core laptop, minutes not hours.
    return PretrainConfig(preset="tiny", vocab_size=2048, seq_len=128, micro_batch_size=8, max_steps=200,
                          warmup_steps=20, eval_every=100, eval_batches=10, checkpoint_every=100, val_fraction=0.1)


class TrainStage(BaseModel):
    """Where a training stage writes and how it is launched; ``train`` holds its settings."""

    model_config = ConfigDict(extra="forbid")

    out: str = Field("runs/stage", description="Run folder: checkpoints, model/, metrics.json.")
    num_processes: int = Field(1, ge=1, description="Processes for `accelerate launch` (DDP when > 1).")
    accelerate_config: str | None = Field(
        None,
        description="Accelerate config: a name under infra/accelerate (cpu, cpu_ddp, gpu_ddp, fsdp, deepspeed) or a path.",
    )
    registered_name: str | None = Field(None, description="MLflow registered model name (None: don't register).")


class PretrainStage(TrainStage):
    out: str = "runs/pretrain"
    registered_name: str | None = STAGES["pretrain"].registered_name
    train: PretrainConfig = Field(default_factory=_demo_pretrain, description="Training settings.")


def _demo(cls, **fields):
    # Sized for the embedded default's small demo sets and a 2-core laptop.
    common = dict(seq_len=128, micro_batch_size=8, warmup_steps=5, eval_every=20, eval_batches=5,
                  checkpoint_every=20)
    return lambda: cls(**{**common, **fields})


class SFTStage(TrainStage):
    out: str = "runs/sft"
    registered_name: str | None = STAGES["sft"].registered_name
    data: str | None = Field(None, description="SFT data (JSONL/Parquet); None: derived from the data stage's shards.")
    train: SFTConfig = Field(default_factory=_demo(SFTConfig, max_steps=40, lr=1e-3, min_lr=1e-4))


class RewardStage(TrainStage):
    out: str = "runs/reward"
    registered_name: str | None = STAGES["reward"].registered_name
    data: str | None = Field(None, description="Preference pairs; None: derived from the data stage's shards.")
    train: RewardConfig = Field(default_factory=_demo(RewardConfig, max_steps=40, lr=1e-3, min_lr=1e-4))


class PPOStage(TrainStage):
    out: str = "runs/ppo"
    registered_name: str | None = STAGES["ppo"].registered_name
    prompts: str | None = Field(None, description="Prompts for rollouts; None: derived from the data stage's shards.")
    train: PPOConfig = Field(default_factory=lambda: PPOConfig(
        max_steps=6, rollout_batch_size=8, micro_batch_size=8, ppo_epochs=2, max_prompt_len=96, max_new_tokens=16,
        lr=1e-4, seq_len=128))


class DPOStage(TrainStage):
    out: str = "runs/dpo"
    registered_name: str | None = STAGES["dpo"].registered_name
    enabled: bool = Field(False, description="Also train a DPO policy from the SFT model in `crawl2chat run`.")
    data: str | None = Field(None, description="Preference pairs; None: the reward stage's data.")
    train: DPOConfig = Field(default_factory=_demo(DPOConfig, max_steps=40, lr=1e-4, min_lr=1e-5))


def _demo_encoder(cls) -> Callable[[], BaseModel]:
    # Sized like the pretraining demo: a small corpus and a 2-core laptop.
    return lambda: cls(preset="tiny", vocab_size=2048, seq_len=128, micro_batch_size=8, max_steps=200,
                       warmup_steps=20, lr=1e-3, min_lr=1e-4, eval_every=100, eval_batches=10,
                       checkpoint_every=100, val_fraction=0.1)


class MLMStage(TrainStage):
    out: str = "runs/mlm"
    registered_name: str | None = STAGES["mlm"].registered_name
    train: MLMConfig = Field(default_factory=_demo_encoder(MLMConfig), description="Training settings.")


class SpanStage(TrainStage):
    out: str = "runs/span"
    registered_name: str | None = STAGES["span"].registered_name
    train: SpanConfig = Field(default_factory=_demo_encoder(SpanConfig), description="Training settings.")


class DemoSetsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    out: str = Field("runs/posttrain_data", description="Where the derived SFT/preference/prompt files go.")
    examples: int = Field(200, ge=4, description="Examples derived per set from the shards.")
    seed: int = Field(0, description="Seed of the derivation.")


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str | None = Field(
        None,
        description="MLflow tracking URI. Default: $MLFLOW_TRACKING_URI, else SQLite under home.",
    )
    experiment: str = Field("crawl2chat", description="MLflow experiment name.")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    home: str = Field(
        ".crawl2chat",
        description="Project folder for embedded services: the MLflow SQLite store and artifacts.",
    )
    data: DataConfig = Field(default_factory=DataConfig)
    pretrain: PretrainStage = Field(default_factory=PretrainStage)
    demo_sets: DemoSetsConfig = Field(default_factory=DemoSetsConfig)
    sft: SFTStage = Field(default_factory=SFTStage)
    reward: RewardStage = Field(default_factory=RewardStage)
    ppo: PPOStage = Field(default_factory=PPOStage)
    dpo: DPOStage = Field(default_factory=DPOStage)
    mlm: MLMStage = Field(default_factory=MLMStage)
    span: SpanStage = Field(default_factory=SpanStage)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """The project settings from a YAML file and dotted overrides (see :func:`load_settings`)."""
    return load_settings(Config, path, overrides)
