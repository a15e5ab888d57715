"""Migrated-database templates for the embedded SQLite stores.

A new project folder gets two SQLite databases: the local Prefect API's and the
MLflow store. Each library builds a new one by running its whole migration chain
(Prefect about 9 s, MLflow about 2 s on a small machine), which a user pays in
every new folder, before the first step. The first freshly migrated database on
a machine is snapshotted into the user's cache, under a name carrying the
library's version, and later new folders start from a copy of it. Each library
still checks the schema revision on opening (and Prefect applies any migration
left), so a template never stands in for a migration the library would run.

Neither library offers this (both migrate an empty file from scratch), so it is
done here with SQLite's own backup API, which copies a consistent snapshot.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Callable


def template_path(name: str) -> Path:
    """The cached template of ``name`` (a library and its version) for this Python."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "crawl2chat" / f"{name}-{sys.version_info[0]}.{sys.version_info[1]}.db"


def copy_template(template: Path, db: Path) -> bool:
    """Start the new database ``db`` as a copy of ``template``; False when there is no
    template yet or ``db`` appeared meanwhile (then the library creates or opens it)."""
    if not template.is_file():
        return False
    tmp = db.with_name(f".{db.name}.tmp-{os.getpid()}")
    try:
        shutil.copyfile(template, tmp)
        # A link, not a rename: a command that started in the same new folder a moment
        # earlier may already have its database open, and it must not be replaced.
        os.link(tmp, db)
        return True
    except OSError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def save_template(db: Path | None, template: Path,
                  scrub: Callable[[sqlite3.Connection], None] | None = None) -> None:
    """Keep a snapshot of the freshly migrated ``db`` as ``template`` (once per machine
    and library version); ``scrub`` removes from the snapshot the rows that belong to
    one folder. A failure here costs only the next folder's migrations."""
    if db is None or template.exists() or not db.is_file():
        return
    tmp = template.with_name(f".{template.name}.tmp-{os.getpid()}")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        source, target = sqlite3.connect(db), sqlite3.connect(tmp)
        try:
            source.backup(target)
            if scrub is not None:
                scrub(target)
                target.commit()
            # One self-contained file: the copy would otherwise keep the source's WAL mode,
            # and pages still in a -wal file beside it would not travel with it.
            target.execute("PRAGMA journal_mode=DELETE")
        finally:
            source.close()
            target.close()
        os.replace(tmp, template)
    except (OSError, sqlite3.Error):
        tmp.unlink(missing_ok=True)
