"""The processes a peer's swarm runs beside it (the DHT's, its ``p2pd``, the averager's), and how they are stopped
for good: hivemind's own shutdown ends with a SIGTERM these processes ignore (averaging.py), so it is followed by a
SIGKILL; and every descendant of a peer is reaped when it leaves."""

from __future__ import annotations

import os
import signal
from typing import Any

from hivemind import DHT


def close_dht(dht: DHT) -> None:
    """Stop a DHT started by ``start_dht`` and its ``p2pd``."""
    if dht.is_alive():
        dht.shutdown()
    kill_if_alive(dht)


def kill_if_alive(process: Any, wait_s: float = 5.0) -> None:
    """hivemind's shutdown ends with terminate() (SIGTERM), which our children ignore: finish the job."""
    process.join(timeout=wait_s)
    if process.is_alive():
        process.kill()
        process.join(timeout=wait_s)


def reap_descendants() -> int:
    """SIGKILL every process descended from this one (Linux /proc; elsewhere nothing); returns how many."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))  # fields: state, ppid, ...
    found, stack = [], list(children.get(os.getpid(), []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(found)
