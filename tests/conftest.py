"""Shared fixtures: a reaper for process groups a test names, and one that kills every process a test leaves behind.

The test process is made a child subreaper (Linux): a peer whose launcher died is re-parented to it instead of
to init, so that ``_reap_leftover_processes`` still finds it among this process's descendants after the test.
"""

from __future__ import annotations

import ctypes
import os
import signal

import pytest

_PR_SET_CHILD_SUBREAPER = 36

try:  # no test asserts on time: a first example that warms a cache may take seconds on a loaded 2-core machine
    from hypothesis import settings

    settings.register_profile("p2p-diloco", deadline=None)
    settings.load_profile("p2p-diloco")
except ImportError:  # hypothesis is a dev extra; only test_fuzz needs it
    pass


def pytest_configure(config: pytest.Config) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: leftovers of a dead launcher are then init's
        pass


def _descendants() -> set[int]:
    """Every process descended from this one (Linux /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = set(), list(children.get(os.getpid(), []))
    while stack:
        pid = stack.pop()
        found.add(pid)
        stack.extend(children.get(pid, []))
    return found


def _is_shared_memory_manager(pid: int) -> bool:
    """torch's ``torch_shm_manager``: started on the first shared tensor and kept for the whole process; killing
    it makes every later ``share_memory_()`` here fail (Broken pipe)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return b"torch_shm_manager" in handle.read()
    except OSError:
        return False


@pytest.fixture(autouse=True)
def _reap_leftover_processes():
    """After each test, SIGKILL every descendant process that was not there before it (fixtures of a wider scope
    are set up first, so theirs are kept; so is torch's shared-memory manager), and collect the ones that were
    re-parented to us."""
    before = _descendants()
    yield
    leftovers = {pid for pid in _descendants() - before if not _is_shared_memory_manager(pid)}
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in leftovers:
        try:
            os.waitpid(pid, 0)  # killed: it ends at once
        except ChildProcessError:  # not our child (a grandchild its parent reaps), or reaped already
            pass


@pytest.fixture
def reaper():
    """Collects process-group ids; at teardown SIGKILLs every group still alive."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
