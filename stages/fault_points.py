"""Named points in the commit sequences where a fault drill can kill the process.

The data stage's atomicity rests on the order of a few renames (a step folder
into place, a version's files into ``shards/``, the version folder, then the
manifest). Killing a process *between* two of them from outside is a matter of
luck; a drill sets ``CRAWL2CHAT_KILL_AT`` to one of the names passed to
:func:`kill_point` and the process SIGKILLs itself exactly there, as the OOM
killer or a pre-empted node would, so every window is tried on every run of the
drill (``infra/fault_drill.py``, ``tests/faults``). Unset, a point costs one
environment lookup.
"""

from __future__ import annotations

import os
import signal

KILL_AT = "CRAWL2CHAT_KILL_AT"


def kill_point(name: str) -> None:
    """SIGKILL this process when ``CRAWL2CHAT_KILL_AT`` names this point."""
    if os.environ.get(KILL_AT) == name:
        os.kill(os.getpid(), signal.SIGKILL)
