"""Where a stuck peer is stuck: every thread's Python stack, printed into its log (docs/architecture.md, "A peer that does not stop").

A peer that does not stop within its launcher's grace period is SIGKILLed, and its log kept nothing of where it was
(once in CI a trainer stopped inside a checkpoint write and never answered SIGTERM; the kill left no clue). Two ways
now put its threads' stacks into the log first, both printed by ``faulthandler`` from C, so they work while the main
thread is stuck in native code or waits on a lock:

- ``DUMP_SIGNAL`` (SIGUSR1) prints them at any time (``enable``, at the peer's start): ``kill -USR1 PID`` on a live
  peer, and the launcher sends it to a peer that outlived its grace, just before the SIGKILL (``dump_before_kill``);
- a stop request arms a timer that prints them once if the process still runs ``after_s`` later (``arm``): a
  volunteer's peer that hangs after Ctrl-C or a service manager's SIGTERM says where.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import IO

DUMP_SIGNAL: int | None = getattr(signal, "SIGUSR1", None)  # None where there is no such signal (Windows)


def enable(file: IO | None = None) -> bool:
    """Print every thread's stack to ``file`` (stderr) on ``DUMP_SIGNAL``; False where that cannot be set up."""
    if DUMP_SIGNAL is None:
        return False
    try:
        faulthandler.register(DUMP_SIGNAL, file=file or sys.__stderr__, all_threads=True)
    except (AttributeError, OSError, ValueError, RuntimeError):  # no stderr with a file descriptor (a test capturing it)
        return False
    return True


def arm(after_s: float, file: IO | None = None) -> None:
    """Print every thread's stack once, ``after_s`` from now, unless the process ended (a stop request that did not
    end the process in time). Arming again restarts the timer."""
    try:
        faulthandler.dump_traceback_later(after_s, repeat=False, file=file or sys.__stderr__, exit=False)
    except (AttributeError, OSError, ValueError, RuntimeError):
        pass


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` handles ``signum`` (Linux: the ``SigCgt`` mask of /proc/PID/status); False where unknown.
    A process that does not would die of it instead (SIGUSR1's default action), not print anything."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool((int(line.split()[1], 16) >> (signum - 1)) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def dump_before_kill(pid: int, wait_s: float = 0.5) -> bool:
    """Ask ``pid`` for its threads' stacks (``DUMP_SIGNAL``) if it handles that signal, and give it ``wait_s`` to print
    them; True if asked. The caller kills it afterwards."""
    if DUMP_SIGNAL is None or not catches(pid, DUMP_SIGNAL):
        return False
    try:
        os.kill(pid, DUMP_SIGNAL)
    except (ProcessLookupError, PermissionError):
        return False
    time.sleep(wait_s)
    return True
