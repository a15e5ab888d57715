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
    follower = MetricsFollower(path, "no-run", client=object(), on_step=seen.append)
    path.write_text("\n".join(json.dumps(r) for r in [{"type": "event", "event": "start", "step": 0}, *rows(3),
                                                       {"type": "eval", "step": 3, "val_loss": 4.0}]) + "\n")
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


def test_data_step_lines_in_logs_keep_the_rate_of_the_counted_part():
    """A data step's documents: a line at the start, one when every document is counted
    (with the rate up to then, not diluted by the clustering that follows), none repeated."""
    out = io.StringIO()
    p = StepProgress("data", 40, stream=out, every=30.0, unit="documents", label="dedup")
    p({"step": 0}, now=0.0)
    for t, n in ((1.0, 10), (2.0, 20), (4.0, 40), (5.0, 40), (9.0, 40)):
        p({"step": n, "note": "grouping" if n == 40 else None}, now=t)
    p.finish({"step": 40}, now=10.0)
    assert out.getvalue().splitlines() == [
        "[data] dedup    documents 0/40  [....................]",
        "[data] dedup    documents 40/40  [####################]  10.0 documents/s  0s left  grouping",
    ]


def test_finish_writes_the_final_count_of_work_without_a_total():
    out = io.StringIO()
    p = StepProgress("data", None, stream=out, unit="documents", label="extract")
    p({"step": 0, "note": "0/3 files"}, now=0.0)
    p({"step": 25, "note": "2/3 files"}, now=2.0)  # within `every` of the first line: not written
    p.finish({"step": 42, "note": "3/3 files"}, now=4.0)
    p.finish({"step": 42}, now=5.0)  # a second finish writes nothing
    assert out.getvalue().splitlines() == ["[data] extract  documents 0  0/3 files",
                                           "[data] extract  documents 42  10.5 documents/s  3/3 files"]


def test_finish_on_a_terminal_ends_the_redrawn_line_once():
    out = Terminal()
    p = StepProgress("data", 10, stream=out, unit="documents", label="langid")
    p({"step": 0}, now=0.0)
    p({"step": 5}, now=1.0)
    p.finish({"step": 10}, now=2.0)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("documents 10/10  [####################]  5.0 documents/s  0s left\n")
    p2 = StepProgress("data", 10, stream=Terminal(), unit="documents")
    p2.finish({"step": 10})  # no update came: nothing to end
    assert p2.stream.getvalue() == ""


def test_a_terminal_line_is_ended_once_whatever_follows():
    """Counts that stop at the total while the step still works (dedup's clustering), and a
    finish after a redrawn line without a total: each line ends once, nothing is drawn twice."""
    out = Terminal()
    p = StepProgress("data", 3, stream=out, unit="documents", label="dedup")
    for t, n in enumerate((0, 3, 3, 3)):
        p({"step": n}, now=float(t))
    p.finish({"step": 3}, now=5.0)
    assert out.getvalue().count("\n") == 1 and out.getvalue().count("documents 3/3") == 1
    out = Terminal()
    p = StepProgress("data", None, stream=out, unit="documents", label="extract")
    p({"step": 0}, now=0.0)
    p({"step": 42}, now=1.0)
    p.finish({"step": 42}, now=2.0)
    assert out.getvalue().count("\n") == 1 and out.getvalue().endswith("documents 42  42.0 documents/s\n")


def test_a_resumed_run_shows_only_its_own_steps_and_sends_all(tmp_path):
    """Rows an earlier attempt left in metrics.jsonl go to MLflow with the new ones (the
    run keeps the whole curve) but are not printed again as this attempt's progress."""
    from crawl2chat.infra.training_records import MetricsFollower

    seen = []
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(3)))
    follower = MetricsFollower(path, "no-run", client=object(), on_step=seen.append)
    with open(path, "a") as f:
        f.write("".join(json.dumps({**r, "step": r["step"] + 2}) + "\n" for r in rows(2)))
    assert follower.read() > 0
    assert [r["step"] for r in seen] == [3, 4]
    assert sorted({m.step for m in follower.pending}) == [1, 2, 3, 4]


def test_a_rerun_sends_each_step_of_the_curve_once(tmp_path):
    """An attempt killed after step 5 that checkpointed at step 3: the rerun resumes at 3 and
    trains 4-6 again; the run's curve holds steps 1-3 of the first attempt and 4-6 of the second."""
    from crawl2chat.infra.training_records import MetricsFollower

    class Client:
        def __init__(self):
            self.logged = []

        def log_batch(self, run_id, metrics):
            self.logged += metrics

    path = tmp_path / "metrics.jsonl"
    first = rows(5)
    again = [{"type": "event", "event": "resume", "step": 3, "checkpoint": "step_00000003"},
             *[{**r, "loss": 1.0} for r in rows(6)[3:]]]
    path.write_text("".join(json.dumps(r) + "\n" for r in first))
    client = Client()
    follower = MetricsFollower(path, "no-run", client=client)
    # The rerun's first poll comes before its rank has loaded the checkpoint: nothing of the
    # earlier attempt is sent yet, since which of its steps stay is not known.
    assert follower.poll() and client.logged == []
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in again))
    assert follower.poll()
    losses = [(m.step, m.value) for m in client.logged if m.key == "loss"]
    assert losses == [(1, 4.9), (2, 4.8), (3, 4.7), (4, 1.0), (5, 1.0), (6, 1.0)]


def test_an_attempt_that_wrote_nothing_still_sends_the_earlier_points(tmp_path):
    """A rerun that fails before its first row (a bad setting): the run keeps the curve on file."""
    from crawl2chat.infra.training_records import MetricsFollower

    class Client:
        logged: list = []

        def log_batch(self, run_id, metrics):
            self.logged += metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(3)))
    follower = MetricsFollower(path, "no-run", client=Client(), interval=0.05).start()
    assert follower.stop(drain_timeout=5)
    assert sorted({m.step for m in Client.logged if m.key == "loss"}) == [1, 2, 3]
