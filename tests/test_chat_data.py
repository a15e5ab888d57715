"""Post-training data readers: every accepted shape, bad rows counted and skipped,
Anthropic HH transcripts, Parquet input and the demo sets derived from a corpus."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from crawl2chat.stages.training.chat_data import (NoUsableRows, derive_demo_sets, load_preferences, load_prompts, load_sft,
                                         parse_hh)

HH = Path(__file__).resolve().parents[2] / "shared" / "data" / "preference" / "hh-rlhf" / "harmless-base_test.jsonl.gz"


def test_parse_hh_transcript():
    t = "\n\nHuman: hi there\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: fine, thanks"
    assert parse_hh(t) == [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
                           {"role": "user", "content": "how are you?"},
                           {"role": "assistant", "content": "fine, thanks"}]
    assert parse_hh("no turns here") is None


def test_preference_shapes_and_bad_rows(tmp_path):
    rows = [
        {"prompt": "q1", "chosen": "good", "rejected": "bad"},
        {"prompt": [{"role": "user", "content": "q2"}], "chosen": "a", "rejected": "b", "margin": 1.5},
        {"chosen": "\n\nHuman: q3\n\nAssistant: yes", "rejected": "\n\nHuman: q3\n\nAssistant: no"},
        {"chosen": "\n\nHuman: q4\n\nAssistant: x", "rejected": "\n\nHuman: other\n\nAssistant: y"},
        {"chosen": "\n\nHuman: q5\n\nAssistant: same", "rejected": "\n\nHuman: q5\n\nAssistant: same"},
        {"prompt": "q6", "chosen": "", "rejected": "b"},
        {"prompt": "q7", "chosen": "a", "rejected": "b", "margin": "big"},
        {"text": "no pair"},
    ]
    p = tmp_path / "prefs.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n[1, 2]\n{broken\n")
    pairs, skipped = load_preferences(p)
    assert [x["chosen"] for x in pairs] == ["good", "a", "yes"]
    assert pairs[1]["margin"] == 1.5 and pairs[0]["margin"] is None  # None: the reward model's setting applies
    assert pairs[2]["prompt"] == [{"role": "user", "content": "q3"}] and pairs[2]["rejected"] == "no"
    assert skipped == {"transcripts_diverge": 1, "identical_pair": 1, "empty_field": 1, "bad_margin": 1,
                       "unknown_format": 1, "bad_json": 2}


def test_parquet_input_and_nothing_usable(tmp_path):
    p = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"instruction": ["add", "sub", ""], "input": ["1 2", None, "x"],
                             "output": ["3", "-1", "y"]}), p)
    convs, skipped = load_sft(p)
    assert convs[1] == [{"role": "user", "content": "sub"}, {"role": "assistant", "content": "-1"}]
    assert len(convs) == 2 and skipped == {"empty_field": 1}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\nnot json\n')
    with pytest.raises(NoUsableRows, match="unknown_format"):
        load_sft(bad)


@pytest.mark.skipif(not HH.exists(), reason="shared HH-RLHF sample not present")
def test_anthropic_hh_sample():
    pairs, skipped = load_preferences(HH)
    with gzip.open(HH, "rt") as f:
        total = sum(1 for line in f if line.strip())
    assert len(pairs) + sum(skipped.values()) == total and len(pairs) > 0.9 * total
    for p in pairs[:200]:
        assert p["prompt"][0]["role"] == "user" and p["prompt"][-1]["role"] == "user"
        assert p["chosen"] != p["rejected"] and "\n\nHuman:" not in p["chosen"]
        roles = [m["role"] for m in p["prompt"]]
        assert all(a != b for a, b in zip(roles, roles[1:]))  # turns alternate
    prompts, _ = load_prompts(HH)  # the same file serves as PPO prompts
    assert len(prompts) >= len(pairs)


def test_demo_sets_from_corpus_are_deterministic(tmp_path):
    shards = tmp_path / "corpus" / "shards"
    shards.mkdir(parents=True)
    texts = [f"Page {i} talks about rivers. The river {i} flows north past the old mill. "
             f"Fish swim in it every spring. Children play on its banks." for i in range(40)]
    texts.append("short")
    pq.write_table(pa.table({"text": texts, "title": [f"River {i}" for i in range(41)],
                             "drop_reason": [None] * 40 + ["too_short"]}), shards / "part-0.parquet")
    a = derive_demo_sets(tmp_path / "corpus", tmp_path / "a", n=15)
    b = derive_demo_sets(tmp_path / "corpus", tmp_path / "b", n=15)
    for k in ("sft", "preference", "prompts"):
        assert Path(a[k]).read_text() == Path(b[k]).read_text() and Path(a[k]).read_text()
    convs, skipped = load_sft(a["sft"])
    assert len(convs) == 15 and not skipped
    prompts = [c[0]["content"] for c in convs]
    assert any(p.startswith("Continue: Page") for p in prompts) and any(p.startswith("Summarise the page") for p in prompts)
    pairs, skipped = load_preferences(a["preference"])
    assert pairs and not skipped and all(p["chosen"] != p["rejected"] for p in pairs)
    assert all(sorted(p["chosen"].split()) == sorted(p["rejected"].split()) or len(p["rejected"]) != len(p["chosen"])
               for p in pairs)
    ppo_prompts, _ = load_prompts(a["prompts"])
    assert len(ppo_prompts) == 15 and {m[0]["content"] for m in ppo_prompts}.isdisjoint(prompts)


def _reference_page(module: str, purpose: str, functions: dict[str, str], template: bool) -> str:
    """A documentation server page as extracted: heading, source path, purpose, signatures."""
    head = ["Python 3.11.7 [main]", "Module Index : Topics : Keywords"] if template else []
    lines = head + ["\xa0", f"{module}\xa0(version 1.0)\t\tindex", f"/usr/lib/python3.11/{module}.py"]
    lines += ["Module Reference"] if template else []
    lines += ["", purpose.replace(" ", "\xa0"), "\xa0"]
    for name, doc in functions.items():
        lines += [f"{name}(value, /)", doc.replace(" ", "\xa0")]
    return "\n".join(lines)


@pytest.mark.parametrize("template", [True, False])
def test_reference_questions_with_or_without_the_site_template(template):
    from crawl2chat.stages.training.chat_data import doc_examples

    text = _reference_page("heapq", "Heap queue algorithm (a.k.a. priority queue).",
                           {"heappush": "Push item onto heap, maintaining the heap invariant.",
                            "_private": "Not part of the documented interface at all."}, template)
    assert doc_examples(text, "http://127.0.0.1:8000/heapq.html") == [
        ("What is the heapq module for?", "Heap queue algorithm (a.k.a. priority queue)."),
        ("What does heapq.heappush() do?", "Push item onto heap, maintaining the heap invariant."),
    ]
    assert doc_examples(text, "http://127.0.0.1:8000/index.html") == []
    # A module without a docstring: the page lists the modules it imports where the
    # purpose would be; that is no answer to what the module is for.
    text = _reference_page("colorizer", "builtins\nkeyword\nre\ntime", {"color": "Colour the text of the editor."},
                           template)
    assert doc_examples(text, "http://127.0.0.1:8000/colorizer.html") == [
        ("What does colorizer.color() do?", "Colour the text of the editor.")]


def test_a_call_and_its_result_is_no_answer():
    """C functions' docstrings open with their call and result ("S.rfind(sub) -> int");
    the answer is what follows it, on that line or below, or there is no question."""
    from crawl2chat.stages.training.chat_data import doc_examples

    text = "\n".join([
        "mystr\xa0(version 1.0)\t\tindex", "(built-in)", "", "Strings\xa0for\xa0people\xa0and\xa0programs.", "",
        "rfind(...)", "S.rfind(sub[,\xa0start[,\xa0end]])\xa0->\xa0int", "",
        "Return\xa0the\xa0highest\xa0index\xa0in\xa0S\xa0where\xa0substring\xa0sub\xa0is\xa0found,",
        "clear(...)", "D.clear()\xa0->\xa0None.\xa0\xa0Remove\xa0all\xa0items\xa0from\xa0D.",
        "index(...)", "L.index(value)\xa0->\xa0integer\xa0--\xa0return\xa0first\xa0index\xa0of\xa0value.",
        "rindex(...)", "S.rindex(sub[,\xa0start[,\xa0end]])\xa0->\xa0int",
        "rjust(self, width, fillchar=' ', /)", "Return\xa0a\xa0right-justified\xa0string\xa0of\xa0length\xa0width.",
        "pack(format, v1)", "pack(format,\xa0v1,\xa0v2,\xa0...)\xa0->\xa0bytes",
    ])
    assert doc_examples(text, "http://127.0.0.1:8000/mystr.html") == [
        ("What is the mystr module for?", "Strings for people and programs."),
        ("What does mystr.rfind() do?", "Return the highest index in S where substring sub is found,"),
        ("What does mystr.clear() do?", "Remove all items from D."),
        ("What does mystr.index() do?", "Return first index of value."),
        ("What does mystr.rjust() do?", "Return a right-justified string of length width."),
    ]


def test_showcase_asks_reference_questions_about_pages_no_set_used(tmp_path):
    shards = tmp_path / "corpus" / "shards"
    shards.mkdir(parents=True)
    modules = [f"mod{i}" for i in range(30)]
    texts = [_reference_page(m, f"Tools number {i} for working with rivers and mills.",
                             {f"f{j}": f"Return the flow of river {i} at mill {j}." for j in range(3)}, False)
             for i, m in enumerate(modules)]
    texts += [f"Page {i} talks about rivers. The river {i} flows north past the old mill. Fish swim in it."
              for i in range(30)]
    urls = [f"http://127.0.0.1:8000/{m}.html" for m in modules] + [f"http://site.example/p{i}" for i in range(30)]
    ids = [f"doc-{i}" for i in range(60)]
    pq.write_table(pa.table({"id": ids, "url": urls, "text": texts, "drop_reason": [None] * 60}),
                   shards / "part-0.parquet")
    paths = derive_demo_sets(tmp_path / "corpus", tmp_path / "sets", n=10, by_weight=False)
    rows = [json.loads(line) for line in Path(paths["showcase"]).read_text().splitlines()]
    used = {json.loads(line)["source_id"] for k in ("sft", "preference", "prompts")
            for line in Path(paths[k]).read_text().splitlines()}
    assert len(rows) == 3 and len({r["source_id"] for r in rows}) == 3
    assert all(r["prompt"].endswith("module for?") and r["source_id"] not in used for r in rows)
    assert all(r["reference"].startswith("Tools number") for r in rows)
    # The questions every model is scored on: reference questions about unused pages, two a page at most.
    questions = [json.loads(line) for line in Path(paths["questions"]).read_text().splitlines()]
    pages = [q["source_id"] for q in questions]
    assert questions and all(q["source_id"] not in used for q in questions)
    assert max(pages.count(p) for p in pages) <= 2 and all(q["prompt"].startswith("What ") for q in questions)
    # Sets that ask for more examples than the corpus has still leave the kept pages' questions.
    paths = derive_demo_sets(tmp_path / "corpus", tmp_path / "all", n=500, by_weight=False)
    used = {json.loads(line)["source_id"] for k in ("sft", "preference", "prompts")
            for line in Path(paths[k]).read_text().splitlines()}
    questions = [json.loads(line) for line in Path(paths["questions"]).read_text().splitlines()]
    kept = {q["source_id"] for q in questions}
    assert kept and kept.isdisjoint(used) and len(used) + len(kept) == 60, (kept, len(used))
    assert json.loads(Path(paths["summary"]).read_text())["question_pages"] == len(kept)


def test_showcase_passes_over_test_modules(tmp_path):
    shards = tmp_path / "corpus" / "shards"
    shards.mkdir(parents=True)
    names = [f"pkg.tests.test_mod{i}" for i in range(20)] + [f"mod{i}" for i in range(20)]
    texts = [_reference_page(m, f"Tools number {i} for working with rivers and mills.",
                             {f"f{j}": f"Return the flow of river {i} at mill {j}." for j in range(2)}, False)
             for i, m in enumerate(names)]
    pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(40)], "url": [f"http://127.0.0.1:8000/{m}.html" for m in names],
                             "text": texts, "drop_reason": [None] * 40}), shards / "part-0.parquet")
    paths = derive_demo_sets(tmp_path / "corpus", tmp_path / "sets", n=5)
    rows = [json.loads(line) for line in Path(paths["showcase"]).read_text().splitlines()]
    assert len(rows) == 3 and not any("test" in r["prompt"] for r in rows), rows
