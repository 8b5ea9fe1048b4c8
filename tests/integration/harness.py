"""A local swarm for integration tests: real peer processes on 127.0.0.1, started by the launcher's code."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

from p2p_diloco.launcher import PeerProcess, start_peer, wait_for_address
from p2p_diloco.report import read_metrics

# small and quick, but the real code path: DHT, matchmaking, butterfly all-reduce, int8 codec
FAST_PEER_FLAGS = [
    "--n-layers", "2", "--d-model", "64", "--n-heads", "2", "--seq-len", "64", "--batch-size", "8",
    "--inner-steps", "10", "--matchmaking-time-s", "2", "--averaging-timeout-s", "30", "--chunk-timeout-s", "4",
    "--state-timeout-s", "30", "--compression", "int8", "--run-id", "itest",
]


class LocalSwarm:
    def __init__(self, out_dir: Path, reaper: list[int], extra_flags: list[str] | None = None):
        self.out_dir, self.reaper = out_dir, reaper
        self.flags = FAST_PEER_FLAGS + (extra_flags or [])
        self.peers: dict[str, PeerProcess] = {}
        self.address: str | None = None

    def start(self, name: str, shard: int, num_shards: int = 4, extra: list[str] | None = None) -> PeerProcess:
        flags = [*self.flags, *(extra or []), "--shard-index", str(shard), "--num-shards", str(num_shards)]
        peer = start_peer(name, self.out_dir, flags, self.address)
        self.reaper.append(peer.process.pid)
        self.peers[name] = peer
        if self.address is None:
            self.address = wait_for_address(peer, timeout_s=90)
        return peer

    def records(self, name: str) -> list[dict]:
        path = self.peers[name].metrics_file
        return read_metrics(path) if path.exists() else []

    def all_records(self) -> dict[str, list[dict]]:
        return {name: self.records(name) for name in self.peers}

    def wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return
            for name, peer in self.peers.items():
                if not peer.alive and peer.process.returncode not in (0, None, -9):
                    raise AssertionError(f"{name} died (code {peer.process.returncode}): {self.log_tail(name)}")
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; logs: {self.log_tails()}")

    def outer_step(self, name: str) -> int:
        records = self.records(name)
        return records[-1]["outer_step"] if records else -1

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.peers[name].log_file
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def log_tails(self) -> str:
        return "\n".join(f"--- {name}\n{self.log_tail(name)}" for name in self.peers)

    def stop_all(self) -> dict[str, int | None]:
        for peer in self.peers.values():
            if peer.alive:
                peer.signal_group(signal.SIGTERM)  # all at once, so none trains on alone meanwhile
        return {name: peer.stop(grace_s=40) for name, peer in self.peers.items()}
