"""Export: serving files added, transformers reloads the copy with identical
logits, generate stops at the configured tokens, and int8 measured against fp32
(output close, speed and bits per byte reported side by side)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from crawl2chat.stages.inference.export import REPORT, export_model
from crawl2chat.stages.inference.generation import SERVING_FILE, Engine, init_model_dir, load_model


def corpus_text(n_lines: int = 800, seed: int = 0) -> str:
    words = "the king queen night day sword crown river stone bright dark speak answer gentle noble".split()
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(n_lines)) + "\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    (root / "corpus.txt").write_text(corpus_text())
    (root / "held.txt").write_text(corpus_text(60, seed=1))
    return init_model_dir(root / "model", root / "corpus.txt", preset="tiny", vocab_size=300, seq_len=128)


def test_export_adds_serving_files_and_reloads_identically(model_dir, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    out = tmp_path / "exported"
    report = export_model(model_dir, out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
                 "chat_template.jinja", SERVING_FILE, REPORT):
        assert (out / name).exists(), name
    assert report["reload"]["max_abs_logit_diff"] <= 1e-5 and report["reload"]["generate_ok"]
    tok = AutoTokenizer.from_pretrained(str(out))
    gc = GenerationConfig.from_pretrained(str(out))
    assert set(gc.eos_token_id) == {tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|end|>")}
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == (out / "chat_template.jinja").read_text()
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True) == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert json.loads((out / SERVING_FILE).read_text())["quantize"] == "none"


def test_export_int8_reports_side_by_side_and_serves_int8(model_dir, tmp_path):
    out = tmp_path / "int8"
    report = export_model(model_dir, out, quantize="int8", data=model_dir.parent / "held.txt")
    q = report["int8"]
    for side in ("fp32", "int8"):
        assert q[side]["decode_tokens_per_s"] > 0 and q[side]["prefill_ms"] > 0 and q[side]["bpb"] > 0
    assert abs(q["bpb_change"]) < 0.02 * q["fp32"]["bpb"]  # int8 costs at most 2% in bits per byte
    assert q["probe_kl"] < 1e-2 and q["probe_top1_agreement"] >= 0.8
    assert q["decode_speedup"] > 0 and q["prefill_speedup"] > 0
    engine = Engine(out)  # serving.json makes the exported folder load as int8
    assert engine.quantize == "int8"
    assert isinstance(engine.model.lm_head, torch.ao.nn.quantized.dynamic.Linear)


def test_load_model_rejects_unknown_quantisation(model_dir):
    with pytest.raises(ValueError, match="quantize"):
        load_model(model_dir, quantize="int4")


def test_export_command(model_dir, tmp_path):
    import typer
    from typer.testing import CliRunner

    from crawl2chat.serving_cli import register

    app = typer.Typer()
    register(app)
    out = tmp_path / "cli"
    r = CliRunner().invoke(app, ["export", "--model", str(model_dir), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "max |logit diff|" in r.output and (out / "generation_config.json").exists()
    bad = CliRunner().invoke(app, ["export", "--model", str(model_dir), "--out", str(out), "--quantize", "int4"])
    assert bad.exit_code == 2 and "int8" in bad.output


@pytest.mark.slow
def test_compile_is_kept_only_when_measured_faster(model_dir):
    from crawl2chat.stages.inference.export import measure_compile

    res = measure_compile(model_dir, new_tokens=8)
    assert res["eager"]["decode_tokens_per_s"] > 0
    if "error" not in res:
        assert res["kept"] == (res["decode_speedup"] >= 1.1)
    else:
        assert res["kept"] is False


def test_export_never_replaces_what_is_not_an_export(model_dir, tmp_path):
    import typer
    from typer.testing import CliRunner

    from crawl2chat.serving_cli import register

    app = typer.Typer()
    register(app)
    # A folder of the user's own files: refused, every file kept (an export used to put itself in its place).
    mine = tmp_path / "notes"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    r = CliRunner().invoke(app, ["export", "--model", str(model_dir), "--out", str(mine)])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1].startswith(f"error: --out: {mine} holds files that are not an earlier export")
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "sub").is_dir()
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "sub"]
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    r = CliRunner().invoke(app, ["export", "--model", str(model_dir), "--out", str(a_file)])
    assert r.exit_code == 2 and a_file.read_text() == "x", r.output
    r = CliRunner().invoke(app, ["export", "--model", str(model_dir), "--out", str(tmp_path / "e"),
                                 "--quantize", "int8", "--data", str(tmp_path / "nothere")])
    assert r.exit_code == 2 and "--data" in r.output and not (tmp_path / "e").exists(), r.output
    # An earlier export and an empty folder are replaced.
    out = tmp_path / "exported"
    assert CliRunner().invoke(app, ["export", "--model", str(model_dir), "--out", str(out)]).exit_code == 0
    assert CliRunner().invoke(app, ["export", "--model", str(model_dir), "--out", str(out)]).exit_code == 0
    (tmp_path / "empty").mkdir()
    assert CliRunner().invoke(app, ["export", "--model", str(model_dir), "--out", str(tmp_path / "empty")]).exit_code == 0


def test_an_export_killed_while_swapping_gets_the_previous_one_back(model_dir, tmp_path):
    # Killed between moving the previous export aside and putting the new one in place:
    # the next export used to delete the previous one as a leftover.
    out = tmp_path / "pub"
    export_model(model_dir, out)
    (out / REPORT).write_text(json.dumps({"previous": True}))  # tells the previous export apart
    out.rename(tmp_path / ".pub.tmp-old-99999")
    with pytest.raises(ValueError, match="int8"):  # a rerun that fails in its build
        export_model(model_dir, out, quantize="int4")
    assert json.loads((out / REPORT).read_text()) == {"previous": True}
    export_model(model_dir, out)
    assert "previous" not in json.loads((out / REPORT).read_text())
    assert not list(tmp_path.glob(".pub.tmp-*"))
    # Restored first, then replaced: what the rerun checks is an export, not a missing folder.
    (tmp_path / ".pub.tmp-old-99998").mkdir()
    (tmp_path / ".pub.tmp-old-99998" / "stray").write_text("x")
    export_model(model_dir, out)
    assert not list(tmp_path.glob(".pub.tmp-*")) and (out / "export_report.json").exists()


def test_exported_files_are_readable_as_new_files_are(model_dir, tmp_path):
    # safetensors writes its file owner-only (0600) whatever the umask; the export kept it so.
    import os
    import shutil

    from crawl2chat.stages.file_modes import umask_mode

    src = tmp_path / "src"
    shutil.copytree(model_dir, src)
    os.chmod(src / "model.safetensors", 0o600)
    out = tmp_path / "out"
    export_model(src, out)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert set(modes.values()) == {umask_mode()}, modes
