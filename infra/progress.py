"""Progress of long work on the terminal: step (or page) / total, loss, rate and time left.

On a terminal the line redraws itself in place with a bar; in a log file or CI
(no terminal) a plain line is written every ``every`` seconds and at the last
step, so logs stay readable. Fed with the trainer's own ``metrics.jsonl`` rows
(:class:`~crawl2chat.infra.training_records.MetricsFollower` passes each step row
on), so it needs nothing from inside the training processes.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class StepProgress:
    """``[stage] step 120/400 [#####.....] loss 3.412  7,700 tokens/s  2m31s left``."""

    WIDTH = 20

    def __init__(self, stage: str, total: int | None, stream: TextIO | None = None, every: float = 30.0,
                 unit: str = "step"):
        self.stage, self.total, self.unit = stage, total if total and total > 0 else None, unit
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self._first: tuple[int, float] | None = None
        self._last_print = float("-inf")
        self._open_line = False

    def line(self, row: dict, now: float) -> str:
        step = int(row.get("step", 0))
        parts = [f"[{self.stage}] {self.unit} {step}" + (f"/{self.total}" if self.total else "")]
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
        if self._first is not None and now > self._first[1] and step > self._first[0] and self.unit != "step":
            parts.append(f"{(step - self._first[0]) / (now - self._first[1]):.1f} {self.unit}/s")
        if self._first is not None and self.total and step > self._first[0]:
            rate = (step - self._first[0]) / max(1e-9, now - self._first[1])
            parts.append(f"{_duration((self.total - step) / rate)} left")
        return "  ".join(parts)

    def __call__(self, row: dict, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = (int(row.get("step", 0)), now)
        last = self.total is not None and int(row.get("step", 0)) >= self.total
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line(row, now) + ("\n" if last else ""))
            self._open_line = not last
            self.stream.flush()
        elif last or now - self._last_print >= self.every:
            self.stream.write(self.line(row, now) + "\n")
            self.stream.flush()
            self._last_print = now

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False
