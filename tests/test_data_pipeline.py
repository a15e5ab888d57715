"""The data stage end to end on real WARC files: real local Ray, real Parquet output."""

from __future__ import annotations

import io
import json
import random
import shutil
import uuid
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

from crawl2chat.stages.settings import load_config
from crawl2chat.stages.data import pipeline as steps
from crawl2chat.stages.data.versions import shard_files
from crawl2chat.stages.data.review import write_review
from crawl2chat.stages.data.warc_input import WarcReader, list_input_files

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


def test_step_folders_read_by_the_driver_or_by_ray_workers_give_the_same_rows(pipeline_run, monkeypatch):
    """Small step folders are read on the driver, large ones by Ray's Parquet reader: same rows."""
    _, _, _, results, _ = pipeline_run

    def rows(step_dir: str) -> list[dict]:
        return sorted(steps.read_kept(step_dir).take_all(), key=lambda r: r["id"])

    on_driver = {r.name: rows(r.out_dir) for r in results}
    monkeypatch.setattr(steps, "DRIVER_READ_BYTES", 0)
    by_workers = {r.name: rows(r.out_dir) for r in results}
    assert on_driver == by_workers
    assert all(on_driver[r.name] and len(on_driver[r.name]) == r.kept for r in results)


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


# -- inputs that repeat each other -------------------------------------------------------

PROSE = (
    "the river town market people walked along old stone bridge morning light fell across water boats "
    "carried fish bread and wine from farms in the valley children played near gardens while their parents "
    "talked about weather prices harvest news letters from cities far away each season brought travellers "
    "who told stories of mountains forests roads and long winters that shaped the life of every family"
).split()


def page_html(n: int) -> str:
    """A page of plain English prose (five paragraphs), distinct per ``n``."""
    rng = random.Random(n)
    paragraphs = [
        " ".join(" ".join(rng.choice(PROSE) for _ in range(rng.randint(9, 15))).capitalize() + "." for _ in range(4))
        for _ in range(5)
    ]
    body = "".join(f"<p>{p}</p>" for p in paragraphs)
    return f"<html><head><title>page {n}</title></head><body>{body}</body></html>"


def write_warc(path: Path, pages) -> list[int]:
    """One gzipped response record per page number, with a fixed record id and date
    (so the same page written to two files is the same record); returns the offset
    after each record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ends = []
    with open(path, "wb") as out:
        writer = WARCWriter(out, gzip=True)
        for n in pages:
            body = page_html(n).encode()
            http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
            record = writer.create_warc_record(
                f"http://town.example.org/page{n}", "response", payload=io.BytesIO(body), length=len(body),
                http_headers=http,
                warc_headers_dict={"WARC-Record-ID": f"<urn:uuid:{uuid.UUID(int=n + 1)}>",
                                   "WARC-Date": "2024-05-01T00:00:00Z"},
            )
            writer.write_record(record)
            ends.append(out.tell())
    return ends


def shard_rows(out: Path) -> list[dict]:
    return pq.read_table(shard_files(out), columns=["id", "url", "source", "text"]).to_pylist()


def test_records_repeated_across_inputs_are_kept_once(ray_local, tmp_path):
    inputs = tmp_path / "in"
    write_warc(inputs / "a.warc.gz", range(5))
    write_warc(inputs / "b.warc.gz", [2, 3, 5, 6])  # repeats two records of a
    (inputs / "copy").mkdir()
    shutil.copy(inputs / "a.warc.gz", inputs / "copy" / "a.warc.gz")  # the same archive under another path
    files = [str(inputs / "a.warc.gz"), str(inputs / "b.warc.gz"), str(inputs / "copy" / "a.warc.gz"),
             str(inputs / "a.warc.gz")]  # ... and the same path listed twice
    out = tmp_path / "data"
    cfg = load_config(overrides={"data.out": str(out), "data.dedup.num_shards": 4})
    results, manifest = run_all(cfg, files, out)

    rows = shard_rows(out)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == manifest["documents_kept"] == 7
    assert sorted(r["url"].rsplit("/", 1)[1] for r in rows) == [f"page{n}" for n in range(7)]
    # Each of a's records is read three times more (b holds two of them): 2 + 5 + 5 repeats.
    assert manifest["drop_reasons"] == {"dedup:repeated_record": 12}
    dedup = next(s for s in manifest["steps"] if s["name"] == "dedup")
    assert dedup["extra"]["dedup"]["repeated_records"] == 12
    # Equal copies: the smaller source name stays, so pages 2 and 3 come from a, not b.
    assert {r["url"].rsplit("/", 1)[1]: r["source"] for r in rows if r["url"].endswith(("2", "3"))} == {
        "page2": "a.warc.gz", "page3": "a.warc.gz"}
    rejected = pq.read_table(sorted((out / "rejected").glob("*.parquet"))).to_pylist()
    assert Counter(r["reason"] for r in rejected) == {"dedup:repeated_record": 12}
    assert set(r["id"] for r in rejected) <= set(ids)
    assert manifest["documents_kept"] + manifest["documents_dropped"] == results[0].rows_in == 19


def test_readable_records_of_a_truncated_copy_are_repeats(ray_local, tmp_path):
    inputs = tmp_path / "in"
    ends = write_warc(inputs / "a.warc.gz", range(5))
    whole = (inputs / "a.warc.gz").read_bytes()
    # A re-download cut off in the fourth record's gzip member (its name sorts before a's).
    cut = ends[2] + (ends[3] - ends[2]) * 9 // 10
    (inputs / "a-cut.warc.gz").write_bytes(whole[:cut])
    files = [str(inputs / "a.warc.gz"), str(inputs / "a-cut.warc.gz")]
    out = tmp_path / "data"
    cfg = load_config(overrides={"data.out": str(out), "data.dedup.num_shards": 4})
    results, manifest = run_all(cfg, files, out)

    [cut_file] = manifest["unreadable_files"]
    assert cut_file["path"].endswith("a-cut.warc.gz") and "truncated record" in cut_file["error"]
    assert cut_file["records"] == 4  # three whole records and the cut one
    rows = {r["id"]: r for r in shard_rows(out)}
    assert len(rows) == manifest["documents_kept"] == 5
    # The cut record is quarantined as cut; the three whole ones before it are repeats.
    assert manifest["drop_reasons"] == {"dedup:repeated_record": 3, "extract:truncated_record": 1}
    rejected = pq.read_table(sorted((out / "rejected").glob("*.parquet"))).to_pylist()
    [cut_row] = [r for r in rejected if r["reason"] == "extract:truncated_record"]
    assert cut_row["source"] == "a-cut.warc.gz" and cut_row["url"].endswith("/page3")
    # The cut record keeps the whole copy, although the cut file's name sorts first.
    page3 = next(r for r in rows.values() if r["url"].endswith("/page3"))
    assert page3["source"] == "a.warc.gz"
    whole_docs = {d["id"]: d["text"] for d in WarcReader().run(str(inputs / "a.warc.gz"))}
    assert {i: r["text"] for i, r in rows.items()} == whole_docs
    assert manifest["documents_kept"] + manifest["documents_dropped"] == results[0].rows_in == 9


def test_near_duplicates_are_quarantined_with_the_document_their_cluster_kept(ray_local, tmp_path):
    """Each copy MinHash drops names, in the version's quarantine, the kept document of its
    cluster (``dup_cluster``), which the contrastive stage reads as a positive pair."""
    from crawl2chat.stages.training.contrastive import cluster_pairs

    inputs = tmp_path / "in"
    write_warc(inputs / "a.warc.gz", range(6))
    # A mirror of pages 0..2: the same prose under other addresses, a few words changed.
    with open(inputs / "mirror.warc.gz", "wb") as f:
        writer = WARCWriter(f, gzip=True)
        for n in range(3):
            body = page_html(n).replace("river", "creek", 1).replace("bridge", "ford", 1).encode()
            http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")], protocol="HTTP/1.1")
            writer.write_record(writer.create_warc_record(
                f"http://mirror.example.net/copy{n}", "response", payload=io.BytesIO(body), length=len(body),
                http_headers=http, warc_headers_dict={"WARC-Date": "2024-05-01T00:00:00Z"}))
    out = tmp_path / "data"
    cfg = load_config(overrides={"data.out": str(out), "data.dedup.num_shards": 4})
    _, manifest = run_all(cfg, [str(inputs / "a.warc.gz"), str(inputs / "mirror.warc.gz")], out)

    by_id = {r["id"]: r for r in shard_rows(out)}
    rejected = pq.read_table([out / r for r in manifest["rejected"]]).to_pylist()
    near = [r for r in rejected if r["reason"] in ("dedup:near", "dedup:exact")]
    assert len(near) == 3 and len(by_id) == 6
    for r in near:  # each copy names the page of its own number, whichever of the two was kept
        assert r["dup_cluster"] in by_id and by_id[r["dup_cluster"]]["url"][-1] == r["url"][-1]
    assert all(r["dup_cluster"] is None for r in rejected if not r["reason"].startswith("dedup:"))
    pairs = cluster_pairs(out)
    assert sorted((p["cluster"], p["query"]) for p in pairs) == sorted((r["dup_cluster"], r["text"]) for r in near)
    assert all(p["positive"] == by_id[p["cluster"]]["text"] for p in pairs)
