"""A local swarm for integration tests: real peer processes on 127.0.0.1, started by the launcher's code."""

from __future__ import annotations

import re
import time
from pathlib import Path

from p2p_diloco.launcher import LocalSwarm

# small and quick, but the real code path: DHT, matchmaking, butterfly all-reduce, int8 codec
FAST_PEER_FLAGS = [
    "--n-layers", "2", "--d-model", "64", "--n-heads", "2", "--seq-len", "64", "--batch-size", "8",
    "--inner-steps", "20", "--matchmaking-time-s", "4", "--averaging-timeout-s", "30", "--chunk-timeout-s", "4",
    "--state-timeout-s", "30", "--compression", "int8", "--run-id", "itest",
]


def local_swarm(out_dir: Path, reaper: list[int], extra_flags: list[str] | None = None) -> LocalSwarm:
    """A LocalSwarm of fast test peers whose process groups the test's reaper kills at teardown."""
    return LocalSwarm(out_dir, FAST_PEER_FLAGS + (extra_flags or []), on_start=reaper.append)


def wait_for_log(path: Path, pattern: str, offset: int, timeout_s: float) -> None:
    """Wait until ``pattern`` appears in the log at ``path`` after byte ``offset``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_bytes()[offset:].decode(errors="replace")):
            return
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in {path} within {timeout_s} s")
