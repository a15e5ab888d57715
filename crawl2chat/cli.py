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
    config: Optional[Path] = CONFIG_OPT,
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """Web pages -> clean, language-tagged, deduplicated Parquet shards."""
    cfg = _load(config, {"data.inputs": input, "data.seed_urls": seed_url, "data.out": out}, set_)
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
        f"\n{manifest['documents_kept']} documents kept, {manifest['documents_dropped']} dropped.\n"
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
def run(
    config: Optional[Path] = CONFIG_OPT,
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output folder of the data stage."),
    set_: Optional[list[str]] = SET_OPT,
) -> None:
    """The main job, end to end on the embedded default (local Ray, Prefect, MLflow)."""
    data(input=None, seed_url=None, out=out, config=config, set_=set_)


def main() -> None:  # pragma: no cover
    sys.exit(app())


if __name__ == "__main__":  # pragma: no cover
    main()
