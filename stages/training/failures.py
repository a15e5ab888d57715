"""How a training script's failure is reported to whoever launched it.

A failing script writes ``OUT/failure.json`` naming the *kind* of failure and exits
with that kind's status; the launcher reads the kind, not the log, to decide whether
a second attempt can help. This module has no heavy imports, so a command can
recognise :class:`StageFailed` without loading torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAILURE_FILE = "failure.json"

# Failure kinds; only "transient" is worth a second attempt.
BAD_INPUT = "bad_input"  # settings, data or a missing file: the user must change something
DIVERGED = "diverged"  # training diverged after every rollback
EXHAUSTED = "exhausted"  # the disk, a file size limit or memory ran out: a rerun fails the same way
TRANSIENT = "transient"  # anything else (a lost peer, a killed process): a rerun resumes from the checkpoint
BUSY = "busy"  # another process is writing the run folder (reported on stderr only: the folder is not ours)
EXIT_CODES = {BAD_INPUT: 2, DIVERGED: 3, TRANSIENT: 1, BUSY: 4, EXHAUSTED: 5}


def read_failure(out: str | Path) -> dict[str, Any] | None:
    """The failure a script reported in ``out``, if any."""
    try:
        return json.loads((Path(out) / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        return None


class StageFailed(RuntimeError):
    """A training script that failed, with the kind of failure it reported
    (``OUT/failure.json``); a process killed before it could report is transient."""

    def __init__(self, stage: str, kind: str, message: str, log_path: Path | None):
        self.stage, self.kind, self.message, self.log_path = stage, kind, message, log_path
        super().__init__(f"{stage}: {message} (full log: {log_path})")

    def __reduce__(self):  # rebuilt whole where Ray or Prefect unpickles it, not from the message alone
        return type(self), (self.stage, self.kind, self.message, self.log_path)

    @property
    def permanent(self) -> bool:
        return self.kind != TRANSIENT
