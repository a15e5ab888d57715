"""What the data stage writes, training really uses: a pretraining run on a corpus of
about 90% English and 10% German tokens reads German at the share the balance
weights give, and says so; the held-out split it makes is the one every evaluation
and every later stage uses, and no evaluated document was trained on."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from crawl2chat.stages.data.balance import group_weights
from crawl2chat.stages.data.langid import predict_language
from crawl2chat.stages.data.settings import BalanceConfig
from crawl2chat.stages.data.versions import MANIFEST, content_digest, sha256_file, write_json_atomically
from crawl2chat.stages.training.heldout import SPLIT_FILE, held_out_rows, read_split
from crawl2chat.stages.training.pretrain import TokenWindows
from crawl2chat.stages.training.settings import PretrainConfig
from crawl2chat.tasks.train import launch_training

ENGLISH = [
    "The river runs past the old mill and into the valley.",
    "Every morning the baker opens his shop before sunrise.",
    "Children walk to school along the narrow country road.",
    "The library keeps thousands of books about local history.",
    "A strong wind blew across the harbour during the night.",
    "She planted tomatoes and beans in the garden behind the house.",
    "The train to the city leaves every hour from the main station.",
    "Farmers bring fresh vegetables to the market on Saturday.",
    "The museum shows paintings by artists from the region.",
    "Our neighbours repaired the roof after the heavy storm.",
    "The teacher explained how plants turn sunlight into food.",
    "Tourists climb the hill to see the castle at sunset.",
    "The doctor said that walking every day keeps the heart healthy.",
    "Snow covered the mountains long before winter began.",
    "The council will build a new bridge over the river next year.",
    "He reads the newspaper with a cup of coffee every morning.",
    "Bees visit the apple trees when the flowers open in spring.",
    "The old lighthouse still guides ships along the rocky coast.",
    "Students gathered in the hall to hear the visiting professor.",
    "The recipe needs flour, butter, sugar and two eggs.",
]
GERMAN = [
    "Der Fluss fließt an der alten Mühle vorbei ins Tal.",
    "Jeden Morgen öffnet der Bäcker seinen Laden vor Sonnenaufgang.",
    "Die Kinder gehen auf der schmalen Landstraße zur Schule.",
    "Die Bibliothek bewahrt tausende Bücher über die Geschichte der Stadt.",
    "In der Nacht wehte ein starker Wind über den Hafen.",
    "Sie pflanzte Tomaten und Bohnen im Garten hinter dem Haus.",
    "Der Zug in die Stadt fährt jede Stunde vom Hauptbahnhof ab.",
    "Am Samstag bringen die Bauern frisches Gemüse auf den Markt.",
    "Das Museum zeigt Gemälde von Künstlern aus der Gegend.",
    "Unsere Nachbarn haben das Dach nach dem schweren Sturm repariert.",
    "Die Lehrerin erklärte, wie Pflanzen aus Sonnenlicht Nahrung machen.",
    "Touristen steigen auf den Hügel, um die Burg bei Sonnenuntergang zu sehen.",
    "Der Arzt sagte, dass tägliches Spazierengehen das Herz gesund hält.",
    "Schnee bedeckte die Berge lange bevor der Winter begann.",
    "Die Gemeinde baut nächstes Jahr eine neue Brücke über den Fluss.",
]
STEPS = 80


def make_corpus(root: Path, n_english: int = 560, n_german: int = 38, seed: int = 0) -> dict:
    """A data-stage folder as the data stage writes it: one shard with ``id``, ``text``,
    ``lang`` (real language identification) and ``sample_weight`` from the balance
    weights of the default settings, and a committed ``manifest.json``."""
    rng = random.Random(seed)
    texts = [" ".join(rng.sample(ENGLISH, rng.randint(2, 4))) for _ in range(n_english)]
    texts += [" ".join(rng.sample(GERMAN, rng.randint(2, 4))) for _ in range(n_german)]
    rng.shuffle(texts)
    langs = [predict_language(t)[0] for t in texts]
    cfg = BalanceConfig()  # the data stage's defaults: by lang, alpha 0.7, beta 0.3, mode weight
    docs = Counter(langs)
    sizes = {g: float(sum(len(t.encode()) for t, lang in zip(texts, langs) if lang == g)) for g in docs}
    weights = group_weights(dict(docs), sizes, cfg.alpha, cfg.beta)
    ids = [f"page-{i:04d}" for i in range(len(texts))]
    shard = root / "shards" / "v0001-shard-00000.parquet"
    shard.parent.mkdir(parents=True)
    pq.write_table(pa.table({"id": ids, "text": texts, "lang": langs, "drop_reason": [None] * len(texts),
                             "sample_weight": [weights[g] for g in langs]}), shard)
    shards = [{"path": "shards/" + shard.name, "sha256": sha256_file(shard), "rows": len(texts)}]
    write_json_atomically(root / MANIFEST, {
        "version": "v0001", "versions": ["v0001"], "shards": shards, "content_digest": content_digest(shards),
        "documents_kept": len(texts), "balance_groups": {"docs": dict(docs), "sizes": sizes},
        "config": {"data": {"balance": cfg.model_dump(mode="json")}}})
    return {"ids": ids, "texts": texts, "langs": langs, "weights": weights}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chain")
    corpus = make_corpus(root / "data")
    out = root / "pretrain"
    overrides = ["preset=tiny", "vocab_size=400", "seq_len=64", "micro_batch_size=8", "lr=3e-3", "min_lr=3e-4",
                 "warmup_steps=5", "eval_every=0", "eval_batches=4", "checkpoint_every=0", "val_fraction=0.1"]
    launch_training("pretrain", {"data": str(root / "data")}, str(out), max_steps=STEPS, overrides=overrides)
    return {"root": root, "data": root / "data", "out": out, "corpus": corpus,
            "metrics": json.loads((out / "metrics.json").read_text())}


def token_share(run, lang: str, split: str = "train") -> float:
    docs = pq.read_table(run["out"] / "data" / "documents.parquet").to_pylist()
    tokens = Counter()
    for d in docs:
        if d["split"] == split:
            tokens[d["group"]] += d["tokens"]
    return tokens[lang] / sum(tokens.values())


def test_corpus_is_mostly_english_by_language_id(run):
    langs = Counter(run["corpus"]["langs"])
    assert set(langs) == {"en", "de"} and langs["de"] == 38
    assert 0.07 < token_share(run, "de") < 0.14  # about 10% German tokens


def test_pretraining_reads_german_at_the_share_the_weights_give(run):
    m = run["metrics"]
    assert m["sampling"] == "weighted" and m["steps"] == STEPS
    target, realised, natural = m["share.de.target"], m["share.de.realised"], m["share.de.natural"]
    print(f"German token share: natural {natural:.3f}, target {target:.3f}, realised {realised:.3f}")
    assert natural == pytest.approx(token_share(run, "de"))
    # The weights raise German well above its natural share, and training reads it at that share.
    assert target > 2 * natural
    assert abs(realised - target) / target < 0.10
    assert abs(m["share.en.realised"] - m["share.en.target"]) / m["share.en.target"] < 0.10
    # The data stage's weights are computed on bytes: in bytes, the target is its own p_g.
    w, langs, texts = run["corpus"]["weights"], run["corpus"]["langs"], run["corpus"]["texts"]
    de_bytes = sum(len(t.encode()) for t, g in zip(texts, langs) if g == "de")
    print(f"German byte share aimed at by the data stage: {w['de'] * de_bytes / sum(len(t.encode()) for t in texts):.3f}")


def test_uniform_setting_reads_the_natural_mixture(run):
    data = run["out"] / "data"
    base = dict(seq_len=64, micro_batch_size=8)
    uniform = TokenWindows(data, PretrainConfig(**base, sample_by_weight=False))
    weighted = TokenWindows(data, PretrainConfig(**base))
    assert (uniform.sampling, weighted.sampling) == ("uniform", "weighted")
    shares = uniform.shares(STEPS)
    assert abs(shares["share.de.realised"] - shares["share.de.natural"]) / shares["share.de.natural"] < 0.25
    assert shares["share.de.realised"] < 0.6 * shares["share.de.target"]
    # The realised share in the run's metrics is a replay of the batches it read.
    assert weighted.shares(STEPS)["share.de.realised"] == pytest.approx(run["metrics"]["share.de.realised"])


def test_weighted_batches_are_a_function_of_the_batch_index(run):
    data = run["out"] / "data"
    one = TokenWindows(data, PretrainConfig(seq_len=16, micro_batch_size=2, grad_accum=4))
    four = TokenWindows(data, PretrainConfig(seq_len=16, micro_batch_size=2, grad_accum=1))
    rows_one = torch.cat([one.batch(7, m, 0, 1)["tokens"] for m in range(4)])
    rows_four = torch.cat([four.batch(7, 0, r, 4)["tokens"] for r in range(4)])
    assert rows_one.shape == (8, 17) and torch.equal(rows_one, rows_four)
    again = TokenWindows(data, PretrainConfig(seq_len=16, micro_batch_size=2, grad_accum=4))
    assert torch.equal(again.batch(7, 2, 0, 1)["tokens"], one.batch(7, 2, 0, 1)["tokens"])
    assert not torch.equal(one.batch(8, 0, 0, 1)["tokens"], one.batch(7, 0, 0, 1)["tokens"])
    # Documents within a row are separated by end-of-text, as in packing.
    eos = json.loads((data / "index.json").read_text())["eos_id"]
    assert (rows_one == eos).any()


def test_one_held_out_split_for_every_evaluation_and_later_stage(run, tmp_path):
    from crawl2chat.stages.inference.evaluate import main as eval_main
    from crawl2chat.stages.training.chat_data import derive_demo_sets
    from crawl2chat.stages.training.stage import save_model
    from crawl2chat.tasks.train import evaluate_causal_lm

    m, model_dir = run["metrics"], run["out"] / "model"
    index = json.loads((run["out"] / "data" / "index.json").read_text())
    split = read_split(model_dir)
    # Decided once when pretraining packed, recorded with the packing, the model and the run.
    assert split is not None and split.name == index["split"]["name"] == m["split"] == "xxh64(id)<0.1"
    docs = pq.read_table(run["out"] / "data" / "documents.parquet").to_pylist()
    trained = {d["id"] for d in docs if d["split"] == "train"}
    held = {d["id"] for d in docs if d["split"] == "val"}
    assert trained and held and not trained & held and len(trained | held) == len(run["corpus"]["ids"])

    # crawl2chat eval --data: only the held-out documents, and the result names the split.
    out = tmp_path / "eval.json"
    eval_main(["--model", str(model_dir), "--data", str(run["data"]), "--out", str(out), "--mc-tasks", "0"])
    result = json.loads(out.read_text())
    assert result["split"] == split.name and result["lm"]["documents"] == len(held)
    rows, name = held_out_rows(split, run["data"])
    assert name == split.name and {r["id"] for r in rows} == held
    assert {r["id"] for r in rows}.isdisjoint(trained)  # no evaluated document was trained on
    everything = eval_main(["--model", str(model_dir), "--data", str(run["data"]), "--split", "all", "--mc-tasks", "0"])
    assert everything["split"] == "all" and everything["lm"]["documents"] == len(run["corpus"]["ids"])

    # A later stage's model carries the split on; its end-of-stage evaluation uses it.
    import transformers

    later = tmp_path / "sft" / "model"
    later.parent.mkdir()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    save_model(model, None, model_dir, later)
    assert json.loads((later / SPLIT_FILE).read_text()) == json.loads((model_dir / SPLIT_FILE).read_text())
    staged = evaluate_causal_lm(str(later), str(run["data"]), chat=True)
    assert staged["split"] == split.name and staged["lm"]["documents"] == min(200, len(held))

    # In MLflow, as the training task records a stage: the shares as metrics, the splits as tags.
    import mlflow

    from crawl2chat.infra.tracking import setup_tracking
    from crawl2chat.tasks.train import log_evaluation

    setup_tracking(tmp_path / "home", "chain-test")
    with mlflow.start_run() as active:
        mlflow.log_metrics({k: float(v) for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        log_evaluation(staged)
    recorded = mlflow.get_run(active.info.run_id).data
    assert recorded.tags["crawl2chat.eval_split"] == split.name and recorded.metrics["eval.lm.bpb"] > 0
    assert recorded.metrics["share.de.realised"] == pytest.approx(m["share.de.realised"])
    assert recorded.metrics["share.de.target"] == pytest.approx(m["share.de.target"])

    # Demo sets for SFT, reward and PPO come from training documents only, drawn by weight.
    paths = derive_demo_sets(run["data"], tmp_path / "demo", n=40, split=split)
    for kind in ("sft", "preference", "prompts"):
        sources = {json.loads(line)["source_id"] for line in Path(paths[kind]).read_text().splitlines()}
        assert sources and sources <= trained, kind
    summary = json.loads(Path(paths["summary"]).read_text())
    assert summary["split"] == split.name
    assert summary["share.de.target"] > 2 * 0.1 and summary["share.de.realised"] > 0.1


def test_tail_hold_out_is_listed_in_the_split(tmp_path):
    """A corpus too small for the hash to hold out any document: its last whole
    documents are held out, listed in the split, and evaluation reads exactly them."""
    from crawl2chat.stages.training.packing import is_validation, pack_shards
    from crawl2chat.stages.training.tokenizer import train_tokenizer

    texts = [" ".join(ENGLISH[i:i + 3]) for i in range(12)]
    ids = [f"doc-{i}" for i in range(len(texts))]
    assert not any(is_validation(i, 0.01) for i in ids)
    shards = tmp_path / "run" / "shards"
    shards.mkdir(parents=True)
    pq.write_table(pa.table({"id": ids, "text": texts}), shards / "part-00000.parquet")
    tok = train_tokenizer(tmp_path / "run", tmp_path / "tok", vocab_size=300)
    index = pack_shards(tmp_path / "run", tok, tmp_path / "packed", val_fraction=0.01, num_cpus=1)
    split = read_split(tmp_path / "packed")
    assert index["val"]["held_out_tail"] and split.tail_keys and split.name.endswith(f"+tail{len(split.tail_keys)}")
    docs = pq.read_table(tmp_path / "packed" / "documents.parquet").to_pylist()
    held = [d["id"] for d in docs if d["split"] == "val"]
    assert held == ids[-len(held):] and index["val"]["documents"] == len(held)
    rows, _ = held_out_rows(split, tmp_path / "run")
    assert [r["id"] for r in rows] == held
    assert index["val"]["bytes"] == sum(len(t.encode()) for t in texts[-len(held):])
    val = np.fromfile(tmp_path / "packed" / "val.bin", dtype=np.uint16)
    assert len(val) == index["val"]["tokens"] == sum(d["tokens"] for d in docs if d["split"] == "val")
