"""The ready file: how a peer tells a launcher, in a form a program reads, that it is in the swarm and where.

A peer started with ``--ready-file PATH`` writes one JSON object there once it has joined: its peer id, the
address others join with (``join_address``, None for a peer that can't be dialled) and all its addresses. The
file appears whole or not at all (written aside, then renamed). The launcher waits for it instead of reading the
lines printed for people. This module knows nothing of the swarm or of torch.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def write_ready_file(path: str | Path, peer_id: str, join_address: str | None, addresses: list[str]) -> None:
    """Write the ready record atomically (a reader sees the whole file or none)."""
    path = Path(path)
    record = dict(peer_id=peer_id, join_address=join_address, addresses=list(addresses), pid=os.getpid())
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def read_ready_file(path: str | Path) -> dict[str, Any] | None:
    """The ready record at ``path``, or None while there is none (or it is not one)."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("peer_id"), str) else None


def wait_for_join_address(path: str | Path, timeout_s: float, poll_s: float = 0.1) -> str:
    """The address others join with, from the ready file at ``path`` once its peer wrote it (``--join-ready-file``:
    peers started together on one machine, the others joining the first, need no address before it has one).
    Raises ValueError with a one-line reason if none is written within ``timeout_s`` or its peer can't be dialled."""
    deadline = time.monotonic() + timeout_s
    while (record := read_ready_file(path)) is None:
        if time.monotonic() >= deadline:
            raise ValueError(f"no peer wrote its ready file {path} within {timeout_s:g} s (--join-ready-file)")
        time.sleep(poll_s)
    address = record.get("join_address")
    if not isinstance(address, str):
        raise ValueError(f"the peer of ready file {path} can't be dialled (client mode): nothing to join")
    return address
