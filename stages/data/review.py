"""A readable sample of what the data stage kept and dropped, for human review.

Filters are tuned by reading their output. The report shows a random sample of
kept documents and, for every drop reason, a sample of the documents it
removed, each cut to a readable length, so a person can spot a rule that
discards good pages (a German page failing an English stop-word rule, say).
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from crawl2chat.stages.data.versions import read_manifest
from crawl2chat.stages.settings import PROFILES
from crawl2chat.stages.data.settings import ReviewConfig


def _sample(rows: list[dict], n: int, rng: random.Random) -> list[dict]:
    return rows if len(rows) <= n else rng.sample(rows, n)


def _excerpt(text: str | None, max_chars: int) -> str:
    text = (text or "").strip()
    if len(text) > max_chars:
        text = text[:max_chars].rstrip() + " …"
    return "\n".join("> " + line if line.strip() else ">" for line in text.splitlines()) or "> (empty)"


def _read(files: list[Path], columns: list[str]) -> list[dict]:
    return pq.read_table(files, columns=columns).to_pylist() if files else []


def _version_files(out: Path) -> tuple[list[Path], list[Path]]:
    """Shards and quarantine files the current version added (all files of a folder without a manifest)."""
    manifest = read_manifest(out)
    if not manifest or "version" not in manifest:
        return sorted((out / "shards").glob("*.parquet")), sorted((out / "rejected").glob("*.parquet"))
    version = manifest["version"]
    shards = [out / s["path"] for s in manifest["shards"] if s.get("version") == version]
    rejected = [out / r for r in manifest.get("rejected", []) if Path(r).name.startswith(f"{version}-")]
    return shards, rejected


def _profile_lines(manifest: dict) -> list[str]:
    """The rule profile the version was built with and the settings it set."""
    data = (manifest.get("config") or {}).get("data") or {}
    name = data.get("profile")
    if not PROFILES.get(name):
        return []
    lines = ["", f"Rule profile `{name}` (`data.profile`): these settings differ from the published web defaults "
             "(unless set explicitly):", ""]
    for key in PROFILES[name]:
        value = data
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        lines.append(f"- `data.{key}` = `{value}`")
    return lines


def write_review(out_dir: str | Path, cfg: ReviewConfig) -> Path:
    """Write ``OUT/review.md`` from the shards and quarantine of the current version; returns its path."""
    out = Path(out_dir)
    rng = random.Random(cfg.seed)
    shard_files, rejected_files = _version_files(out)
    kept = _read(shard_files, ["id", "url", "lang", "quality_score", "text"])
    rejected = _read(rejected_files, ["id", "url", "reason", "lang", "text"])
    by_reason: dict[str, list[dict]] = defaultdict(list)
    for row in rejected:
        by_reason[row["reason"]].append(row)

    lines = [
        "# Data review sample",
        "",
        f"{len(kept)} documents kept, {len(rejected)} dropped. Read a sample of each and check",
        "that the rules drop what they should and nothing else.",
        "",
        "| drop reason | documents |",
        "|---|---|",
    ]
    lines += [f"| `{r}` | {len(v)} |" for r, v in sorted(by_reason.items(), key=lambda kv: -len(kv[1]))]
    lines += _profile_lines(read_manifest(out) or {})
    lines += ["", f"## Kept ({min(len(kept), cfg.kept_samples)} of {len(kept)})", ""]
    for row in _sample(kept, cfg.kept_samples, rng):
        score = row.get("quality_score")
        lines += [
            f"### {row['url']}",
            f"lang `{row.get('lang')}` · quality {score if score is None else round(score, 3)} · id `{row['id']}`",
            "",
            _excerpt(row["text"], cfg.max_chars),
            "",
        ]
    for reason, rows in sorted(by_reason.items()):
        lines += [f"## Dropped: `{reason}` ({min(len(rows), cfg.samples_per_reason)} of {len(rows)})", ""]
        for row in _sample(rows, cfg.samples_per_reason, rng):
            lines += [f"### {row['url']}", f"lang `{row.get('lang')}` · id `{row['id']}`", "",
                      _excerpt(row["text"], cfg.max_chars), ""]
    path = out / "review.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines), encoding="utf-8")
    tmp.replace(path)
    return path
