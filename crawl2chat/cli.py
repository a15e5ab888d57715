"""The ``crawl2chat`` command line (alias ``c2c``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from crawl2chat.infra.prefect_runtime import configure_prefect_env

app = typer.Typer(add_completion=False, no_args_is_help=True, help="From raw web pages to an aligned chat model.")

CONFIG_OPT = typer.Option(None, "--config", "-c", help="YAML configuration file.")
SET_OPT = typer.Option(None, "--set", help="Override a config field: KEY.PATH=VALUE (repeatable).")


def _load(config: Optional[Path], overrides: dict, sets: Optional[list[str]]):
    from crawl2chat.infra.config import ConfigError, load_config, parse_override

    try:
        merged = dict(parse_override(s) for s in (sets or []))
        merged.update({k: v for k, v in overrides.items() if v not in (None, [], ())})
        return load_config(config, merged)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@app.command()
def data(
    input: Optional[list[str]] = typer.Option(None, "--input", "-i", help="WARC/WET file or folder (repeatable); local or fsspec URL."),
    seed_url: Optional[list[str]] = typer.Option(None, "--seed-url", help="Crawl from this URL first (repeatable)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output folder."),
    refresh: bool = typer.Option(False, "--refresh", help="Add only new/changed pages to the dataset in --out as a new version."),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """Web pages -> clean, language-tagged, deduplicated Parquet shards (a new dataset version)."""
    cfg = _load(config, {"data.inputs": input, "data.seed_urls": seed_url, "data.out": out,
                         "data.refresh": True if refresh else None}, set_)
    configure_prefect_env(cfg.home)
    from crawl2chat.flows.data import data_flow
    from crawl2chat.stages.data_pipeline import NothingUsableError

    try:
        manifest = data_flow(cfg)
    except NothingUsableError as e:
        _fail(str(e))
    except FileNotFoundError as e:
        _fail(str(e))
    out_dir = Path(cfg.data.out).resolve()
    typer.echo(
        f"\n{manifest['version']}: {manifest['documents_kept']} documents ({manifest['version_documents_kept']} new), "
        f"{manifest['documents_dropped']} dropped.\n"
        f"  shards:   {out_dir / 'shards'}\n  rejected: {out_dir / 'rejected'}\n"
        f"  manifest: {out_dir / 'manifest.json'}\n  review:   {out_dir / 'review.md'}\n"
        f"  MLflow:   {_mlflow_hint(cfg)}"
    )


def _mlflow_hint(cfg) -> str:
    from crawl2chat.infra.tracking import tracking_uri

    uri = tracking_uri(cfg.home, cfg.tracking.uri)
    if uri.startswith("sqlite:"):
        return f"{uri}  (browse: mlflow ui --backend-store-uri {uri})"
    return uri


@app.command()
def pretrain(
    data: str = typer.Option(..., "--data", help="A data-stage output folder (DIR/shards) or a plain text file."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Run folder; re-running on it resumes."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Model preset: tiny, cpu-small, cpu, 124m, 1b."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Optimizer steps."),
    num_processes: Optional[int] = typer.Option(None, "--num-processes", help="Processes (DDP when > 1)."),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """Tokenizer and base model, trained from scratch under `accelerate launch`."""
    cfg = _load(config, {"pretrain.out": out, "pretrain.train.preset": preset,
                         "pretrain.train.max_steps": max_steps, "pretrain.num_processes": num_processes}, set_)
    configure_prefect_env(cfg.home)
    from crawl2chat.flows.pipeline import pretrain_flow

    summary = pretrain_flow(cfg, data)
    typer.echo(f"\nbase model: {summary['model_dir']}\n  val_loss {summary['val_loss']:.4f}, "
               f"val_bpb {summary['val_bpb']:.4f}, {summary['steps']} steps\n  MLflow: {summary.get('model_uri')}")


@app.command()
def train(
    data: str = typer.Option(..., "--data", help="A data-stage output folder (its current version is read)."),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """Every training stage from existing shards: base model, SFT, reward model, PPO (DPO when enabled)."""
    cfg = _load(config, {}, set_)
    configure_prefect_env(cfg.home)
    from crawl2chat.flows.pipeline import train_flow

    result = train_flow(cfg, data)
    typer.echo("\n".join(f"{name + ' model:':<14} {result[name]['model_dir']}"
                          for name in ("pretrain", "sft", "reward", "ppo", "dpo") if name in result))


def _run_stage_flow(flow_name: str, config: Optional[Path], overrides: dict, sets: Optional[list[str]], **inputs) -> dict:
    cfg = _load(config, overrides, sets)
    configure_prefect_env(cfg.home)
    from crawl2chat.flows import pipeline

    summary = getattr(pipeline, f"{flow_name}_flow")(cfg, **inputs)
    typer.echo(f"\n{flow_name} model: {summary['model_dir']}\n  MLflow: {summary.get('model_uri')} (run {summary['run_id']})")
    return summary


@app.command()
def sft(
    base: str = typer.Option(..., "--base", help="Base model folder (Hugging Face format)."),
    data: str = typer.Option(..., "--data", help="Chat data: JSONL or Parquet (messages | prompt+response | instruction+input+output)."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Run folder; re-running on it resumes."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps"),
    num_processes: Optional[int] = typer.Option(None, "--num-processes"),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """Supervised fine-tuning: loss on assistant tokens only, packed sequences."""
    _run_stage_flow("sft", config, {"sft.out": out, "sft.train.max_steps": max_steps,
                                    "sft.num_processes": num_processes}, set_, base=base, data=data)


@app.command()
def reward(
    base: str = typer.Option(..., "--base", help="Base model folder."),
    data: str = typer.Option(..., "--data", help="Preference pairs: prompt+chosen+rejected[+margin], or HH transcripts."),
    out: Optional[str] = typer.Option(None, "--out", "-o"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps"),
    num_processes: Optional[int] = typer.Option(None, "--num-processes"),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """Reward model: scalar head, pairwise loss, held-out accuracy."""
    _run_stage_flow("reward", config, {"reward.out": out, "reward.train.max_steps": max_steps,
                                       "reward.num_processes": num_processes}, set_, base=base, data=data)


@app.command()
def ppo(
    policy: str = typer.Option(..., "--policy", help="SFT model folder (actor and frozen reference)."),
    reward_model: str = typer.Option(..., "--reward", help="Reward model folder (frozen scorer, critic init)."),
    prompts: str = typer.Option(..., "--prompts", help="Prompts: JSONL/Parquet with `prompt` or `messages`."),
    out: Optional[str] = typer.Option(None, "--out", "-o"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Rollouts."),
    num_processes: Optional[int] = typer.Option(None, "--num-processes"),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """PPO with a KL penalty to the reference, GAE, clipped policy and value losses."""
    _run_stage_flow("ppo", config, {"ppo.out": out, "ppo.train.max_steps": max_steps,
                                    "ppo.num_processes": num_processes}, set_,
                    policy=policy, reward=reward_model, prompts=prompts)


@app.command()
def dpo(
    policy: str = typer.Option(..., "--policy", help="SFT model folder (policy and frozen reference)."),
    data: str = typer.Option(..., "--data", help="Preference pairs."),
    out: Optional[str] = typer.Option(None, "--out", "-o"),
    max_steps: Optional[int] = typer.Option(None, "--max-steps"),
    num_processes: Optional[int] = typer.Option(None, "--num-processes"),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """Direct Preference Optimisation against a frozen reference."""
    _run_stage_flow("dpo", config, {"dpo.out": out, "dpo.train.max_steps": max_steps,
                                    "dpo.num_processes": num_processes}, set_, policy=policy, data=data)


@app.command()
def run(
    refresh: bool = typer.Option(False, "--refresh", help="Add only new/changed pages to the existing dataset."),
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """The main job, end to end on the embedded default (local Ray, Prefect, MLflow)."""
    cfg = _load(config, {"data.refresh": True if refresh else None}, set_)
    configure_prefect_env(cfg.home)
    from crawl2chat.flows.pipeline import pipeline_flow
    from crawl2chat.stages.data_pipeline import NothingUsableError

    try:
        result = pipeline_flow(cfg)
    except NothingUsableError as e:
        _fail(str(e))
    manifest, base = result["manifest"], result["pretrain"]
    data_out = Path(result["data"])
    lines = [
        f"\nDone. {manifest['documents_kept']} documents kept, {manifest['documents_dropped']} dropped.",
        f"  dataset:      {data_out / 'manifest.json'}  (version {manifest['version']}, {len(manifest['shards'])} shards"
        f" in {data_out / 'shards'}; review.md, rejected/ beside it)",
        f"  base model:   {base['model_dir']}  (val_bpb {base['val_bpb']:.3f})",
        f"  SFT model:    {result['sft']['model_dir']}",
        f"  reward model: {result['reward']['model_dir']}  (eval_accuracy {result['reward'].get('eval_accuracy', float('nan')):.3f})",
        f"  PPO policy:   {result['ppo']['model_dir']}  (reward {result['ppo'].get('reward_mean_first', float('nan')):.3f}"
        f" -> {result['ppo'].get('reward_mean_last', float('nan')):.3f})",
    ]
    if "dpo" in result:
        lines.append(f"  DPO policy:   {result['dpo']['model_dir']}")
    lines += [f"  MLflow:       {_mlflow_hint(cfg)}  parent run {result['run_id']}",
              f"  lineage:      crawl2chat lineage {result['ppo']['model_dir']}"]
    typer.echo("\n".join(lines))


@app.command()
def lineage(
    ref: str = typer.Argument(..., help="A run id, models:/NAME/VERSION, models:/NAME@ALIAS, or a model folder."),
    config: Optional[Path] = CONFIG_OPT,
) -> None:
    """Print the chain data -> tokenizer/base model -> SFT -> reward model -> policy around a model or run."""
    cfg = _load(config, {}, None)
    from crawl2chat.infra.lineage import format_lineage
    from crawl2chat.infra.tracking import setup_tracking

    setup_tracking(cfg.home, cfg.tracking.experiment, cfg.tracking.uri)
    try:
        typer.echo(format_lineage(ref))
    except Exception as e:  # noqa: BLE001 - a bad reference gets one plain line, not a traceback
        _fail(f"cannot resolve {ref!r}: {e}")


@app.command("serve-flows")
def serve_flows(
    refresh_cron: str = typer.Option("0 3 * * *", "--refresh-cron", help="Cron schedule of the data refresh (UTC)."),
) -> None:
    """Serve the pipeline, data-refresh, train and single-stage flows to a Prefect server (set PREFECT_API_URL)."""
    configure_prefect_env()
    from prefect import serve

    from crawl2chat.flows.data import data_flow
    from crawl2chat.flows import pipeline

    serve(
        pipeline.pipeline_flow.to_deployment(name="pipeline"),
        data_flow.to_deployment(name="data-refresh", cron=refresh_cron, parameters={"refresh": True}),
        *(getattr(pipeline, f"{name}_flow").to_deployment(name=name)
          for name in ("train", "pretrain", "sft", "reward", "ppo", "dpo")),
    )


from crawl2chat.serving_cli import register as _register_serving  # noqa: E402

_register_serving(app)


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
