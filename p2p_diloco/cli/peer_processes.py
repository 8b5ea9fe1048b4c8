"""Peer processes of a local swarm: start one in its own process group, learn its address from its ready file
(cli/ready.py), stop it with its whole group. ``LocalSwarm`` is the same for tests and experiments that drive a
swarm step by step. A peer is this package's own command (``python -m p2p_diloco.cli peer``), so that this works
from an installed package as from a checkout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2p_diloco.cli import stacks
from p2p_diloco.cli.ready import read_ready_file
from p2p_diloco.observe.report import build_report, read_metrics

# a peer is this package's own command, so that the launcher works from an installed package as from a checkout
PEER_COMMAND = ["-m", "p2p_diloco.cli", "peer"]
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds p2p_diloco/ (site-packages, or a clone)


def popen(command: list[str], env: dict[str, str], log_file: Path, append: bool) -> subprocess.Popen:
    """A peer's start: a fresh interpreter in its own session (process group), its output into ``log_file``."""
    with open(log_file, "ab" if append else "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


# how a peer's process starts: ``popen``, or what takes the same arguments and returns what the launcher uses of a
# Popen (pid, returncode, poll, wait, send_signal): the integration tests fork theirs from a warm server
Spawn = Callable[[list[str], dict[str, str], Path, bool], Any]


@dataclass
class PeerProcess:
    """One peer started by the launcher, in its own process group."""

    name: str
    process: subprocess.Popen
    metrics_file: Path
    log_file: Path
    ready_file: Path | None = None  # where the peer says it is in the swarm, and where others can join it
    started_at: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)  # pgid == pid: started with start_new_session
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        """Ask the peer to stop (SIGTERM to the peer process; it stops its own averager, DHT and p2pd)."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the peer, wait ``grace_s``, then SIGKILL whatever of its group is left. A peer still running after
        its grace prints every thread's stack into its log first (cli/stacks.py): where it was stuck."""
        if self.alive:
            self.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                if stacks.dump_before_kill(self.process.pid):
                    print(f"{self.name} did not stop within {grace_s:.0f} s: its threads' stacks are at the end of "
                          f"{self.log_file}", file=sys.stderr, flush=True)
        self.signal_group(signal.SIGKILL)  # reaps the averager, DHT and p2pd even if the peer exited
        try:
            return self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None


def start_peer(
    name: str,
    out_dir: Path,
    peer_args: list[str],
    initial_peer: str | list[str] | None,
    python: str = sys.executable,
    append: bool = False,
    command_prefix: list[str] | None = None,
    host: str = "127.0.0.1",
    entry: list[str] | None = None,
    env: dict[str, str] | None = None,
    spawn: Spawn = popen,
) -> PeerProcess:
    """Start a peer (``python -m p2p_diloco.cli peer``) in its own process group, logging to ``out_dir/NAME.log``, writing metrics to
    ``out_dir/NAME.jsonl`` and its ready file to ``out_dir/NAME.ready.json``; ``append`` keeps the log and metrics
    (a restarted peer continues them). ``command_prefix`` runs it inside something (``ip netns exec NS`` of an
    emulated network), listening on ``host``; ``entry`` replaces the peer command by another program taking the
    same flags (a benchmark's baseline); ``env`` adds to its environment (``ATEN_CPU_CAPABILITY``, say)."""
    metrics_file, log_file, ready_file = (out_dir / f"{name}{suffix}" for suffix in (".jsonl", ".log", ".ready.json"))
    if not append:
        metrics_file.unlink(missing_ok=True)
    ready_file.unlink(missing_ok=True)  # the new process writes its own once it is in the swarm
    command = [*(command_prefix or []), python, *(entry or PEER_COMMAND), *peer_args]
    command += ["--metrics-file", str(metrics_file), "--ready-file", str(ready_file)]
    command += ["--host-maddrs", f"/ip4/{host}/tcp/0"]
    initial = [initial_peer] if isinstance(initial_peer, str) else list(initial_peer or [])
    if initial:
        command += ["--initial-peers", *initial]
    return PeerProcess(name, spawn(command, peer_environment(env), log_file, append), metrics_file, log_file, ready_file)


def peer_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """A peer's environment: ours, unbuffered, one OpenMP thread, this package importable, plus ``env``."""
    path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=path, **(env or {}))


def joining(first: PeerProcess) -> list[str]:
    """The flags of a peer started beside ``first``, before it is in the swarm: join it once its ready file is written
    (``--join-ready-file``), so that both import and load at the same time."""
    return ["--join-ready-file", str(first.ready_file)]


def last_log_line(peer: PeerProcess) -> str:
    """The last line a peer wrote to its log (its one-line error, when it failed), or "(no output)"."""
    text = peer.log_file.read_bytes()[-8192:].decode(errors="replace") if peer.log_file.exists() else ""
    return (text.strip().splitlines()[-1:] or ["(no output)"])[0]


def wait_for_ready(
    peers: list[PeerProcess], timeout_s: float = 120.0, stop: Callable[[], bool] | None = None
) -> dict[str, dict]:
    """Each peer's ready record (ready.py) once all of them wrote one, by name; raises RuntimeError naming the
    first peer that exited before it was in the swarm, or those not in it within ``timeout_s``, or when ``stop()``."""
    deadline, found = time.monotonic() + timeout_s, {}
    while True:
        if stop is not None and stop():
            raise RuntimeError("stopped before every peer was in the swarm")
        for peer in peers:
            if peer.name not in found and peer.ready_file is not None:
                record = read_ready_file(peer.ready_file)
                if record is not None:
                    found[peer.name] = record
                elif not peer.alive:
                    raise RuntimeError(f"{peer.name} exited with code {peer.process.returncode} before it was in the "
                                       f"swarm: {last_log_line(peer)}")
        if len(found) == len(peers):
            return found
        if time.monotonic() >= deadline:
            missing = [peer.name for peer in peers if peer.name not in found]
            raise RuntimeError(f"{', '.join(missing)} not in the swarm within {timeout_s:.0f} s (see {missing[0]}.log)")
        time.sleep(0.2)


def wait_for_address(peer: PeerProcess, timeout_s: float = 120.0, stop: Callable[[], bool] | None = None) -> str:
    """The multiaddr others join a peer with, from its ready file; raises RuntimeError if it dies first, times
    out, or can't be dialled (a client-mode peer)."""
    address = wait_for_ready([peer], timeout_s, stop)[peer.name].get("join_address")
    if not isinstance(address, str):
        raise RuntimeError(f"{peer.name} is in the swarm but others can't dial it (client mode): no address to join")
    return address


class LocalSwarm:
    """Peers started on 127.0.0.1 (the first one's address is the others' initial peer), watched through their
    metrics files. Used by the benchmark scripts and the integration tests. A peer started before the first one
    is in the swarm joins it through its ready file (``--join-ready-file``): the peers start together."""

    def __init__(
        self, out_dir: Path, flags: list[str], on_start: Callable[[int], None] | None = None, wan: Any = None,
        spawn: Spawn = popen,
    ):
        """``wan``: start the peer of shard i inside the emulated network's namespace i, not on 127.0.0.1;
        ``spawn``: how each peer's process starts (``start_peer``'s)."""
        self.out_dir, self.flags, self._on_start, self.wan, self._spawn = out_dir, list(flags), on_start, wan, spawn
        out_dir.mkdir(parents=True, exist_ok=True)
        self.peers: dict[str, PeerProcess] = {}
        self._address: str | None = None

    @property
    def address(self) -> str:
        """The first peer's join address, once it is in the swarm (waited for here if it is not yet)."""
        if self._address is None:
            self._address = wait_for_address(next(iter(self.peers.values())), timeout_s=90)
        return self._address

    @address.setter
    def address(self, value: str) -> None:
        self._address = value

    def start(
        self, name: str, shard: int, num_shards: int, extra: list[str] | None = None, append: bool = False,
        entry: list[str] | None = None, env: dict[str, str] | None = None,
    ) -> PeerProcess:
        """Start a peer (``append``: a restart that continues the metrics and log of an earlier one; ``entry`` and
        ``env``: as ``start_peer``'s)."""
        flags = [*self.flags, *(extra or []), "--shard-index", str(shard), "--num-shards", str(num_shards)]
        place = dict(command_prefix=self.wan.command_prefix(shard), host=self.wan.host(shard)) if self.wan else {}
        if self._address is None and self.peers:  # the first peer is still starting
            first = next(iter(self.peers.values()))
            record = read_ready_file(first.ready_file) if first.ready_file else None
            if record and isinstance(record.get("join_address"), str):
                self._address = record["join_address"]
            else:
                flags += joining(first)
        peer = start_peer(
            name, self.out_dir, flags, self._address, append=append, entry=entry, env=env, spawn=self._spawn, **place
        )
        if self._on_start:
            self._on_start(peer.process.pid)
        self.peers[name] = peer
        return peer

    def records(self, name: str) -> list[dict]:
        path = self.peers[name].metrics_file
        return read_metrics(path) if path.exists() else []

    def all_records(self) -> dict[str, list[dict]]:
        return {name: self.records(name) for name in self.peers}

    def wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll ``condition``; raise RuntimeError on time-out or when a peer dies with an error."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if condition():
                return
            for name, peer in self.peers.items():
                if not peer.alive and peer.process.returncode not in (0, None, -signal.SIGKILL):
                    raise RuntimeError(f"{name} died (code {peer.process.returncode}): {self.log_tail(name)}")
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}; logs: {self.log_tails()}")

    def wait_all_exited(self, timeout_s: float) -> None:
        self.wait_until(lambda: not any(p.alive for p in self.peers.values()), timeout_s, "all peers to finish")

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
            peer.terminate()  # all at once, so none trains on alone meanwhile
        return {name: peer.stop(grace_s=40) for name, peer in self.peers.items()}


def run_to_end(out_dir: Path, flags: list[str], per_peer: list[list[str]], timeout_s: float, startup_s: float = 30.0) -> dict:
    """Start one peer per entry of ``per_peer`` (its extra flags), wait until all have stopped by themselves,
    stop any left over, and return the run report. What the benchmark scripts run, once per configuration.

    The peers begin training together ``startup_s`` after launch (``--start-at``, unless ``flags`` set it):
    otherwise the first peer up trains and averages alone while the others are still importing torch, and
    the configurations compared would each start differently."""
    if not any(flag.startswith("--start-at") for flag in flags):
        flags = [*flags, "--start-at", f"{time.time() + startup_s:.1f}"]
    swarm = LocalSwarm(out_dir, flags)
    try:
        for index, extra in enumerate(per_peer):
            swarm.start(f"peer{index}", shard=index, num_shards=len(per_peer), extra=extra)
        swarm.wait_all_exited(timeout_s)
    finally:
        swarm.stop_all()
    return build_report({name: peer.metrics_file for name, peer in swarm.peers.items()})
