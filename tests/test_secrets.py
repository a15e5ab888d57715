"""Credentials never reach a record: MLflow params and artifacts, dataset manifests,
run folders' saved settings. Ordinary settings whose names merely contain
"token" or "key" stay readable."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from crawl2chat.stages.secrets import is_secret_key, mask_secrets

URI_PASSWORD = "Sup3rS3cretPw"
API_KEY = "k3yValueThatMustNotLeak"
HF = "hf_" + "Ab3" * 12
AWS = "AKIA" + "QWERTYUIOPASDFGH"
QUERY_TOKEN = "qTok3nValue99"


def test_values_are_masked_by_pattern_and_names_by_whole_words():
    tree = {
        "tracking": {"uri": f"http://alice:{URI_PASSWORD}@127.0.0.1:5000"},
        "db": f"postgresql+psycopg2://u:{URI_PASSWORD}@postgres:5432/mlflow",
        "seeds": [f"https://example.org/feed?token={QUERY_TOKEN}&page=2", "http://127.0.0.1:8080/a?b=c"],
        "header": "Authorization: Bearer abcdefghijklmnopqrstuvwxyz0123",
        "keys": f"{AWS} {HF}",
        "api_key": API_KEY, "hf_token": "anything", "db_password": 12345, "token": None,
        "max_new_tokens": 24, "tokenizer": "runs/tok", "tokenizer_type": "bpe", "pad_token_id": 0,
        "digest": "sha256:" + "ab" * 32, "partition": "s3://bucket/key=1/x",
    }
    masked = mask_secrets(tree)
    text = repr(masked)
    for secret in (URI_PASSWORD, API_KEY, HF, AWS, QUERY_TOKEN, "abcdefghijklmnopqrstuvwxyz0123", "12345", "anything"):
        assert secret not in text, secret
    assert masked["tracking"]["uri"] == "http://alice:***@127.0.0.1:5000"
    assert masked["seeds"] == ["https://example.org/feed?token=***&page=2", "http://127.0.0.1:8080/a?b=c"]
    assert masked["token"] is None  # nothing to hide
    for key in ("max_new_tokens", "tokenizer", "tokenizer_type", "pad_token_id", "digest", "partition"):
        assert masked[key] == tree[key], key
    assert not any(is_secret_key(k) for k in ("max_new_tokens", "tokenizer", "eos_token", "key", "ppo.train.max_new_tokens"))
    assert all(is_secret_key(k) for k in ("password", "api_key", "apiKey", "secret", "token", "RAY_AUTH_TOKEN",
                                           "tracking.db_password", "client_secret"))


def _grep_tree(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_no_record_holds_a_credential(ray_local, tmp_path):
    """A config with a URI password, a query token and an API key goes through a real
    MLflow store (SQLite and artifacts under tmp), a real dataset-version commit and a
    training run folder's saved settings; the secret bytes are found in none of them."""
    import mlflow

    from crawl2chat.infra.run_folders import run_folder
    from crawl2chat.infra.tracking import pipeline_run, setup_tracking
    from crawl2chat.stages.data.pipeline import SHARD_COLUMNS, StepResult
    from crawl2chat.stages.settings import load_config
    from crawl2chat.stages.training.settings import PPOConfig
    from crawl2chat.stages.training.stage import write_settings
    from crawl2chat.tasks.data import write_task

    home = tmp_path / "home"
    setup_tracking(home, "secrets")
    cfg = load_config(overrides={
        "tracking.uri": f"http://alice:{URI_PASSWORD}@127.0.0.1:5999",
        "data.seed_urls": [f"https://bob:{URI_PASSWORD}@example.org/?token={QUERY_TOKEN}"],
    })
    config = {**cfg.model_dump(mode="json"), "serve": {"api_key": API_KEY}}
    out = tmp_path / "data"
    balanced = tmp_path / "work" / "balance"  # the last step's folder: two kept documents
    balanced.mkdir(parents=True)
    docs = [{c: None for c in SHARD_COLUMNS} | {"id": str(i), "url": f"https://example.org/{i}", "text": "words " * 50,
                                                  "lang": "en", "source": "a.warc.gz", "sample_weight": 1.0}
            for i in range(2)]
    table = pa.Table.from_pylist(docs).append_column("drop_reason", pa.nulls(2, pa.string()))
    pq.write_table(table, balanced / "part-0.parquet")
    last = StepResult("balance", str(balanced), "fp", rows_in=2, kept=2, bytes_in=600)
    with pipeline_run("data", {"config": config}) as run:
        manifest = write_task.fn([last], str(out), 1 << 20, config)
    assert manifest["config"]["tracking"]["uri"] == "http://alice:***@127.0.0.1:5999"
    assert manifest["config"]["ppo"]["train"]["max_new_tokens"] == cfg.ppo.train.max_new_tokens

    ppo = PPOConfig(max_new_tokens=31)
    train_dir = tmp_path / "ppo"
    train_dir.mkdir()
    write_settings(ppo, train_dir)
    run_folder(tmp_path / "runs", "ppo", {"policy": "p"}, {"policy": "x"},
               {**ppo.model_dump(mode="json"), "hub_token": HF})

    params = mlflow.get_run(run.info.run_id).data.params
    assert params["config.ppo.train.max_new_tokens"] == str(cfg.ppo.train.max_new_tokens)
    assert params["config.tracking.uri"] == "http://alice:***@127.0.0.1:5999"
    assert params["config.serve.api_key"] == "***"
    saved = yaml.safe_load((train_dir / "config.yaml").read_text())
    assert saved["max_new_tokens"] == 31

    assert (home / "mlflow.db").stat().st_size and any((home / "mlartifacts").rglob("manifest.json"))
    for secret in (URI_PASSWORD, API_KEY, QUERY_TOKEN, HF):
        for root in (home, out, train_dir, tmp_path / "runs"):
            assert not _grep_tree(root, secret.encode()), (secret, _grep_tree(root, secret.encode()))
    assert b"max_new_tokens" in (home / "mlflow.db").read_bytes()
