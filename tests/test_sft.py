"""SFT: assistant-only labels, packing, and a real ``accelerate launch`` run whose loss falls.

Also home of :func:`tiny_base`, the tiny random-weight base model (with the
project tokenizer and chat template) the post-training tests start from."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from crawl2chat.stages.training.chat_data import IGNORE_INDEX, encode_sft
from crawl2chat.stages.training.sft import build_sft_rows, pack_examples, sft_loss
from crawl2chat.stages.training.settings import SFTConfig
from crawl2chat.tasks.train import launch_training
from crawl2chat.stages.training.trainer import read_metrics

GOOD = "sun bright warm gold light day clear sky".split()
BAD = "rain dark cold grey night storm mud fog".split()
TOPICS = "river city garden mountain harbour forest market bridge".split()


def corpus_lines(n: int = 3000, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocab = GOOD + BAD + TOPICS + "tell me about the a of and is was it what describe continue".split()
    return "\n".join(" ".join(rng.choice(vocab) for _ in range(rng.randint(4, 12))) for _ in range(n)) + "\n"


def tiny_base(root: Path, vocab_size: int = 400, seq_len: int = 128) -> Path:
    """A tokenizer trained on a small corpus and a random 'tiny' Llama saved as a HF model folder."""
    from crawl2chat.stages.training.models import build_model, model_config
    from crawl2chat.stages.training.stage import save_model
    from crawl2chat.stages.training.tokenizer import train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_lines())
    tok_dir = train_tokenizer(corpus, root / "tokenizer", vocab_size=vocab_size)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    model = build_model(model_config("tiny", vocab_size=len(tok), seq_len=seq_len, pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id))
    save_model(model, model.state_dict(), tok_dir, root / "base")
    return root / "base"


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_rows(n: int = 200, seed: int = 0) -> list[dict]:
    """'tell me about the X' -> 'the X is sun bright warm' : a rule a tiny model learns in seconds."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        t = rng.choice(TOPICS)
        rows.append({"prompt": f"tell me about the {t} {i % 7}", "response": f"the {t} is " + " ".join(GOOD[:4])})
    return rows


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory.mktemp("sft"))


def test_prompt_tokens_are_masked(base):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about the river"},
            {"role": "assistant", "content": "the river is clear"}, {"role": "user", "content": "and the sky"},
            {"role": "assistant", "content": "bright"}]
    ids, labels = encode_sft(tok, msgs, max_len=512)
    assert len(ids) == len(labels)
    # The token sequence is exactly the chat template's rendering.
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    labelled = [i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX]
    assert all(lab in (IGNORE_INDEX, i) for i, lab in zip(ids, labels))
    assert tok.decode(labelled) == "the river is clear<|end|>\nbright<|end|>\n"
    # No system/user text and no role headers are labelled.
    unlabelled = tok.decode([i for i, lab in zip(ids, labels) if lab == IGNORE_INDEX])
    assert "be brief" in unlabelled and "tell me about the river" in unlabelled and "<|assistant|>" in unlabelled
    # The loss ignores masked positions: changing a prompt label target changes nothing.
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(base)
    batch = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])}
    loss, n = sft_loss(model, batch)
    assert n == len(labelled)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[0, :-1]
    tgt = torch.tensor(labels[1:])
    keep = tgt != IGNORE_INDEX
    manual = torch.nn.functional.cross_entropy(logits[keep], tgt[keep])
    assert loss.item() == pytest.approx(manual.item(), rel=1e-5)


def test_packing_keeps_examples_whole():
    examples = [([i] * n, [i] * n) for i, n in enumerate([5, 3, 7, 2, 6, 1], start=1)]
    ids, labels = pack_examples(examples, seq_len=8, pad_id=0, pack=True, seed=0)
    assert ids.shape[1] == 8 and ids.shape[0] <= 4  # 24 tokens in 8-token rows, first fit
    for i, n in enumerate([5, 3, 7, 2, 6, 1], start=1):
        hits = (ids == i).nonzero()
        assert len(hits) == n and hits[:, 0].unique().numel() == 1  # never split across rows
    assert ((labels == IGNORE_INDEX) == (ids == 0)).all()
    unpacked, _ = pack_examples(examples, seq_len=8, pad_id=0, pack=False, seed=0)
    assert unpacked.shape == (6, 8)


def test_bad_rows_are_counted(base, tmp_path):
    from transformers import AutoTokenizer

    from crawl2chat.stages.training.chat_data import load_sft

    p = tmp_path / "mixed.jsonl"
    p.write_text("\n".join([json.dumps(r) for r in sft_rows(3)] + [
        "{not json", json.dumps({"foo": 1}), json.dumps({"prompt": "x", "response": ""}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"instruction": "add", "input": "1 and 2", "output": "3"}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})]))
    convs, skipped = load_sft(p)
    assert len(convs) == 5
    assert skipped == {"bad_json": 1, "unknown_format": 1, "empty_field": 1, "no_assistant_turn": 1}
    assert convs[3][0]["content"] == "add\n\n1 and 2"
    tok = AutoTokenizer.from_pretrained(base)
    data = build_sft_rows(tok, convs + [[{"role": "user", "content": "the " * 300},
                                         {"role": "assistant", "content": "x"}]], SFTConfig(seq_len=64))
    assert data["skipped"] == {"no_assistant_tokens_within_seq_len": 1}


def test_sft_under_accelerate_learns_and_resumes(base, tmp_path):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows())
    out = tmp_path / "run"
    sets = ["seq_len=128", "micro_batch_size=4", "lr=3e-3", "min_lr=3e-4", "warmup_steps=3", "eval_every=0",
            "checkpoint_every=15", "val_fraction=0.1", "eval_batches=4"]
    launch_training("sft", {"base": str(base), "data": str(data)}, str(out), max_steps=30, overrides=sets)
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 30 and m["base"] == str(base.resolve()) and m["data"] == str(data.resolve())
    assert m["held_out"] > 0 and m["rows"] < m["examples"]  # packed: several conversations per row
    log = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "step"}
    first, last = np.mean([log[s]["loss"] for s in range(1, 4)]), np.mean([log[s]["loss"] for s in range(26, 31)])
    assert last < 0.5 * first, (first, last)
    assert m["val_loss"] < 0.5 * first
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(out / "model"), AutoTokenizer.from_pretrained(out / "model")
    assert tok.chat_template  # the tokenizer (with its template) ships with the model
    prompt = tok.apply_chat_template([{"role": "user", "content": "tell me about the river 1"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    gen = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "sun bright" in tok.decode(gen[0, prompt["input_ids"].shape[1]:])
    # A longer run on the same folder resumes from the newest checkpoint (step 15).
    launch_training("sft", {"base": str(base), "data": str(data)}, str(out), max_steps=36, overrides=sets)
    events = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "resume"]
    assert events and events[-1]["step"] == 15
    assert json.loads((out / "metrics.json").read_text())["steps"] == 36


def test_unusable_data_fails_once_with_one_sentence_and_status_2(base, tmp_path):
    """Bad input is a user error: the script reports its kind (OUT/failure.json), the
    Prefect task does not retry it, and the command ends in one plain sentence, exit 2."""
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n" + json.dumps({"foo": 1}) + "\n")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "crawl2chat.cli", "sft", "--base", str(base), "--data", str(bad), "--out", str(out),
         "--max-steps", "2", "--set", f"home={tmp_path / 'home'}"],
        capture_output=True, text=True, timeout=600,
        env={**{k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS")},
             "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: sft: ") and "no usable rows" in last and "train.log" in last, last
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["kind"] == "bad_input"
    # One attempt only (no retry of a user error); the full trace is in train.log.
    assert "AwaitingRetry" not in proc.stdout + proc.stderr
    log = (run_dir / "train.log").read_text()
    assert {line for line in log.splitlines() if line.startswith("error: ")} == {f"error: {failure['message']}"}
    assert "Traceback" in log and "Traceback" not in proc.stdout + proc.stderr  # the trace in the log only


def test_a_damaged_or_wrong_input_model_is_refused_before_training(base, tmp_path):
    """An input model folder is checked as the stage checks its own: a weights file changed
    since it was written, a folder that is no model, a causal LM given as a reward model.
    The command ends at once in one sentence naming the file or folder, exit 2."""
    import shutil
    import subprocess
    import sys

    from crawl2chat.stages.training.models import model_folder_problem

    damaged = tmp_path / "damaged"
    shutil.copytree(base, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    assert model_folder_problem(base) is None
    assert model_folder_problem(damaged) == f"{weights} has 3000 bytes, {(base / 'model.safetensors').stat().st_size} were written"
    assert model_folder_problem(tmp_path) == f"{tmp_path} is not a model folder (no config.json)"
    assert "is not a reward model (its architecture is LlamaForCausalLM" in model_folder_problem(base, "reward")
    # An encoder where a causal LM is needed (eval, export, serve, chat, a distillation teacher),
    # and the other way round (contrastive learning's init_encoder).
    encoder = tmp_path / "encoder"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    assert model_folder_problem(encoder) == (
        f"{encoder} is not a causal language model (its architecture is BertForMaskedLM; crawl2chat pretrain, "
        "sft, ppo, dpo and distill train one)")
    assert model_folder_problem(encoder, "encoder") is None
    assert "is not a BERT encoder (its architecture is LlamaForCausalLM" in model_folder_problem(base, "encoder")
    for command in (["eval"], ["export", "--out", str(tmp_path / "exported")], ["chat"]):
        refused = subprocess.run([sys.executable, "-m", "crawl2chat.cli", *command, "--model", str(encoder)],
                                 capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        assert refused.returncode == 2, (command, refused.stderr[-2000:])
        assert refused.stderr.strip().splitlines()[-1] == f"error: --model: {model_folder_problem(encoder)}"

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "crawl2chat.cli", "sft", "--base", str(damaged), "--data", str(data),
         "--out", str(tmp_path / "run"), "--max-steps", "2", "--set", f"home={tmp_path / 'home'}"],
        capture_output=True, text=True, timeout=600,
        env={**{k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "RAY_ADDRESS")},
             "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: sft: --base: {weights} has 3000 bytes"), last
    assert "Traceback" not in proc.stdout + proc.stderr and not (tmp_path / "run").exists()


def test_a_set_with_few_distinct_rows_holds_out_a_tail_and_never_reports_nan(base, tmp_path):
    """Three distinct conversations, each ten times: the 2% hash split holds none out, so the
    last distinct one in hash order is held out; one distinct conversation cannot be split,
    and the run says it has no held-out set instead of reporting a NaN."""
    from crawl2chat.stages.training import sft
    from crawl2chat.stages.training.registry import STAGES

    sets = [x for s in ("seq_len=64", "micro_batch_size=2", "warmup_steps=1", "checkpoint_every=0",
                        "eval_every=1", "val_fraction=0.02") for x in ("--set", s)]
    few = write_jsonl(tmp_path / "few.jsonl", sft_rows(3) * 10)
    m = sft.main(["--base", str(base), "--data", str(few), "--out", str(tmp_path / "few"), "--max-steps", "2", *sets])
    assert m["held_out_rule"] == "hash_tail" and m["held_out"] == 10 and m["examples"] == 20
    assert np.isfinite(m["val_loss"])
    one = write_jsonl(tmp_path / "one.jsonl", sft_rows(1) * 10)
    m = sft.main(["--base", str(base), "--data", str(one), "--out", str(tmp_path / "one"), "--max-steps", "2", *sets])
    assert m["held_out_rule"] == "none" and m["held_out"] == 0 and "val_loss" not in m
    assert STAGES["sft"].report(m) == "2 steps, no held-out set"
    for run in ("few", "one"):
        for name in ("metrics.json", "metrics.jsonl"):
            assert "nan" not in (tmp_path / run / name).read_text().lower(), (run, name)
