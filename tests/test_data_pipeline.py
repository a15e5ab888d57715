"""The data stage end to end on real WARC files: real local Ray, real Parquet output."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from crawl2chat.stages.settings import load_config
from crawl2chat.stages.data import pipeline as steps
from crawl2chat.stages.data.versions import shard_files
from crawl2chat.stages.data.review import write_review
from crawl2chat.stages.data.warc_input import list_input_files

SHARD_COLUMNS = {"id", "url", "text", "lang", "lang_score", "quality_score", "source"}


def _inputs(shared: Path) -> list[str]:
    warc = shared / "warc"
    return [
        str(warc / "dolma"),  # English pages, wget crawls
        str(warc / "resiliparse" / "warcfile.warc.gz"),  # Chinese Common Crawl excerpt
        str(warc / "resiliparse" / "clueweb-quirk.warc.gz"),  # Japanese pages
        str(warc / "resiliparse" / "clipped.warc.gz"),  # truncated gzip
        str(warc / "warcio" / "example-bad.warc.gz.bad"),  # not per-record gzip
    ]


def run_all(cfg, files: list[str], out: Path) -> tuple[list[steps.StepResult], dict]:
    work = str(out / "work")
    d = cfg.data
    extracted = steps.extract_step(files, work, d.extract)
    identified = steps.langid_step(extracted, work, d.langid)
    filtered = steps.quality_step(identified, work, d.quality)
    deduped = steps.dedup_step(filtered, work, d.dedup)
    balanced = steps.balance_step(deduped, work, d.balance)
    results = [extracted, identified, filtered, deduped, balanced]
    manifest = steps.write_dataset(results, str(out), d.shard_bytes, cfg.model_dump(mode="json"))
    return results, manifest


@pytest.fixture(scope="module")
def pipeline_run(shared_data, ray_local, tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    cfg = load_config(overrides={"data.out": str(out)})
    files = list_input_files(_inputs(shared_data))
    results, manifest = run_all(cfg, files, out)
    return cfg, files, out, results, manifest


def test_shards_have_the_promised_columns_and_languages(pipeline_run):
    _, _, out, _, manifest = pipeline_run
    shards = shard_files(out)
    assert shards and manifest["shards"]
    table = pq.read_table(shards)
    assert SHARD_COLUMNS <= set(table.column_names)
    assert table.num_rows == manifest["documents_kept"] > 10
    langs = set(table["lang"].to_pylist())
    assert "en" in langs
    assert langs & {"zh", "ja"}, f"CJK pages were all dropped: {langs}"
    assert len(set(table["id"].to_pylist())) == table.num_rows
    assert pq.ParquetFile(shards[0]).metadata.row_group(0).column(0).compression == "ZSTD"


def test_every_document_is_accounted_for(pipeline_run):
    _, _, out, results, manifest = pipeline_run
    extracted = results[0]
    rejected = pq.read_table(sorted((out / "rejected").glob("*.parquet")))
    assert {"id", "url", "reason"} <= set(rejected.column_names)
    assert rejected.num_rows == manifest["documents_dropped"]
    # Every extracted record ends up either in a shard or in the quarantine.
    assert manifest["documents_kept"] + manifest["documents_dropped"] == extracted.rows_in
    assert sum(manifest["drop_reasons"].values()) == manifest["documents_dropped"]
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["content_digest"] == manifest["content_digest"]


def test_broken_files_are_reported_and_partial_content_kept(pipeline_run):
    _, files, _, _, manifest = pipeline_run
    bad = {Path(f["path"]).name: f for f in manifest["unreadable_files"]}
    assert "example-bad.warc.gz.bad" in bad
    assert "clipped.warc.gz" in bad
    assert all(f["error"] for f in bad.values())
    good = [f for f in manifest["files"] if f["ok"]]
    assert len(good) + len(bad) == len(files)


def test_rerun_skips_finished_steps_and_keeps_the_same_output(pipeline_run):
    cfg, files, out, _, manifest = pipeline_run
    results, again = run_all(cfg, files, out)
    assert all(r.skipped for r in results)
    assert again["content_digest"] == manifest["content_digest"]


def test_review_report_shows_kept_and_dropped_samples(pipeline_run):
    cfg, _, out, _, manifest = pipeline_run
    path = write_review(out, cfg.data.review)
    text = path.read_text()
    assert "## Kept" in text
    for reason in list(manifest["drop_reasons"])[:3]:
        assert f"`{reason}`" in text


def test_nothing_usable_fails_with_one_sentence(shared_data, ray_local, tmp_path):
    cfg = load_config(overrides={"data.out": str(tmp_path)})
    files = [str(shared_data / "warc" / "warcio" / "example-bad.warc.gz.bad")]
    with pytest.raises(steps.NothingUsableError) as err:
        run_all(cfg, files, tmp_path)
    message = str(err.value)
    assert message.endswith(".") and "\n" not in message


def test_quality_step_filters_with_a_plain_fasttext_classifier_on_ray(pipeline_run, tmp_path):
    """A classifier from plain ``fasttext.train_supervised`` runs in the quality step on Ray workers;
    replacing the model file reruns the step."""
    import fasttext

    from crawl2chat.stages.data.fasttext_models import to_line
    from crawl2chat.stages.data.settings import QualityClassifierConfig

    cfg, _, _, results, _ = pipeline_run
    identified = results[1]
    table = pq.read_table(sorted(Path(identified.out_dir).glob("*.parquet")), columns=["text", "lang", "drop_reason"])
    rows = [r for r in table.to_pylist() if r["drop_reason"] is None and r["text"]]
    lines = [f"__label__{'keep' if r['lang'] == 'en' else 'other'} {to_line(r['text'], 'whitespace', 2000)}"
             for r in rows]
    (tmp_path / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    model = tmp_path / "english.bin"
    fasttext.train_supervised(input=str(tmp_path / "train.txt"), epoch=20, dim=16, bucket=10_000,
                              thread=1, verbose=0).save_model(str(model))

    quality = cfg.data.quality.model_copy(update={"classifier": QualityClassifierConfig(
        enabled=True, model=str(model), label="__label__keep", preprocess="whitespace", max_chars=2000)})
    work = str(tmp_path / "work")
    result = steps.quality_step(identified, work, quality)
    assert result.extra["classifier"] == "given" and result.dropped.get("quality_classifier:below_threshold")
    kept = pq.read_table(sorted(Path(result.out_dir).glob("*.parquet")),
                         columns=["lang", "quality_score", "drop_reason"]).to_pylist()
    kept = [r for r in kept if r["drop_reason"] is None]
    assert kept and all(r["quality_score"] >= 0.5 for r in kept)
    assert sum(r["lang"] == "en" for r in kept) >= 0.9 * len(kept)

    assert steps.quality_step(identified, work, quality).skipped
    model.write_bytes(model.read_bytes())  # same bytes, new file identity (size, mtime)
    assert not steps.quality_step(identified, work, quality).skipped
