"""A local swarm for integration tests: real peer processes on 127.0.0.1, started by the launcher's code."""

from __future__ import annotations

import re
import time
from pathlib import Path

from p2p_diloco.cli.peer_processes import LocalSwarm, popen

WARM = None  # the session's warm-start server (conftest.py), while the integration tests run

# small and quick, but the real code path: DHT, matchmaking, butterfly all-reduce, int8 codec
PEER_SCRIPT = Path(__file__).resolve().parents[2] / "peers" / "peer.py"  # what a volunteer runs
FAST_MODEL_FLAGS = ["--n-layers", "2", "--d-model", "64", "--n-heads", "2"]  # the built-in model's shape
FAST_PEER_FLAGS = [
    *FAST_MODEL_FLAGS, "--seq-len", "64", "--batch-size", "8",
    "--inner-steps", "20", "--matchmaking-time-s", "4", "--averaging-timeout-s", "30", "--chunk-timeout-s", "4",
    "--state-timeout-s", "30", "--compression", "int8", "--run-id", "itest", "--eval-every", "1",
]


def local_swarm(
    out_dir: Path, reaper: list[int], extra_flags: list[str] | None = None, built_in_model: bool = True
) -> LocalSwarm:
    """A LocalSwarm of fast test peers whose process groups the test's reaper kills at teardown;
    ``built_in_model=False`` leaves out the built-in model's shape (for a model that ``extra_flags`` name)."""
    flags = FAST_PEER_FLAGS if built_in_model else FAST_PEER_FLAGS[len(FAST_MODEL_FLAGS) :]
    spawn = WARM.spawn if WARM is not None else popen  # forked warm where nothing would differ (warm_start.py)
    return LocalSwarm(out_dir, flags + (extra_flags or []), on_start=reaper.append, spawn=spawn)


def wait_for_log(path: Path, pattern: str, offset: int, timeout_s: float) -> None:
    """Wait until ``pattern`` appears in the log at ``path`` after byte ``offset``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_bytes()[offset:].decode(errors="replace")):
            return
        time.sleep(0.05)
    raise AssertionError(f"no {pattern!r} in {path} within {timeout_s} s")


def eventually(condition, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Whether ``condition()`` came true within ``timeout_s``, asked every ``poll_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return False
