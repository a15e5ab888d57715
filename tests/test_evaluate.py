"""Evaluation on tiny models: bits per byte against a direct computation, sliding
windows scoring every token once, a briefly trained model beating a random one
on bpb and on the generated multiple-choice tasks, reward-model accuracy, the
policy win rate, and the command line."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from crawl2chat.stages.inference import evaluate as ev
from crawl2chat.stages.inference.generation import init_model_dir, load_model

CYCLE = "amber birch cedar dune ember fjord grove heath".split()


def cycle_docs(n: int, seed: int) -> list[str]:
    """Documents that walk a fixed cycle of words from random starts: the
    continuation of any passage is predictable, other passages' are not."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        start, length = rng.randrange(len(CYCLE)), rng.randint(20, 40)
        docs.append(" ".join(CYCLE[(start + i) % len(CYCLE)] for i in range(length)))
    return docs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(cycle_docs(300, seed=0)) + "\n")
    rand = init_model_dir(root / "random", corpus, vocab_size=300, seq_len=128)
    trained = root / "trained"
    shutil.copytree(rand, trained)
    model, tok = load_model(trained)
    ids = torch.tensor(tok(corpus.read_text(), add_special_tokens=False)["input_ids"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model gains nothing from more threads on a shared machine
    try:
        _train(model, opt, ids, g)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(trained, safe_serialization=True)
    return {"root": root, "random": rand, "trained": trained, "held_out": cycle_docs(40, seed=1)}


def _train(model, opt, ids, g, steps: int = 300) -> None:
    # Enough steps that the cycle is learnt whatever the CPU's float kernels (at 150 the model
    # sometimes still skips a word, depending on the machine's vector units), and a learning
    # rate falling to zero so that the last step lands in the minimum: at a constant 1e-2 the
    # model of step 300 repeated one word on an AVX2 machine (those of steps 250 and 350 did not).
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=g)
        batch = torch.stack([ids[s:s + 65] for s in starts])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()


def test_bpb_matches_direct_computation(models):
    model, tok = load_model(models["random"])
    texts = ["amber birch cedar", "déjà vu — vale willow"]
    res = ev.evaluate_lm((model, tok), texts)
    ids = [tok.eos_token_id]
    for t in texts:
        ids += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    x = torch.tensor([ids])
    with torch.no_grad():
        nats = F.cross_entropy(model(input_ids=x[:, :-1]).logits[0], x[0, 1:], reduction="sum").item()
    n_bytes = sum(len(t.encode()) for t in texts)
    assert res["bytes"] == n_bytes and res["tokens"] == len(ids) - 1
    assert res["bpb"] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(nats / (len(ids) - 1)), rel=1e-5)


def test_continuation_log_probabilities_in_one_padded_batch(models):
    model, tok = load_model(models["random"])
    rows = [tok("amber birch cedar dune", add_special_tokens=False)["input_ids"],
            tok("vale", add_special_tokens=False)["input_ids"] * 3]
    starts = [2, 1]
    got = ev.continuation_logprobs(model, rows, starts, tok.eos_token_id)
    for row, start, value in zip(rows, starts, got):  # each row alone, unpadded
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([row])).logits[0], -1)
        assert value == pytest.approx(sum(lp[t - 1, row[t]].item() for t in range(start, len(row))), rel=1e-5)
    # A row longer than the context keeps its last tokens: the scored continuation.
    limit = model.config.max_position_embeddings
    long = rows[0] * (limit // len(rows[0]) + 2)
    tail = long[-limit:]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([tail])).logits[0], -1)
    start = len(long) - 3
    want = sum(lp[t - 1, tail[t]].item() for t in range(limit - 3, limit))
    assert ev.continuation_logprobs(model, [long], [start], tok.eos_token_id)[0] == pytest.approx(want, rel=1e-5)


def test_sliding_windows_score_every_token_once(models):
    loaded = load_model(models["trained"])
    docs = models["held_out"][:6]
    # The model was trained on 64-token windows: positions beyond 64 are untrained.
    full = ev.evaluate_lm(loaded, docs, context=64, stride=64)
    for ctx, stride in [(32, 32), (32, 8), (64, 16)]:
        res = ev.evaluate_lm(loaded, docs, context=ctx, stride=stride, batch_size=3)
        assert res["tokens"] == full["tokens"] and res["bytes"] == full["bytes"]
        assert res["bpb"] == pytest.approx(full["bpb"], rel=0.5)


def test_trained_model_beats_random_on_bpb_and_multiple_choice(models, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": models["held_out"]}), shards / "part-0.parquet")
    trained = ev.evaluate_lm(models["trained"], tmp_path)  # a data-stage folder
    rand = ev.evaluate_lm(models["random"], tmp_path)
    assert trained["bpb"] < 0.5 * rand["bpb"] and trained["perplexity"] < rand["perplexity"]

    kw = dict(n=20, seed=0, context_words=10, ending_words=5)  # within the 64 trained positions
    tasks = ev.make_mc_tasks(models["held_out"], **kw)
    assert len(tasks) == 20 and tasks == ev.make_mc_tasks(models["held_out"], **kw)
    for t in tasks:
        assert len(t["choices"]) == 4 and len(set(t["choices"])) == 4 and 0 <= t["label"] < 4
    good = ev.multiple_choice_accuracy(models["trained"], tasks)
    bad = ev.multiple_choice_accuracy(models["random"], tasks)
    assert good["chance"] == 0.25 and good["n"] == 20
    assert good["acc"] >= 0.5 and good["acc"] > bad["acc"]  # chance is 0.25


def test_sample_generations_fixed_and_deterministic(models):
    a = ev.sample_generations(models["trained"], ["amber birch", "sage"], max_new_tokens=12)
    b = ev.sample_generations(models["trained"], ["amber birch", "sage"], max_new_tokens=12)
    assert a == b and [r["prompt"] for r in a] == ["amber birch", "sage"]
    assert all(1 <= r["tokens"] <= 12 for r in a)
    assert a[0]["completion"].split()[:2] == ["cedar", "dune"]  # the cycle was learnt
    chat = ev.sample_generations(models["trained"], chat=True, max_new_tokens=4)
    assert len(chat) == len(ev.DEFAULT_CHAT_PROMPTS)


def test_prompt_longer_than_the_context_keeps_its_end(models):
    """A question longer than the model's context (128 tokens here) is answered
    from its last tokens, leaving room for the answer, instead of failing."""
    long_prompt = " ".join(cycle_docs(12, seed=3)) + " amber birch"
    rows = ev.sample_generations(models["trained"], [long_prompt, "amber birch"], max_new_tokens=40)
    assert rows[0]["prompt_truncated"] and not rows[1]["prompt_truncated"]
    assert 1 <= rows[0]["tokens"] <= 40
    assert rows[0]["completion"].split()[:2] == ["cedar", "dune"]  # the end of the prompt was kept


def _tiny_reward_model(models, out: Path) -> Path:
    """A reward model trained for a few steps to prefer responses with 'good'."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models["random"]))
    rm = AutoModelForSequenceClassification.from_pretrained(str(models["random"]), num_labels=1)
    rm.config.pad_token_id = tok.pad_token_id
    opt = torch.optim.AdamW(rm.parameters(), lr=1e-2)
    for _ in range(20):
        texts = [ev._reward_text(tok, "say", "good good"), ev._reward_text(tok, "say", "bad bad")]
        scores = [rm(input_ids=tok(t, return_tensors="pt", add_special_tokens=False)["input_ids"]).logits[0, 0]
                  for t in texts]
        loss = -F.logsigmoid(scores[0] - scores[1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    rm.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def test_reward_accuracy_and_win_rate(models, tmp_path):
    rm_dir = _tiny_reward_model(models, tmp_path / "rm")
    pairs = [{"prompt": "say", "chosen": "good good", "rejected": "bad bad"},
             {"prompt": "say", "chosen": "good", "rejected": "bad"}]
    res = ev.reward_accuracy(rm_dir, pairs)
    assert res["accuracy"] == 1.0 and res["margin"] > 0 and res["n"] == 2
    flipped = ev.reward_accuracy(rm_dir, [{**p, "chosen": p["rejected"], "rejected": p["chosen"]} for p in pairs])
    assert flipped["accuracy"] == 0.0

    same = ev.win_rate(models["trained"], models["trained"], rm_dir, ["amber", "sage"], max_new_tokens=8)
    assert same["win_rate"] == 0.5 and same["kl"] == pytest.approx(0.0, abs=1e-6)
    other = ev.win_rate(models["trained"], models["random"], rm_dir, ["amber", "sage"], max_new_tokens=8)
    assert 0.0 <= other["win_rate"] <= 1.0 and other["kl"] > 0  # samples from the policy: KL estimate positive


def test_command_line_writes_json(models, tmp_path):
    data = tmp_path / "held.txt"
    data.write_text("\n".join(models["held_out"]))
    out = tmp_path / "eval.json"
    ev.main(["--model", str(models["trained"]), "--data", str(data), "--out", str(out), "--mc-tasks", "8"])
    res = json.loads(out.read_text())
    assert res["lm"]["bpb"] > 0 and res["mc"]["n"] == 8
    assert [g["prompt"] for g in res["generations"]] == ev.DEFAULT_PROMPTS
    # The closing summary of `crawl2chat run` reads these figures under the names runs record them.
    from crawl2chat.cli import _figures
    from crawl2chat.tasks.train import evaluation_metrics

    chain = {"pretrain": {"eval": evaluation_metrics(res), "unigram_bpb": 3.0}, "sft": {}, "reward": {}, "ppo": {}}
    base_line = _figures(chain)[2]
    assert f"bits per byte {res['lm']['bpb']:.3f}" in base_line
    assert f"{res['mc']['acc_norm']:.3f} per byte, {res['mc']['acc']:.3f} summed" in base_line
    assert f"chance {res['mc']['chance']:.3f}, 8 tasks" in base_line


def test_repetition_penalty_breaks_a_greedy_loop(models):
    """Greedy decoding of the cycle model repeats the 8-word cycle; with a penalty on
    tokens already said it picks what ``transformers``' own greedy ``generate`` with the
    same penalty picks (the penalty applied over the growing context, through the KV
    cache) and leaves the cycle; out-of-range values are refused."""
    from crawl2chat.stages.inference.generation import Engine, SamplingParams, stream_tokens

    engine = Engine(models["trained"])
    prompt = engine.prompt_ids("amber birch")
    plain = list(stream_tokens(engine.model, prompt, SamplingParams(max_new_tokens=40, temperature=0)))
    penalised = list(stream_tokens(engine.model, prompt, SamplingParams(max_new_tokens=40, temperature=0,
                                                                        repetition_penalty=2.0)))
    words = engine.tokenizer.decode(plain).split()
    assert words[:2] == ["cedar", "dune"] and len(words) > 10 and len(set(words)) <= len(CYCLE)
    with torch.inference_mode():
        reference = engine.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                          repetition_penalty=2.0, eos_token_id=None, pad_token_id=0)
    assert penalised == reference[0, len(prompt):].tolist()
    assert penalised != plain
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.5).validate()


def test_reference_questions_as_multiple_choice(models):
    """Each question's own answer among answers to other questions of its kind: a model
    that knows which answer follows which question picks it; the draw is fixed by the seed."""
    rows = []
    for i, word in enumerate(CYCLE):  # "what follows X" answered by the cycle after X
        walk = " ".join(CYCLE[(i + 1 + k) % len(CYCLE)] for k in range(6))
        rows.append({"prompt": f"What is the {word} module for?", "reference": walk})
    rows.append({"prompt": "What does amber.grow() do?", "reference": "birch cedar"})  # too few of its kind
    trained = ev.question_accuracy(models["trained"], rows)
    again = ev.question_accuracy(models["trained"], rows)
    rand = ev.question_accuracy(models["random"], rows)
    assert trained == again and trained["n"] == len(CYCLE) and trained["chance"] == 0.25
    assert 0.0 <= rand["acc_norm"] <= 1.0 and rand["n"] == trained["n"]
    assert ev.question_kind("What does x.f() do?") == "function" and ev.question_kind("Continue: a") == "other"


def test_a_rerun_with_the_same_models_reads_the_questions_and_showcase_kept(models, tmp_path):
    """The pipeline's closing evaluations are kept beside the questions, keyed by the model
    folders and the questions' content: a rerun whose stages were all reused reads them
    (no generation, no new MLflow run); another model, or other questions, is evaluated."""
    import json
    import shutil

    import mlflow

    from crawl2chat.infra.tracking import setup_tracking
    from crawl2chat.tasks.train import questions_task, showcase_task

    rows = [{"prompt": f"What is the {w} module for?",
             "reference": " ".join(CYCLE[(i + 1 + k) % len(CYCLE)] for k in range(6))} for i, w in enumerate(CYCLE)]
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    setup_tracking(tmp_path / "home", "kept-evaluations")
    try:
        chain = {"base": str(models["trained"])}
        first = questions_task.fn(chain, str(questions)), showcase_task.fn(chain, str(questions), max_new_tokens=4)
        runs = len(mlflow.search_runs(output_format="list"))
        assert (questions_task.fn(chain, str(questions)), showcase_task.fn(chain, str(questions), max_new_tokens=4)) \
            == first
        assert len(mlflow.search_runs(output_format="list")) == runs == 2
        other = tmp_path / "other-model"
        shutil.copytree(models["random"], other)
        assert first[0]["base"]["n"] == len(CYCLE)
        questions_task.fn({"base": str(other)}, str(questions))
        assert len(mlflow.search_runs(output_format="list")) == 3
    finally:
        mlflow.set_tracking_uri(None)


def test_eval_command_refuses_bad_input_before_any_work(models, tmp_path):
    # Each used to end in a traceback (FileNotFoundError, ZeroDivisionError, and IsADirectoryError
    # only once the whole evaluation had run).
    import typer
    from typer.testing import CliRunner

    from crawl2chat.serving_cli import register

    app = typer.Typer()
    register(app)
    data = tmp_path / "held.txt"
    data.write_text("\n".join(models["held_out"]))
    model = str(models["trained"])
    for extra, named in ((["--data", str(tmp_path / "nothere")], "--data"),
                         (["--data", str(data), "--max-tokens", "0", "--mc-tasks", "0"], "--max-tokens"),
                         (["--data", str(data), "--mc-tasks", "-1"], "--mc-tasks"),
                         (["--data", str(data), "--out", str(tmp_path)], "--out"),
                         (["--parent", model, "--prompts", str(tmp_path / "none.jsonl")], "--prompts")):
        r = CliRunner().invoke(app, ["eval", "--model", model, *extra])
        assert r.exit_code == 2, (extra, r.output)
        assert r.output.strip().splitlines()[-1].startswith(f"error: {named}"), (extra, r.output)
