"""The processes a peer's swarm runs beside it (the DHT's, its ``p2pd``, the averager's), and how they are stopped
for good: hivemind's own shutdown ends with a SIGTERM these processes ignore (averaging.py), so it is followed by a
SIGKILL; and every descendant of a peer is reaped when it leaves."""

from __future__ import annotations

import os
import signal
import sys
import threading
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


def lower_priority(increment: int, pids: list[int], with_descendants: bool = True, every_thread: bool = True) -> int:
    """Raise the nice value of ``pids`` (the DHT's and the averager's processes), and of their descendants (``p2pd``),
    by ``increment``, so that on a machine whose cores all train, the training goes first (docs/benchmarks.md,
    "Where a peer's time goes"). Returns how many processes were lowered; where the OS refuses, nothing.

    On Linux a nice value belongs to a thread, and ``setpriority`` on a pid reaches its main thread alone: the
    averager's event loop and ``p2pd``'s Go threads kept nice 0 until every thread was lowered (``every_thread``).
    Threads started later inherit the value of the thread that starts them."""
    if increment <= 0 or not hasattr(os, "setpriority"):
        return 0
    lowered = 0
    for pid in [*pids, *(child for root in pids for child in descendants(root))] if with_descendants else pids:
        done = False
        for tid in _threads(pid) if every_thread else [pid]:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
                done = True
            except OSError:  # gone meanwhile, or refused
                pass
        lowered += done
    return lowered


def _threads(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (Linux /proc; elsewhere, or if unreadable, just ``pid``)."""
    try:
        return sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task") if tid.isdigit()) or [pid]
    except OSError:
        return [pid]


def lower_this_thread(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux: a thread id is a ``PRIO_PROCESS`` target)."""
    if increment > 0 and sys.platform.startswith("linux"):
        lower_priority(increment, [threading.get_native_id()], with_descendants=False, every_thread=False)


def descendants(root: int | None = None) -> list[int]:
    """Every process descended from ``root`` (this one by default; Linux /proc; elsewhere [])."""
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
    found, stack = [], list(children.get(os.getpid() if root is None else root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def cpu_seconds(pids: list[int], with_descendants: bool = True) -> float | None:
    """CPU seconds (user and system) that ``pids`` (and their descendants) have used so far, children they already
    reaped included (Linux /proc; elsewhere None). A process gone meanwhile counts nothing. Finding descendants
    lists every process of the machine; a caller that asks often passes the family it found once."""
    if not os.path.isdir("/proc"):
        return None
    ticks = 0
    for pid in [*pids, *(child for root in pids for child in descendants(root))] if with_descendants else pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def reap_descendants() -> int:
    """SIGKILL every process descended from this one (Linux /proc; elsewhere nothing); returns how many."""
    found = descendants()
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(found)
