"""Peers (datatrove, nanoGPT, TRL) run from their own virtual environments, never from the
project's: a benchmark asks :func:`peer_python` for the interpreter of a peer's venv,
which it creates and fills from the package registry when the benchmark was given
``--with-peer`` (``~/.cache/crawl2chat/peers/<name>``, or ``CRAWL2CHAT_PEERS``), and
otherwise reports how to get one. A peer's sources come from ``../shared/peers/`` when
the peer is not a package (nanoGPT)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(os.environ.get("CRAWL2CHAT_PEERS", Path.home() / ".cache" / "crawl2chat" / "peers"))
SHARED_PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers"


class PeerMissing(RuntimeError):
    """The peer's venv does not exist and the benchmark was not asked to make it."""


def peer_python(name: str, requirements: list[str], with_peer: bool, overrides: Sequence[str] = ()) -> Path:
    """The python of peer ``name``'s venv, with ``requirements`` installed in it (made on
    first use when ``with_peer``; a finished venv holds a ``.complete`` marker).

    ``overrides`` are installed afterwards in a second pip call: versions the benchmark
    needs both sides to share where the peer's own metadata pins another one (datatrove's
    ``processing`` extra asks for trafilatura 1.x); pip reports the conflict and installs them,
    where one call with both would refuse to resolve."""
    venv = ROOT / name
    python = venv / "bin" / "python"
    marker = venv / ".complete"
    wanted = "\n".join([*requirements, *(f"then {o}" for o in overrides)])
    if marker.exists() and marker.read_text() == wanted:
        return python
    if not with_peer:
        raise PeerMissing(f"no venv for {name} at {venv}; run again with --with-peer to create it "
                          f"({' '.join([*requirements, *overrides])})")
    print(f"[peer] creating {venv} with {' '.join(requirements)}"
          + (f", then {' '.join(overrides)}" if overrides else ""), flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements], check=True)
    if overrides:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *overrides], check=True)
    marker.write_text(wanted)
    return python


def shared_peer_source(name: str) -> Path:
    """The peer's unmodified sources under ``../shared/peers/<name>`` (run, never copied into the project)."""
    src = SHARED_PEERS / name
    if not src.is_dir():
        raise PeerMissing(f"the {name} sources are not at {src}")
    return src
