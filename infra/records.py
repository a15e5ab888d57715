"""What a person reads first on an MLflow run: a short markdown record and plots.

Each stage run carries a record in the spirit of an experiment log (goal,
configuration, data size, results table) as the run's description and as
``record.md``, and the figures worth a glance as images: loss curves of training
stages, drop reasons of the data stage, dedup cluster sizes.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Iterable

import mlflow

from crawl2chat.stages.secrets import mask_secrets


def _table(rows: dict[str, Any]) -> list[str]:
    lines = ["| | |", "|---|---|"]
    for key, value in rows.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        lines.append(f"| {key} | {value} |")
    return lines


def log_record(goal: str, config: dict[str, Any], data: dict[str, Any], results: dict[str, Any]) -> str:
    """Markdown record of the active run: description (``mlflow.note.content``) and ``record.md``
    (credentials in the configuration and the tables masked)."""
    config, data, results = mask_secrets(config), mask_secrets(data), mask_secrets(results)
    text = "\n".join(
        [f"**Goal.** {goal}", "", "**Data.**", *_table(data), "", "**Results.**", *_table(results), "",
         "<details><summary>Configuration</summary>", "", "```json",
         json.dumps(config, indent=2, default=str)[:20000], "```", "</details>", ""]
    )
    mlflow.set_tag("mlflow.note.content", text)
    mlflow.log_text(text, "record.md")
    return text


def _save_figure(fig, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        mlflow.log_artifact(str(path), artifact_path="plots")


def load_plotting():
    """matplotlib's ``Figure`` (imported on first use: ~0.45 s). Figures are made and saved
    through it, not pyplot: no global figure registry to close them from (safe from several
    threads) and pyplot's own import (~0.1 s of a command) is not paid."""
    from matplotlib.figure import Figure

    return Figure


def plot_bars(counts: dict[str, int | float], title: str, name: str) -> None:
    if not counts:
        return
    items = sorted(counts.items(), key=lambda kv: kv[1])
    fig = load_plotting()(figsize=(7, 0.35 * len(items) + 1.2))
    ax = fig.subplots()
    ax.barh([k for k, _ in items], [v for _, v in items], color="#4c72b0")
    ax.set_title(title)
    _save_figure(fig, name)


def plot_curves(rows: Iterable[dict], keys: Iterable[str], title: str, name: str) -> None:
    """Line plot of ``keys`` against ``step`` from metrics.jsonl rows (the last value per step)."""
    series: dict[str, dict[int, float]] = {}
    for row in rows:
        for key in keys:
            value = row.get(key)
            if isinstance(value, (int, float)) and value == value and "step" in row:
                series.setdefault(key, {})[int(row["step"])] = float(value)
    if not series:
        return
    fig = load_plotting()(figsize=(7, 4))
    ax = fig.subplots()
    for key, points in series.items():
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], label=key)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.legend()
    _save_figure(fig, name)
