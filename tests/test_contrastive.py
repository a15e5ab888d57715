"""The contrastive stage: InfoNCE against a hand computation, the queue and momentum
encoder's arithmetic and their exact round trip through a checkpoint (JSON +
safetensors, never pickles); cluster pairs read from a data folder's quarantine; and a
real ``accelerate launch`` run that learns from near-duplicate clusters (held-out
retrieval well above the untrained encoder and chance), resumes exactly and saves a
folder ``AutoModel`` loads."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from crawl2chat.stages.training.contrastive import ContrastiveLoss, MomentumBank, info_nce, same_text
from crawl2chat.stages.training.trainer import read_metrics


def _tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32, max_position_embeddings=16, type_vocab_size=1),
                     add_pooling_layer=False)


def test_info_nce_equals_a_hand_computation():
    torch.manual_seed(1)
    q, k, queue = (F.normalize(torch.randn(n, 4), dim=-1) for n in (3, 3, 5))
    T = 0.05

    def by_hand(extra_for, weight=1.0):
        total = 0.0
        for i in range(3):
            pos = math.exp(float(q[i] @ k[i]) / T)
            den = sum(math.exp(float(q[i] @ k[j]) / T) for j in range(3))
            den += weight * sum(math.exp(float(q[i] @ n) / T) for n in extra_for(i))
            total += -math.log(pos / den)
        return total / 3

    assert info_nce(q, k, temperature=T).item() == pytest.approx(by_hand(lambda i: []), rel=1e-5)
    assert info_nce(q, k, queue, T).item() == pytest.approx(by_hand(lambda i: list(queue)), rel=1e-5)
    # Hard negatives: each query's 2 most similar queue rows only, each weighted 3x.
    top = lambda i: [queue[j] for j in (queue @ q[i]).topk(2).indices]  # noqa: E731
    assert info_nce(q, k, queue, T, hard_negatives=2, hard_negative_weight=3.0).item() == pytest.approx(
        by_hand(top, 3.0), rel=1e-5)
    # A query's own text is no negative: row 0 shares its text with key 1 and queue rows 0-1.
    text, queue_text = torch.tensor([7, 7, 9]), torch.tensor([7, 7, 3, 4, 5])
    kept = info_nce(q, k, queue, T, batch_exclude=same_text(text, text, 1),
                    queue_exclude=same_text(text, queue_text, 1))
    total = 0.0
    for i in range(3):
        others = [j for j in range(3) if j == i or text[j] != text[i]]
        den = sum(math.exp(float(q[i] @ k[j]) / T) for j in others)
        den += sum(math.exp(float(q[i] @ n) / T) for n, t in zip(queue, queue_text) if t != text[i])
        total += -math.log(math.exp(float(q[i] @ k[i]) / T) / den)
    assert kept.item() == pytest.approx(total / 3, rel=1e-5)
    # Windows: offsets closer than the window length overlap.
    assert same_text(torch.tensor([0, 100]), torch.tensor([61, 162, 150]), 62).tolist() == [
        [True, False, False], [True, False, True]]


def test_queue_is_a_ring_and_momentum_update_is_an_average():
    online = _tiny_bert()
    bank = MomentumBank(online, size=5, momentum=0.9, pooling="mean", device="cpu")
    old = [p.clone() for p in bank.encoder.parameters()]
    with torch.no_grad():
        for p in online.parameters():
            p.add_(1.0)
    bank.update(online)
    for o, m, p in zip(old, bank.encoder.parameters(), online.parameters()):
        assert torch.allclose(m, 0.9 * o + 0.1 * p, atol=1e-6)  # new = 0.9 old + 0.1 online
    assert bank.negatives() == (None, None)
    bank.enqueue(torch.ones(3, 16), torch.tensor([10, 11, 12]))
    bank.enqueue(2 * torch.ones(3, 16), torch.tensor([20, 21, 22]))  # wraps: rows 3, 4, then 0
    assert (bank.ptr, bank.filled) == (1, 5)
    assert bank.queue[:, 0].tolist() == [2, 1, 1, 2, 2] and bank.ids.tolist() == [22, 11, 12, 20, 21]
    bank.enqueue(torch.arange(7.0)[:, None].expand(7, 16), torch.arange(7))  # more than it holds: the newest 5
    assert bank.queue[:, 0].tolist() == [6, 2, 3, 4, 5] and bank.ptr == 1  # 2..6 written from row 1 on
    assert bank.ids.tolist() == [6, 2, 3, 4, 5]


def test_training_loss_enqueues_momentum_embeddings_and_sees_two_dropout_views():
    from crawl2chat.stages.training.settings import ContrastiveConfig

    online = _tiny_bert()
    online.config.hidden_dropout_prob = 0.1
    cfg = ContrastiveConfig(queue_size=8, micro_batch_size=4)
    bank = MomentumBank(online, 8, 0.9, "mean", "cpu")
    loss_fn = ContrastiveLoss(cfg, pad_id=0, bank=bank)
    ids, pos = torch.randint(1, 40, (4, 10)), torch.randint(1, 40, (4, 10))
    online.train()
    loss, n = loss_fn(online, {"input_ids": ids, "text_ids": torch.arange(4)})
    loss.backward()
    # The step's momentum embeddings wait for the step to end, then join the queue.
    assert n == 4 and math.isfinite(loss.item()) and bank.filled == 0 and len(bank.pending) == 1
    bank.flush()
    assert bank.filled == 4 and torch.allclose(bank.queue[:4], bank.encode(ids, torch.ones_like(ids)))
    # Cluster pairs: the positives (the kept documents) are what the queue keeps.
    loss, _ = loss_fn(online, {"input_ids": ids, "positive_ids": pos, "text_ids": torch.arange(4, 8)})
    loss.backward()
    bank.flush()
    assert torch.allclose(bank.queue[4:8], bank.encode(pos, torch.ones_like(pos)))
    assert bank.ids.tolist() == list(range(8))


def test_queue_and_momentum_encoder_survive_a_checkpoint_bitwise(tmp_path):
    from crawl2chat.stages.training.trainer import JsonStateAccelerator

    acc = JsonStateAccelerator(cpu=True)
    online = _tiny_bert()
    bank = MomentumBank(online, size=6, momentum=0.9, pooling="mean", device="cpu")
    with torch.no_grad():
        for p in online.parameters():
            p.mul_(1.5)
    bank.update(online)
    bank.enqueue(torch.randn(4, 16), torch.tensor([3, 1, 4, 1]))
    acc.register_for_checkpointing(bank)
    acc.save_state(str(tmp_path / "ckpt"), safe_serialization=True)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "custom_state_0.json" in names and "custom_state_0.safetensors" in names
    assert not any(n.endswith(".pkl") and n.startswith("custom") for n in names)
    saved_q, saved_enc = bank.queue.clone(), {k: v.clone() for k, v in bank.encoder.state_dict().items()}
    bank.enqueue(torch.randn(5, 16), torch.arange(5))  # the run goes on, then is "killed" and restarted
    bank.stage(torch.randn(2, 16), torch.arange(2))
    bank.update(_tiny_bert())
    acc.load_state(str(tmp_path / "ckpt"))
    assert (bank.ptr, bank.filled) == (4, 4) and torch.equal(bank.queue, saved_q) and bank.pending == []
    assert bank.ids.tolist() == [3, 1, 4, 1, 0, 0]
    assert all(torch.equal(v, saved_enc[k]) for k, v in bank.encoder.state_dict().items())


def test_settings_validate_queue_and_hard_negatives():
    from pydantic import ValidationError

    from crawl2chat.stages.training.settings import MAX_QUEUE, ContrastiveConfig

    c = ContrastiveConfig()
    assert (c.temperature, c.queue_size, c.momentum, c.pooling, c.positives) == (0.05, 65536, 0.9, "mean", "auto")
    with pytest.raises(ValidationError):
        ContrastiveConfig(queue_size=MAX_QUEUE + 1)
    with pytest.raises(ValidationError):
        ContrastiveConfig(queue_size=16, hard_negatives=32)


def test_positives_setting_is_obeyed_or_refused():
    from crawl2chat.stages.training.contrastive import choose_positives
    from crawl2chat.stages.training.settings import ContrastiveConfig

    cfg = ContrastiveConfig(micro_batch_size=16)
    assert choose_positives(cfg, 16) == "clusters" and choose_positives(cfg, 15) == "dropout"
    assert choose_positives(cfg.model_copy(update={"positives": "dropout"}), 500) == "dropout"
    with pytest.raises(ValueError, match="positives=clusters: the data has 3 training cluster pairs"):
        choose_positives(cfg.model_copy(update={"positives": "clusters"}), 3)


# ---------------------------------------------------------------- a data folder with near-duplicate clusters

CONTENT = ("river town market people walked along old stone bridge morning light fell across water boats carried "
           "fish bread wine farms valley children played gardens parents talked weather prices harvest news letters "
           "cities season brought travellers stories mountains forests roads winters shaped family field village "
           "mill school church doctor teacher baker smith horse cart road hill lake island ship harbour storm rain "
           "snow summer autumn spring king queen soldier castle tower garden library book letter song dance feast").split()
# Site furniture: every page opens with a line of it, different on each copy of an article.
BOILERPLATE = ("posted by admin editor staff share tweet print email subscribe comments reply login menu home about "
               "contact january february march april june monday tuesday friday updated read more related tags "
               "archive").split()


def write_cluster_data(out: Path, clusters: int = 160, singles: int = 40, seed: int = 0) -> None:
    """A committed data-stage version in the data stage's own layout: kept documents in a
    shard, and for each of ``clusters`` articles a syndicated copy (its own header line,
    three words changed) quarantined as ``dedup:near`` with ``dup_cluster`` naming the
    kept article. Shard and quarantine rows go through the data stage's own column
    mappings (``_with_shard_columns``, ``_rejected_rows``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from crawl2chat.stages.data import pipeline as steps
    from crawl2chat.stages.data.versions import content_digest, sha256_file

    rng = random.Random(seed)

    def article() -> str:
        return " ".join(" ".join(rng.choice(CONTENT) for _ in range(rng.randint(8, 14))).capitalize() + "."
                        for _ in range(25))

    def header() -> str:
        return " ".join(rng.choice(BOILERPLATE) for _ in range(18)) + ".\n"

    kept, copies = [], []
    for c in range(clusters):
        text = article()
        kept.append({"id": f"doc-{c:04d}", "text": header() + text, "dup_cluster": f"doc-{c:04d}"})
        words = text.split(" ")
        for _ in range(3):
            words[rng.randrange(len(words))] = rng.choice(CONTENT)
        copies.append({"id": f"copy-{c:04d}", "text": header() + " ".join(words), "dup_cluster": f"doc-{c:04d}",
                       "drop_reason": "dedup:near"})
    kept += [{"id": f"single-{s:04d}", "text": header() + article(), "dup_cluster": None} for s in range(singles)]

    def table(rows):
        return pa.table({"id": [r["id"] for r in rows], "url": [f"http://news.example.org/{r['id']}" for r in rows],
                         "text": [r["text"] for r in rows], "lang": ["en"] * len(rows),
                         "source": ["crawl.warc.gz"] * len(rows), "record_type": ["response"] * len(rows),
                         "drop_reason": pa.array([r.get("drop_reason") for r in rows], pa.string()),
                         "dup_cluster": pa.array([r["dup_cluster"] for r in rows], pa.string())})

    (out / "shards").mkdir(parents=True)
    (out / "rejected").mkdir()
    shard, quarantine = out / "shards" / "v0001-shard-00000.parquet", out / "rejected" / "v0001-rejected-00000.parquet"
    pq.write_table(steps._with_shard_columns(table(kept)), shard)
    pq.write_table(steps._rejected_rows(table(copies)), quarantine)
    # Another version's quarantine in the same folder: not the current version's, never read.
    pq.write_table(steps._rejected_rows(table([{**copies[0], "id": "stale", "dup_cluster": "doc-0001"}])),
                   out / "rejected" / "v0000-rejected-00000.parquet")
    shards = [{"path": f"shards/{shard.name}", "rows": len(kept), "bytes": shard.stat().st_size,
               "sha256": sha256_file(shard), "version": "v0001"}]
    (out / "manifest.json").write_text(json.dumps({
        "version": "v0001", "versions": ["v0001"], "shards": shards, "rejected": [f"rejected/{quarantine.name}"],
        "content_digest": content_digest(shards), "documents_kept": len(kept), "documents_dropped": len(copies),
        "drop_reasons": {"dedup:near": len(copies)}}))


@pytest.fixture(scope="module")
def cluster_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("contrastive") / "data"
    write_cluster_data(out)
    return out


def test_cluster_pairs_are_read_from_the_versions_quarantine(cluster_data):
    import pyarrow.parquet as pq

    from crawl2chat.stages.training.contrastive import cluster_pairs

    pairs = cluster_pairs(cluster_data)
    assert [p["cluster"] for p in pairs] == [f"doc-{c:04d}" for c in range(160)]
    kept = {r["id"]: r["text"] for r in pq.read_table(cluster_data / "shards", columns=["id", "text"]).to_pylist()}
    copies = {r["dup_cluster"]: r for r in pq.read_table(cluster_data / "rejected" / "v0001-rejected-00000.parquet",
                                                         columns=["id", "reason", "dup_cluster", "text"]).to_pylist()}
    for p in pairs:
        assert p["positive"] == kept[p["cluster"]] and p["query"] == copies[p["cluster"]]["text"] != p["positive"]
    assert copies["doc-0000"]["reason"] == "dedup:near"
    # The stale copy pointing at doc-0001 sits in a quarantine file the manifest does not list.
    assert pairs[1]["query"] == copies["doc-0001"]["text"]


def _steps(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "step"}


# Tiny encoder, 64-token rows, a constant learning rate after warmup (a resumed run's steps
# compare one for one with an uninterrupted run's), a small queue with hard negatives.
TINY = ["preset=tiny", "seq_len=64", "micro_batch_size=32", "lr=3e-3", "min_lr=3e-4", "warmup_steps=5",
        "schedule=constant", "eval_every=0", "eval_batches=4", "val_fraction=0.2", "vocab_size=400",
        "rollback.spike_factor=0", "queue_size=256", "hard_negatives=64", "checkpoint_every=35"]


@pytest.fixture(scope="module")
def trained(cluster_data, tmp_path_factory) -> Path:
    """40 steps of the stage under ``accelerate launch`` on the cluster data."""
    from crawl2chat.tasks.train import launch_training

    out = tmp_path_factory.mktemp("contrastive-run") / "contrastive"
    launch_training("contrastive", {"data": str(cluster_data)}, str(out), max_steps=40, overrides=TINY)
    return out


def test_learns_from_dedup_clusters(trained):
    m = json.loads((trained / "metrics.json").read_text())
    assert (m["positives"], m["retrieval_positives"], m["steps"]) == ("clusters", "dedup_clusters", 40)
    assert m["train_pairs"] + m["held_out_pairs"] == 160 and m["retrieval_pairs"] == m["held_out_pairs"] >= 20
    assert m["queue_filled"] == 256
    # Held-out clusters (copies and kept articles training never saw): at most half the
    # misses of the same encoder untrained, and far above a random ranking.
    assert 1 - m["retrieval_top1"] <= 0.5 * (1 - m["initial_retrieval_top1"]) and m["retrieval_top1"] >= 0.8, m
    assert m["retrieval_mrr"] >= m["initial_retrieval_mrr"] + 0.1 and m["retrieval_mrr"] > 5 * m["retrieval_chance_mrr"]
    assert m["retrieval_chance_top1"] == pytest.approx(1 / m["retrieval_pairs"])
    assert m["val_loss"] < m["initial_val_loss"] - 1.0


def test_saved_encoder_loads_as_automodel_and_ranks_as_recorded(trained, cluster_data):
    from transformers import AutoModel, AutoTokenizer

    from crawl2chat.stages.training.contrastive import PAIRS_FILE, Pairs, Retrieval
    from crawl2chat.stages.training.settings import ContrastiveConfig

    m = json.loads((trained / "metrics.json").read_text())
    model, tok = AutoModel.from_pretrained(trained / "model"), AutoTokenizer.from_pretrained(trained / "model")
    assert type(model).__name__ == "BertModel" and model.config.sentence_pooling == "mean"
    cfg = ContrastiveConfig(seq_len=64, val_fraction=0.2, retrieval_pairs=200)
    retrieval = Retrieval(tok, cluster_data, trained / "data", cfg, Pairs(trained / PAIRS_FILE, cfg, tok))
    assert retrieval(model) == pytest.approx({k: m[k] for k in ("retrieval_top1", "retrieval_mrr")}, abs=1e-6)


def test_resumes_exactly(trained, cluster_data):
    """A longer run on the same folder resumes from step 35's checkpoint and repeats steps
    36..40 exactly: same pairs, same dropout, same queue and momentum encoder."""
    from crawl2chat.tasks.train import launch_training

    first = _steps(trained)
    launch_training("contrastive", {"data": str(cluster_data)}, str(trained), max_steps=42, overrides=TINY)
    resumes = [r for r in read_metrics(trained / "metrics.jsonl") if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] == 35
    again = _steps(trained)
    assert json.loads((trained / "metrics.json").read_text())["steps"] == 42
    for s in range(36, 41):
        assert again[s]["loss"] == pytest.approx(first[s]["loss"], rel=1e-6, abs=1e-7), s


def test_settings_an_initial_encoder_decides_are_refused_beside_it():
    from pydantic import ValidationError

    from crawl2chat.stages.training.settings import ContrastiveConfig

    with pytest.raises(ValidationError, match="preset, vocab_size do\\(es\\) not apply with init_encoder"):
        ContrastiveConfig(init_encoder="runs/mlm/model", preset="cpu", vocab_size=300)
    assert ContrastiveConfig(init_encoder="runs/mlm/model").init_encoder == "runs/mlm/model"
