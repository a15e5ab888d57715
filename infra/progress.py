"""Progress of long work on the terminal: step (page, document) / total, loss, rate and time left.

On a terminal the line redraws itself in place with a bar; in a log file or CI
(no terminal) a plain line is written at the first update, every ``every``
seconds and at the last step, so logs stay readable. Training feeds it the
trainer's own ``metrics.jsonl`` rows
(:class:`~crawl2chat.infra.training_records.MetricsFollower` passes each step row
on), so it needs nothing from inside the training processes; the crawl feeds it
pages fetched, and each data step the documents its Ray Data job has processed
(:mod:`crawl2chat.stages.data.counting`).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class StepProgress:
    """``[stage] step 120/400 [#####.....] loss 3.412  7,700 tokens/s  2m31s left``;
    with a ``label``, ``[data] langid   documents 120/400 [#####.....]  85.0 documents/s  3s left``.

    A row's ``note`` (text) is shown at the end of the line."""

    WIDTH = 20

    def __init__(self, stage: str, total: int | None, stream: TextIO | None = None, every: float = 30.0,
                 unit: str = "step", label: str = ""):
        self.stage, self.total, self.unit = stage, total if total and total > 0 else None, unit
        self.label = label
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self._first: tuple[int, float] | None = None
        self._last_print = float("-inf")
        self._open_line = False
        self._last_row: dict = {}
        self._printed_step: int | None = None  # of the last line ended (written in full)
        self._moved: tuple[int, float] | None = None  # the count and when it last changed

    def line(self, row: dict, now: float) -> str:
        step = int(row.get("step", 0))
        head = f"[{self.stage}] " + (f"{self.label:<8} " if self.label else "")
        parts = [f"{head}{self.unit} {step}" + (f"/{self.total}" if self.total else "")]
        if self.total:
            done = min(1.0, step / self.total)
            parts.append("[" + "#" * int(done * self.WIDTH) + "." * (self.WIDTH - int(done * self.WIDTH)) + "]")
        for key, label in (("loss", "loss"), ("reward_mean", "reward")):
            if isinstance(row.get(key), (int, float)):
                parts.append(f"{label} {row[key]:.3f}")
                break
        if isinstance(row.get("tokens_per_second"), (int, float)):
            parts.append(f"{row['tokens_per_second']:,.0f} tokens/s")
        if isinstance(row.get("megabytes"), (int, float)):
            parts.append(f"{row['megabytes']:.1f} MB")
        # The rate up to the count's last change: work that follows the counted part
        # (a step's writing, dedup's clustering) does not dilute it.
        until = self._moved[1] if self._moved is not None and self._moved[0] == step else now
        if self._first is not None and until > self._first[1] and step > self._first[0] and self.unit != "step":
            parts.append(f"{(step - self._first[0]) / (until - self._first[1]):,.1f} {self.unit}/s")
        if self._first is not None and self.total and step > self._first[0]:
            rate = (step - self._first[0]) / max(1e-9, now - self._first[1])
            parts.append(f"{_duration((self.total - step) / rate)} left")
        if row.get("note"):
            parts.append(str(row["note"]))
        return "  ".join(parts)

    def __call__(self, row: dict, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        step = int(row.get("step", 0))
        if self._first is None:
            self._first = (step, now)
        if self._moved is None or self._moved[0] != step:
            self._moved = (step, now)
        if self.total is not None and step >= self.total and step == self._printed_step:
            return  # the last step's line is written; work that follows it shows nothing new
        last = self.total is not None and step >= self.total
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line(row, now) + ("\n" if last else ""))
            self._open_line = not last
            self.stream.flush()
            if last:
                self._printed_step = int(row.get("step", 0))
        elif last or now - self._last_print >= self.every:
            self._plain(row, now)
        self._last_row = row

    def _plain(self, row: dict, now: float) -> None:
        self.stream.write(self.line(row, now) + "\n")
        self.stream.flush()
        self._last_print, self._printed_step = now, int(row.get("step", 0))

    def finish(self, row: dict | None = None, now: float | None = None) -> None:
        """The work is done: the final ``row`` (else the last one shown) gets a line of
        its own, ended, unless that count's line already was; in a log this holds for
        work whose total was unknown or that ended sooner than ``every``. Nothing is
        written when no update came at all."""
        if self._first is None:
            return
        row = row if row is not None else self._last_row
        now = time.monotonic() if now is None else now
        if int(row.get("step", 0)) != self._printed_step:
            if self.tty:
                self.stream.write("\r\x1b[2K" + self.line(row, now) + "\n")
                self.stream.flush()
                self._printed_step, self._open_line = int(row.get("step", 0)), False
            else:
                self._plain(row, now)
        self.close()
        self._first = self._moved = None

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False
