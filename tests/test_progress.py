"""Training progress: a line redrawn in place on a terminal, plain lines every so
often in logs, with step / total, loss, tokens/s and the time left; and the metrics
follower hands it the trainer's step rows from a real metrics.jsonl."""

from __future__ import annotations

import io
import json

from crawl2chat.infra.progress import StepProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def rows(n: int):
    return [{"type": "step", "step": s, "loss": 5.0 - 0.1 * s, "tokens_per_second": 7700.0} for s in range(1, n + 1)]


def test_plain_lines_in_logs_every_so_often_and_at_the_end():
    out = io.StringIO()
    p = StepProgress("pretrain", 10, stream=out, every=3.0)
    for i, row in enumerate(rows(10)):
        p(row, now=float(i))  # a step a second
    lines = out.getvalue().splitlines()
    assert [int(line.split()[2].split("/")[0]) for line in lines] == [1, 4, 7, 10]
    assert lines[1] == "[pretrain] step 4/10  [########............]  loss 4.600  7,700 tokens/s  6s left"
    assert "\r" not in out.getvalue()


def test_one_line_redrawn_on_a_terminal():
    out = Terminal()
    p = StepProgress("sft", 4, stream=out)
    for i, row in enumerate(rows(4)):
        p(row, now=float(i))
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("0s left\n") and text.count("\n") == 1
    assert "step 4/4  [####################]" in text


def test_the_follower_passes_step_rows_on(tmp_path):
    from crawl2chat.infra.training_records import MetricsFollower

    seen = []
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"type": "event", "event": "start", "step": 0}, *rows(3),
                                                       {"type": "eval", "step": 3, "val_loss": 4.0}]) + "\n")
    follower = MetricsFollower(path, "no-run", client=object(), on_step=seen.append)
    assert follower.read() > 0
    assert [r["step"] for r in seen] == [1, 2, 3]


def test_crawl_progress_counts_pages_with_their_rate():
    out = io.StringIO()
    p = StepProgress("data", 100, stream=out, every=10.0, unit="pages")
    for i in range(1, 51):
        p({"step": i, "megabytes": i * 0.05}, now=i * 0.5)  # two pages a second
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("[data] pages 41/100  [########............]")
    assert "2.0 MB" in line or "2.1 MB" in line
    assert "2.0 pages/s" in line and "30s left" in line
