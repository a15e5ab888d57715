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
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from crawl2chat.stages.data.settings import (AugmentConfig, BalanceConfig, CrawlConfig, DedupConfig, ExtractConfig, LangIdConfig,
                                             QualityConfig, ReviewConfig, check_seed_urls)
from crawl2chat.stages.training.registry import STAGES
from crawl2chat.stages.training.settings import DPOConfig, PPOConfig, PretrainConfig, RewardConfig, SFTConfig
from crawl2chat.stages.training.settings import ContrastiveConfig, DistillConfig, MLMConfig, SpanConfig

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
        tree = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise SettingsError(f"cannot read settings file {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise SettingsError(f"settings file {path} is not UTF-8 text (byte {e.start} is not valid UTF-8)") from e
    except yaml.YAMLError as e:  # one line: PyYAML's own message quotes the file over several
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SettingsError(f"settings file {path} is not valid YAML{where}: {problem}") from e
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
        set_path(tree, key, value)  # None too: ``--set data.quality.c4.min_sentences=null`` switches a rule off
    try:
        return model.model_validate(deep_merge(model().model_dump(mode="json"), tree))
    except ValidationError as e:
        raise SettingsError(format_errors(e, prefix)) from None


# Documentation sites (API references, the embedded pydoc site) break rules tuned on
# web prose: code-heavy English pages get low language-ID confidence; signatures and
# code lines lack terminal punctuation, have few words and use curly brackets;
# listings are short lines; every class page repeats its inherited members (such a
# page is kept without the repeated runs); documentation trees are deep. The "docs"
# profile relaxes exactly those rules; dedup and the word-level Gopher rules still
# apply. On 550 pydoc pages it kept 434 (4.4 MB) where the web defaults keep 109; on
# the 819 pages of the embedded site it keeps 540 (5.4 MB of text), 37 of them
# (builtins, ast, enum, tkinter, ...) without 114,111 repeated lines.
DOCS_PROFILE: dict[str, Any] = {
    "langid.min_score": 0.3,
    "quality.c4.filter_no_terminal_punct": False,
    "quality.c4.filter_curly_bracket": False,
    "quality.c4.min_words_per_line": None,
    "quality.c4.min_sentences": None,
    "quality.fineweb.enabled": False,
    "quality.gopher_quality.min_alpha_words_ratio": 0.5,
    "quality.gopher_repetition.dup_line_frac": 0.7,
    "quality.gopher_repetition.dup_para_frac": 0.7,
    "quality.gopher_repetition.dup_line_char_frac": 0.6,
    "quality.gopher_repetition.dup_para_char_frac": 0.6,
    "quality.gopher_repetition.top_n_grams": {2: 0.4, 3: 0.36, 4: 0.32},
    "quality.gopher_repetition.dup_n_grams": {5: 0.6, 6: 0.58, 7: 0.56, 8: 0.54, 9: 0.52, 10: 0.5},
    "quality.gopher_repetition.repair_runs": 3,
    "crawl.max_depth": 6,
}
PROFILES: dict[str, dict[str, Any]] = {"web": {}, "docs": DOCS_PROFILE}


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    profile: Literal["auto", "web", "docs"] = Field(
        "auto",
        description="Rule settings for the kind of site: 'web' (the published defaults), 'docs' (documentation "
        "sites: the rules that misfire on code-heavy reference pages relaxed, see DOCS_PROFILE), 'auto' ('docs' "
        "for the embedded documentation crawl, else 'web'). A profile changes only settings left at their "
        "defaults; what it changed is listed in manifest.json and review.md.",
    )

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
    engine: Literal["auto", "ray", "local"] = Field(
        "auto",
        description="Where the steps run: 'ray' (Ray Data, on a local instance or the cluster named by RAY_ADDRESS), "
        "'local' (in this process, the whole step in memory, no Ray start-up or scheduling; the extract step "
        "of a large enough input in a pool of processes, one per CPU), 'auto' "
        "('local' for input files of at most local_max_mb in all when RAY_ADDRESS is unset, else 'ray'). Both "
        "give the same dataset version.",
    )
    local_max_mb: float | None = Field(
        None, gt=0,
        description="With engine 'auto': the most megabytes of input files (WARC/WET as stored, gzipped or not) "
        "built in this process; larger inputs go to Ray. Unset: 32 x 8 / CPUs, at least 32 (128 on 2 CPUs, "
        "64 on 4, 32 from 8): in process only extraction uses every CPU.",
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
    # The embedded documentation site has ~950 pages within reach (test suites excluded).
    crawl: CrawlConfig = Field(
        default_factory=lambda: CrawlConfig(max_pages=1200),
        description="The crawl of seed_urls (or of the local documentation server); here max_pages is "
        "1200 unless set (the documentation server has ~950 pages within reach).")
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    langid: LangIdConfig = Field(default_factory=LangIdConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    augment: AugmentConfig = Field(default_factory=AugmentConfig, description="Augmented copies of kept documents "
                                   "(noise, synonyms, back-translation); off by default.")
    review: ReviewConfig = Field(default_factory=ReviewConfig)

    @field_validator("seed_urls")
    @classmethod
    def _check_seeds(cls, seeds: list[str]) -> list[str]:
        return check_seed_urls(seeds)

    @field_validator("out")
    @classmethod
    def _local_out(cls, value: str) -> str:
        # Versions are committed by renaming folders, which object stores cannot do atomically.
        if "://" in value:
            raise ValueError("must be a local or mounted folder (shared by every Ray node on a cluster), not a URL")
        return value


def _demo_pretrain() -> PretrainConfig:
    # Sized for the embedded default: ~5 MB of documentation text (~1.7M training tokens)
    # and a 2-core laptop: a 1.4M-parameter model sees up to ~1.6M tokens (800 steps of
    # 8 x 256, about one pass), two evaluations of 40 batches included, at its preset's
    # learning rate (6e-3); `crawl2chat run` lowers the steps on a slower machine
    # (PretrainStage.minutes).
    # Measured on one corpus and split: 480 steps end at 1.64 held-out bits per byte,
    # 800 at 1.38; at the same ~1M tokens, 480 steps of 8 rows beat 240 of 16 (1.80 vs 1.96).
    return PretrainConfig(preset="cpu-small", vocab_size=4096, seq_len=256, micro_batch_size=8, max_steps=800,
                          warmup_steps=80, eval_every=400, eval_batches=40, checkpoint_every=400, val_fraction=0.05)


class TrainStage(BaseModel):
    """Where a training stage writes and how it is launched; ``train`` holds its settings."""

    model_config = ConfigDict(extra="forbid")

    out: str = Field("runs/stage", description="Run folder: checkpoints, model/, metrics.json.")
    num_processes: int = Field(1, ge=1, description="Processes for `accelerate launch` (DDP when > 1).")
    nodes: int = Field(
        1, ge=1,
        description="Machines: > 1 runs one `accelerate launch` on each of that many machines of the Ray cluster "
                    "(RAY_ADDRESS), num_processes in total split evenly; out must be on storage every machine sees.")
    accelerate_config: str | None = Field(
        None,
        description="Accelerate config: a name under infra/accelerate (cpu, cpu_ddp, gpu_ddp, fsdp, deepspeed) or a path.",
    )
    registered_name: str | None = Field(None, description="MLflow registered model name (None: don't register).")


class PretrainStage(TrainStage):
    out: str = "runs/pretrain"
    registered_name: str | None = STAGES["pretrain"].registered_name
    train: PretrainConfig = Field(default_factory=_demo_pretrain, description="Training settings.")
    minutes: float | None = Field(
        None, gt=0,
        description="Minutes of training steps on this machine: before the run, its training step is timed here "
                    "(crawl2chat.stages.training.sizing) and max_steps lowered to the steps that fit, never raised; "
                    "decided once per out folder (sizing.json), so reruns and resumes keep it. Evaluations and "
                    "start-up come on top. None: max_steps as set. `crawl2chat run`'s default preset sets 3; "
                    "`crawl2chat pretrain --max-steps` sets None.")


def _demo(cls, **fields):
    # Sized for the embedded default's small demo sets and a 2-core laptop.
    common = dict(seq_len=256, micro_batch_size=8, warmup_steps=5, eval_every=20, eval_batches=5,
                  checkpoint_every=20)
    return lambda: cls(**{**common, **fields})


class SFTStage(TrainStage):
    out: str = "runs/sft"
    registered_name: str | None = STAGES["sft"].registered_name
    data: str | None = Field(None, description="SFT data (JSONL/Parquet); None: derived from the data stage's shards.")
    train: SFTConfig = Field(default_factory=_demo(SFTConfig, max_steps=80, lr=1e-3, min_lr=1e-4))


class RewardStage(TrainStage):
    out: str = "runs/reward"
    registered_name: str | None = STAGES["reward"].registered_name
    data: str | None = Field(None, description="Preference pairs; None: derived from the data stage's shards.")
    train: RewardConfig = Field(default_factory=_demo(RewardConfig, max_steps=80, lr=1e-3, min_lr=1e-4))


class PPOStage(TrainStage):
    out: str = "runs/ppo"
    registered_name: str | None = STAGES["ppo"].registered_name
    prompts: str | None = Field(None, description="Prompts for rollouts; None: derived from the data stage's shards.")
    train: PPOConfig = Field(default_factory=lambda: PPOConfig(
        max_steps=16, rollout_batch_size=8, micro_batch_size=8, ppo_epochs=2, max_prompt_len=96, max_new_tokens=24,
        lr=1e-4))


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


class ContrastiveStage(TrainStage):
    out: str = "runs/contrastive"
    registered_name: str | None = STAGES["contrastive"].registered_name
    train: ContrastiveConfig = Field(default_factory=lambda: ContrastiveConfig(
        seq_len=64, micro_batch_size=32, max_steps=200, warmup_steps=20, lr=1e-3,
        min_lr=1e-4, eval_every=100, eval_batches=5, checkpoint_every=100, val_fraction=0.1, queue_size=4096),
        description="Training settings.")


class DistillStage(TrainStage):
    out: str = "runs/distill"
    registered_name: str | None = STAGES["distill"].registered_name
    train: DistillConfig = Field(default_factory=lambda: DistillConfig(
        preset="tiny", seq_len=128, micro_batch_size=8, max_steps=200, warmup_steps=20, lr=3e-3, min_lr=3e-4,
        eval_every=100, eval_batches=10, checkpoint_every=100), description="Training settings.")


class DemoSetsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    out: str = Field("runs/posttrain_data", description="Where the derived SFT/preference/prompt files go.")
    examples: int = Field(800, ge=4, description="Examples derived per set from the shards.")
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
    distill: DistillStage = Field(default_factory=DistillStage)
    contrastive: ContrastiveStage = Field(default_factory=ContrastiveStage)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)


# Larger runs of the same chain for users with more time or a GPU: overrides applied
# before --set, with the wall time to expect (measured shapes; see the README).
RUN_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("about 5 minutes on 2 recent CPU cores (AVX-512): pretraining's steps at most 3 minutes on any machine "
                "(fewer steps on a slower one), the other stages up to twice as long on older AVX2-only ones",
                {"pretrain.minutes": 3.0}),
    "large": ("about 2-3 hours on 2 CPU cores (a 5.6M-parameter model on ~25M tokens); 10-15 minutes on one GPU", {
        "data.crawl.max_pages": 3000, "demo_sets.examples": 2000,
        "pretrain.train.preset": "cpu", "pretrain.train.vocab_size": 8192, "pretrain.train.seq_len": 512,
        "pretrain.train.micro_batch_size": 16, "pretrain.train.max_steps": 3000, "pretrain.train.lr": 1e-3,
        "pretrain.train.min_lr": 1e-4, "pretrain.train.warmup_steps": 200, "pretrain.train.eval_every": 500,
        "pretrain.train.checkpoint_every": 500, "pretrain.train.eval_batches": 40,
        "sft.train.max_steps": 400, "reward.train.max_steps": 300, "ppo.train.max_steps": 60,
    }),
    "gpu": ("several hours on a CPU; about 30-60 minutes on one recent GPU (GPT-2-small shape, 124M parameters)", {
        "data.crawl.max_pages": 3000, "demo_sets.examples": 2000,
        "pretrain.train.preset": "124m", "pretrain.train.vocab_size": 16384, "pretrain.train.seq_len": 1024,
        "pretrain.train.micro_batch_size": 16, "pretrain.train.grad_accum": 4, "pretrain.train.max_steps": 2000,
        "pretrain.train.lr": 6e-4, "pretrain.train.min_lr": 6e-5, "pretrain.train.warmup_steps": 200,
        "pretrain.train.eval_every": 250, "pretrain.train.checkpoint_every": 250, "pretrain.train.eval_batches": 40,
        "sft.train.max_steps": 400, "reward.train.max_steps": 300, "ppo.train.max_steps": 60,
    }),
}


def _get_path(tree: dict[str, Any], dotted: str) -> Any:
    for key in dotted.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def apply_profile(data: DataConfig, embedded_site: bool) -> tuple[DataConfig, dict[str, Any]]:
    """``data`` with its profile's settings applied (``auto`` resolved), and what changed.

    A setting the user changed from its default is left alone, so every explicit
    setting still takes effect."""
    name = data.profile if data.profile != "auto" else ("docs" if embedded_site else "web")
    tree, defaults = data.model_dump(mode="json"), DataConfig().model_dump(mode="json")
    changed = {}
    for key, value in PROFILES[name].items():
        plain = yaml.safe_load(yaml.safe_dump(value))  # the JSON form, as dumped settings hold it
        if isinstance(plain, dict):
            plain = {str(k): v for k, v in plain.items()}
        if _get_path(tree, key) == _get_path(defaults, key):
            set_path(tree, key, plain)
            changed[key] = plain
    tree["profile"] = name
    try:
        return DataConfig.model_validate(tree), changed
    except ValidationError as e:
        raise SettingsError(format_errors(e, "data")) from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """The project settings from a YAML file and dotted overrides (see :func:`load_settings`)."""
    return load_settings(Config, path, overrides)
