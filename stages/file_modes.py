"""Files a model folder publishes are readable as the user's other files are.

safetensors creates its files owner-only (mode 0600) whatever the umask, so a model
saved through it could be read by the account that trained it and no other (a
serving account, a teammate's export); the folder's other files get the umask's
usual 0644. Before a folder is published its files get the mode a new file gets.
"""

from __future__ import annotations

import os
from pathlib import Path


def umask_mode() -> int:
    """The mode ``open()`` gives a new file here (0o666 less the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def publish_modes(folder: str | os.PathLike) -> None:
    """Give every file directly in ``folder`` the mode a new file gets."""
    mode = umask_mode()
    for path in Path(folder).iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)
