"""Failures no second attempt can cure: the disk (or a file size limit) or memory ran out.

A write that fails with ENOSPC, EDQUOT or EFBIG, or a ``MemoryError``, fails again
on a rerun until someone frees space or memory, so the training scripts report it
as its own failure kind (not retried) and the data steps are not retried either.
Libraries that write in native code (safetensors, ``torch.save``) raise their own
errors carrying the operating system's message; those are recognised by it.
:func:`exhaustion` turns such an error into one sentence saying what ran out and
where.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

SPACE_ERRNOS = {errno.ENOSPC: "out of disk space", errno.EDQUOT: "out of disk quota",
                errno.EFBIG: "over the file size limit"}
# What native writers put in their messages for the same conditions.
_SPACE_PATTERNS = (
    (re.compile(r"no space left on device|os error 28\b", re.I), errno.ENOSPC),
    (re.compile(r"disk quota exceeded|os error 122\b", re.I), errno.EDQUOT),
    (re.compile(r"file too large|os error 27\b|filetoolarge", re.I), errno.EFBIG),
    (re.compile(r"file write failed|unexpected pos \d+ vs \d+", re.I), errno.ENOSPC),  # torch.save's writer
)
_PATH = re.compile(r"(?<![\w/.])(/(?:[^\s'\":,()/]+/)+[^\s'\":,()]*)")  # absolute, two parts at least


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def exhaustion(error: BaseException, where: str | os.PathLike | None = None) -> str | None:
    """One sentence when ``error`` (or an error it arose from) is running out of disk
    space, disk quota, the file size limit or memory; None otherwise. It names the file
    being written when the error says which, else ``where``."""
    for e in _chain(error):
        if isinstance(e, MemoryError):
            return f"out of memory ({type(e).__name__}{': ' + str(e) if str(e) else ''})"
        code = e.errno if isinstance(e, OSError) and e.errno in SPACE_ERRNOS else None
        if code is None:
            text = str(e)
            code = next((c for pattern, c in _SPACE_PATTERNS if pattern.search(text)), None)
        if code is None:
            continue
        path = getattr(e, "filename", None) or _path_in(str(e))
        at = f" writing {path}" if path else f" writing under {where}" if where else ""
        path = path or where
        free = _free_space(path)
        return (f"{SPACE_ERRNOS[code]}{at} ({errno.errorcode[code]}: {os.strerror(code)})"
                f"{f'; {free} free on its filesystem' if free else ''}")
    return None


def _path_in(text: str) -> str | None:
    match = _PATH.search(text)
    return match.group(1) if match else None


def _free_space(path) -> str | None:
    if not path:
        return None
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB"
