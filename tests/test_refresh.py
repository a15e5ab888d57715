"""Incremental refresh of a dataset: a real site on 127.0.0.1 crawled, changed, re-crawled.

The refresh sends conditional requests, runs only the new and changed pages
through the steps, drops a new page that copies an old one (the dedup index of
the first version is reused), and commits a second version that lists the
first version's shards, untouched, plus its own.
"""

from __future__ import annotations

import hashlib
import random
import shutil

import mlflow
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from test_crawl import LocalServer
from test_data_pipeline import write_warc

from crawl2chat.stages.settings import load_config
from crawl2chat.stages.data.versions import committed_versions, iter_documents, read_manifest, shard_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORDS = (
    "the river town market people walked along old stone bridge morning light fell across water boats "
    "carried fish bread and wine from farms in the valley children played near gardens while their parents "
    "talked about weather prices harvest news letters from cities far away each season brought travellers "
    "who told stories of mountains forests roads and long winters that shaped the life of every family"
).split()


def page_text(seed: int) -> str:
    """A page of plain English prose: five paragraphs of full sentences, distinct per seed."""
    rng = random.Random(seed)
    paragraphs = []
    for _ in range(5):
        sentences = []
        for _ in range(4):
            words = [rng.choice(WORDS) for _ in range(rng.randint(9, 15))]
            sentences.append(" ".join(words).capitalize() + ".")
        paragraphs.append(" ".join(sentences))
    return "".join(f"<p>{p}</p>" for p in paragraphs)


class Site:
    """Pages whose bodies can change between crawls; answers If-None-Match with 304."""

    def __init__(self) -> None:
        self.pages = {f"/page{i}": page_text(i) for i in range(5)}

    def body(self, path: str) -> str:
        if path == "/":
            links = "".join(f'<a href="{p}">{p}</a> ' for p in sorted(self.pages))
            return f"<html><body>{links}</body></html>"
        return f"<html><head><title>{path}</title></head><body>{self.pages[path]}</body></html>"

    async def handle(self, request: web.Request) -> web.Response:
        if request.path != "/" and request.path not in self.pages:
            raise web.HTTPNotFound()
        body = self.body(request.path)
        etag = '"' + hashlib.sha1(body.encode()).hexdigest()[:16] + '"'
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={"ETag": etag})
        return web.Response(text=body, content_type="text/html", charset="utf-8", headers={"ETag": etag})


def shard_digests(out) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "shards").glob("*.parquet"))}


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_refresh_adds_only_new_and_changed_pages_as_a_new_version(prefect_api, ray_local, tmp_path, engine):
    from crawl2chat.flows.data import data_flow

    site = Site()
    out = tmp_path / "data"
    server = LocalServer([web.get("/{tail:.*}", site.handle)])
    with server:
        cfg = load_config(overrides={
            "home": str(tmp_path / "home"),
            "data.out": str(out),
            "data.seed_urls": [server.url + "/"],
            "data.crawl.per_host_delay_s": 0.0,
            "data.crawl.respect_robots": False,
            "data.engine": engine,
        })
        first = data_flow(cfg)
        v1_shards = shard_digests(out)
        requests_before = len(server.requests)

        # The site changes: one page rewritten, one new page, one new page copying an old one.
        site.pages["/page1"] = page_text(101)
        site.pages["/page5"] = page_text(5)
        site.pages["/copy-of-page3"] = site.pages["/page3"]
        second = data_flow(cfg, refresh=True)
        refresh_requests = len(server.requests) - requests_before
        after = shard_digests(out)

        # Nothing changed since: every page answers 304 and the version adds no document.
        third = data_flow(cfg, refresh=True)

    assert first["version"] == "v0001"
    assert first["documents_kept"] == 5, first["drop_reasons"]

    assert second["version"] == "v0002" and second["base_version"] == "v0001" and second["refresh"]
    # Only the index, the changed page and the two new pages went through the steps;
    # the unchanged pages answered 304 to conditional requests.
    extract = next(s for s in second["steps"] if s["name"] == "extract")
    assert extract["rows_in"] == 4, extract
    assert refresh_requests == 8
    # The copy of an old page is dropped against the first version's dedup index.
    assert second["drop_reasons"].get("dedup:exact", 0) + second["drop_reasons"].get("dedup:near", 0) == 1
    assert second["version_documents_kept"] == 2  # the rewritten page1 and page5
    # The rewritten page replaces its first version: readers see 6 pages, page1 as it is now.
    assert second["version_documents_superseded"] == 1 and second["documents_kept"] == 6
    docs = {row["url"]: row["text"] for row in iter_documents(out, ["url", "text"])}
    assert len(docs) == 6
    page1 = next(text for url, text in docs.items() if url.endswith("/page1"))
    assert page1.startswith(page_text(101)[len("<p>"):][:40])
    # The first version's shards are untouched; the second lists them plus its own.
    assert {k: after[k] for k in v1_shards} == v1_shards
    assert [s["path"] for s in second["shards"]][: len(first["shards"])] == [s["path"] for s in first["shards"]]
    assert pq.read_table(shard_files(out)).num_rows == 7  # the old copy stays in v0001's shard
    assert read_manifest(out, "v0001")["content_digest"] == first["content_digest"] != second["content_digest"]

    # The unchanged re-crawl keeps the content digest, so training keyed by it has nothing to redo.
    assert third["version_documents_kept"] == 0
    assert third["content_digest"] == second["content_digest"]
    assert shard_digests(out) == after
    assert committed_versions(out) == ["v0001", "v0002", "v0003"]

    # Each version's write run records the dataset version as an MLflow dataset input.
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    writes = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string="tags.mlflow.runName = 'write'")
    inputs = {d.dataset.name: d.dataset.digest for r in writes
              for d in client.get_run(r.info.run_id).inputs.dataset_inputs}
    assert {"data@v0001", "data@v0002"} <= set(inputs), (inputs, [(r.info.run_id, r.data.tags.get(
        "crawl2chat.data_version"), r.info.status) for r in writes])
    assert inputs["data@v0001"] == first["content_digest"][7:23]
    assert inputs["data@v0002"] == second["content_digest"][7:23]


def test_refresh_reading_a_copy_of_an_old_file_adds_nothing(prefect_api, ray_local, tmp_path):
    from crawl2chat.flows.data import data_flow

    inputs, out = tmp_path / "in", tmp_path / "data"
    write_warc(inputs / "crawl-1.warc.gz", range(5))
    cfg = load_config(overrides={
        "home": str(tmp_path / "home"),
        "data.out": str(out),
        "data.inputs": [str(inputs)],
        "data.dedup.num_shards": 4,
    })
    first = data_flow(cfg)
    # The old file copied under a new name: the refresh reads it as a new input file.
    shutil.copy(inputs / "crawl-1.warc.gz", inputs / "crawl-1-copy.warc.gz")
    second = data_flow(cfg, refresh=True)

    assert first["documents_kept"] == 5, first["drop_reasons"]
    extract = next(s for s in second["steps"] if s["name"] == "extract")
    assert second["refresh"] and extract["rows_in"] == 5  # only the copy was read
    assert second["version_documents_kept"] == 0 and second["documents_kept"] == 5
    assert second["drop_reasons"] == {"dedup:repeated_record": 5}
    dedup = next(s for s in second["steps"] if s["name"] == "dedup")
    assert dedup["extra"]["dedup"]["repeated_records"] == 5
    # Every shard file of every version: no id twice.
    ids = pq.read_table(sorted((out / "shards").glob("*.parquet")), columns=["id"])["id"].to_pylist()
    assert len(ids) == len(set(ids)) == 5
    rejected = pq.read_table(sorted((out / "rejected").glob("v0002-*.parquet")))
    assert set(rejected["reason"].to_pylist()) == {"dedup:repeated_record"} and rejected.num_rows == 5
