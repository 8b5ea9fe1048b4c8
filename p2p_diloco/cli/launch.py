"""A local multiprocess swarm: N peer processes on 127.0.0.1, live progress, clean stop, run report.

Each peer runs ``peers/peer.py`` in its own process group (its averager, DHT process and ``p2pd`` go
with it), so that stopping or killing a peer never leaves children behind. The first peer starts the
swarm; the others join through the address it writes to its ready file (ready.py). The peers of ``swarm.py``
start training together (``--wait-for-peers``), and a peer that fails to join or exits with an error is named
and makes the launcher exit non-zero. This module holds no training logic.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2p_diloco.cli.peer import OneLineParser, add_peer_flags, fail, resolve_config
from p2p_diloco.cli.ready import read_ready_file
from p2p_diloco.observe.report import build_report, invariant_1_status, plot_report, read_metrics

# a peer is this package's own command, so that the launcher works from an installed package as from a checkout
PEER_COMMAND = ["-m", "p2p_diloco.cli", "peer"]
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds p2p_diloco/ (site-packages, or a clone)


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
        """SIGTERM the peer, wait ``grace_s``, then SIGKILL whatever of its group is left."""
        if self.alive:
            self.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
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
    path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    environment = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=path, **(env or {}))
    with open(log_file, "ab" if append else "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=environment)
    return PeerProcess(name, process, metrics_file, log_file, ready_file)


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
    """Peers started one by one on 127.0.0.1 (the first one's address is the others' initial peer),
    watched through their metrics files. Used by the benchmark scripts and the integration tests."""

    def __init__(
        self, out_dir: Path, flags: list[str], on_start: Callable[[int], None] | None = None, wan: Any = None
    ):
        """``wan``: start the peer of shard i inside the emulated network's namespace i, not on 127.0.0.1."""
        self.out_dir, self.flags, self._on_start, self.wan = out_dir, list(flags), on_start, wan
        out_dir.mkdir(parents=True, exist_ok=True)
        self.peers: dict[str, PeerProcess] = {}
        self.address: str | None = None

    def start(
        self, name: str, shard: int, num_shards: int, extra: list[str] | None = None, append: bool = False,
        entry: list[str] | None = None, env: dict[str, str] | None = None,
    ) -> PeerProcess:
        """Start a peer (``append``: a restart that continues the metrics and log of an earlier one; ``entry`` and
        ``env``: as ``start_peer``'s)."""
        flags = [*self.flags, *(extra or []), "--shard-index", str(shard), "--num-shards", str(num_shards)]
        place = dict(command_prefix=self.wan.command_prefix(shard), host=self.wan.host(shard)) if self.wan else {}
        peer = start_peer(name, self.out_dir, flags, self.address, append=append, entry=entry, env=env, **place)
        if self._on_start:
            self._on_start(peer.process.pid)
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


def progress_line(peer: PeerProcess) -> str:
    records = read_metrics(peer.metrics_file) if peer.metrics_file.exists() else []
    state = "running" if peer.alive else f"exited({peer.process.returncode})"
    if not records:
        return f"{peer.name:>7} {state:<11} starting"
    last = records[-1]
    loss = last.get("eval_loss") if last.get("eval_loss") is not None else last.get("loss")
    loss_text = f"{loss:6.3f}" if loss is not None else "   -  "
    blocked = last["blocked_s"] / max(1e-9, last["blocked_s"] + last["compute_s"])
    return (
        f"{peer.name:>7} {state:<11} outer_step {last['outer_step']:>4}  loss {loss_text}  "
        f"{last['tokens_per_s']:>8.0f} tok/s  group {last['group_size']}  blocked {100 * blocked:4.1f}%  "
        f"sha {last['global_sha256'][:10]}  {last['status']}"
    )


class ProgressView:
    """Redraws one line per peer in place on a terminal; prints a block every ``period_s`` otherwise."""

    def __init__(self, period_s: float = 10.0):
        self._tty, self._period_s, self._last, self._lines = sys.stdout.isatty(), period_s, 0.0, 0

    def show(self, peers: list[PeerProcess], force: bool = False) -> None:
        now = time.monotonic()
        if not (self._tty or force or now - self._last >= self._period_s):
            return
        self._last = now
        lines = [progress_line(p) for p in peers]
        if self._tty and self._lines:
            sys.stdout.write(f"\x1b[{self._lines}F")
        sys.stdout.write("".join(f"\x1b[2K{line}\n" if self._tty else f"{line}\n" for line in lines))
        if not self._tty:
            sys.stdout.write("\n")
        sys.stdout.flush()
        self._lines = len(lines)


def swarm_main(argv: list[str] | None = None, prog: str = "swarm.py") -> int:
    parser = OneLineParser(prog=prog, description="Run a local p2p-diloco swarm of N peer processes and write a report.")
    parser.add_argument("--peers", type=int, default=3, help="number of peer processes (default 3)")
    parser.add_argument("--out", default="runs/swarm", help="folder for metrics, logs, report.json and report.png")
    parser.add_argument("--late-peers", type=int, default=0, help="of the N peers, how many join late (default 0)")
    parser.add_argument("--late-after-s", type=float, default=60.0, help="seconds after the start that late peers join")
    parser.add_argument("--peer-env", nargs="+", default=[], metavar="PEER:NAME=VALUE",
                        help="an environment variable for one peer (numbered from 0), e.g. 1:ATEN_CPU_CAPABILITY=default "
                        "to run peer1 on torch's kernels for CPUs without vector units")
    parser.add_argument("--config", metavar="FILE", help="TOML config passed to every peer")
    add_peer_flags(parser)
    args = parser.parse_args(argv)
    if args.peers < 1 or not 0 <= args.late_peers < args.peers:
        return fail(prog, "--peers must be >= 1 and --late-peers in [0, peers)")
    try:
        args.peer_env = parse_peer_env(args.peer_env, args.peers)
    except ValueError as e:
        return fail(prog, str(e))
    try:
        resolve_config(args)  # validate the peers' flags once, here, before starting anything
    except ValueError as e:
        return fail(prog, str(e))
    peer_args = peer_args_without(argv or [], SWARM_FLAGS)
    if not any(a.startswith("--max-time-s") or a.startswith("--max-outer-steps") for a in peer_args):
        peer_args += ["--max-time-s", "180"]
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # --out names a file, or a folder we may not write in
        return fail(prog, f"cannot use --out {out_dir}: {e.strerror or e}")
    return run_swarm(args, peer_args, out_dir, prog)


SWARM_FLAGS = {"--peers", "--out", "--late-peers", "--late-after-s", "--peer-env"}


def parse_peer_env(items: list[str], peers: int) -> dict[int, dict[str, str]]:
    """``PEER:NAME=VALUE`` items -> {peer index: {NAME: VALUE}}; ValueError naming a malformed item."""
    found: dict[int, dict[str, str]] = {}
    for item in items:
        index, _, assignment = item.partition(":")
        name, equals, value = assignment.partition("=")
        if not (index.isdigit() and int(index) < peers and equals and name.isidentifier()):
            raise ValueError(f"--peer-env {item!r}: expected PEER:NAME=VALUE with PEER in [0, {peers})")
        found.setdefault(int(index), {})[name] = value
    return found
_FIRST_PEER_FLAGS = {"--monitor-port", "--monitor-host"}  # one monitor page per swarm: peer0 serves it


def first_peer_only(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split the peers' flags into (every peer's, the first peer's alone): flags of one value each."""
    shared, first, taking = [], [], False
    for token in argv:
        if taking:
            first.append(token)
            taking = False
        elif token.split("=", 1)[0] in _FIRST_PEER_FLAGS:
            first.append(token)
            taking = "=" not in token
        else:
            shared.append(token)
    return shared, first


def peer_args_without(argv: list[str], own: set[str]) -> list[str]:
    """The argv minus the launcher's own flags (and their values, however many): what every peer gets."""
    result, skipping = [], False
    for token in argv:
        name = token.split("=", 1)[0]
        if name in own:
            skipping = "=" not in token
            continue
        if skipping and not token.startswith("--"):
            continue
        skipping = False
        result.append(token)
    return result


def run_swarm(args: argparse.Namespace, peer_args: list[str], out_dir: Path, prog: str, wan: Any = None) -> int:
    """Start the swarm, show its progress until every peer has stopped, write the report. Returns 1 (after the
    report) when a peer failed to join or exited with an error, naming it; 0 otherwise. ``wan``: an emulated network
    (experiments/wan.py) whose namespace i holds peer i (``command_prefix``, ``host``, ``describe``, ``wire_bytes``)."""
    stopping = {"signal": None}

    def request_stop(signum: int, _frame: object) -> None:
        stopping["signal"] = signum

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    peers: list[PeerProcess] = []
    started = time.monotonic()
    view = ProgressView()
    peer_args, first_args = first_peer_only(peer_args)
    on_time = args.peers - args.late_peers
    if on_time > 1 and not any(a.split("=", 1)[0] == "--wait-for-peers" for a in peer_args):
        peer_args += ["--wait-for-peers", str(on_time)]  # the peers started together train together from round 1
    exited: dict[str, int] = {}  # peers that ended by themselves (not stopped by us), and how
    failures: list[str] = []
    envs = getattr(args, "peer_env", {}) or {}
    try:
        def start(index: int, address: str | None, extra: list[str]) -> PeerProcess:
            place = dict(command_prefix=wan.command_prefix(index), host=wan.host(index)) if wan else {}
            shard = ["--shard-index", str(index), "--num-shards", str(args.peers)]
            peer = start_peer(f"peer{index}", out_dir, [*peer_args, *extra, *shard], address, env=envs.get(index), **place)
            peers.append(peer)
            return peer

        def stop_requested() -> bool:
            return stopping["signal"] is not None

        address = wait_for_address(start(0, None, first_args), stop=stop_requested)
        others = [start(index, address, []) for index in range(1, on_time)]
        wait_for_ready(others, timeout_s=120.0, stop=stop_requested)  # a peer that can't join ends the launch
        print(f"swarm started: {on_time} peers, the first at {address}", flush=True)
        if getattr(args, "monitor_port", 0):
            host = getattr(args, "monitor_host", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")
            print(f"swarm monitor (served by peer0): http://{host}:{args.monitor_port}/", flush=True)
        pending = list(range(on_time, args.peers))
        while True:
            while pending and time.monotonic() - started >= args.late_after_s:
                start(pending.pop(0), address, [])
            for peer in peers:
                if not peer.alive and peer.name not in exited:
                    exited[peer.name] = peer.process.returncode
                    if peer.process.returncode != 0:
                        failures.append(f"{peer.name} exited with code {peer.process.returncode}: {last_log_line(peer)}")
            view.show(peers)
            if stopping["signal"] is not None or (not pending and not any(p.alive for p in peers)):
                break
            time.sleep(1.0)
    except RuntimeError as e:
        failures.append(str(e))
    finally:
        if stopping["signal"] is not None:
            print("stopping the swarm ...", flush=True)
        for peer in peers:
            peer.terminate()  # all at once, so that none trains on alone meanwhile
        for peer in peers:
            peer.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    view.show(peers, force=True)
    exit_codes = {p.name: p.process.returncode for p in peers}
    extra = dict(peers_started=len(peers), wall_time_s=round(time.monotonic() - started, 1), exit_codes=exit_codes,
                 peer_args=peer_args, failures=failures)
    if wan is not None:
        extra["wan"] = [dict(link, wire_bytes_sent=sent, wire_bytes_received=received)
                        for link, (sent, received) in zip(wan.describe(), map(wan.wire_bytes, range(len(peers))))]
    report = build_report({p.name: p.metrics_file for p in peers}, extra=extra)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    if report["peers"]:
        plot_report(report, out_dir / "report.png")
    _print_summary(report, out_dir)
    for failure in failures:
        print(f"{prog}: error: {failure}", file=sys.stderr, flush=True)
    return 1 if failures else 0


def _print_summary(report: dict, out_dir: Path) -> None:
    print(f"invariant 1 (identical global params and momentum per outer step): {invariant_1_status(report)}")
    if report["initial_eval_loss"] is not None:
        print(f"eval loss: {report['initial_eval_loss']:.3f} (untrained) -> {report['final_eval_loss']:.3f}")
    for name, peer in sorted(report["peers"].items()):
        healing = f", {peer['forks_healed']} forks healed" if peer["forks_healed"] else ""
        mismatches = f", {peer['arithmetic_mismatches']} outer steps computed otherwise" if peer["arithmetic_mismatches"] else ""
        print(f"  {name}: outer step {peer['final_outer_step']}, {peer['tokens']:,} tokens, "
              f"{peer['tokens_per_s']:.0f} tok/s, blocked {100 * (peer['blocked_fraction'] or 0):.1f}%, "
              f"{peer['bytes_sent_per_round'] or 0:,} B sent/round, group {peer['mean_group_size']}{healing}{mismatches}")
    for link in report.get("wan", []):
        cap = f"{link['bandwidth_mbit']} Mbit/s" if link["bandwidth_mbit"] else "uncapped"
        print(f"  peer{link['peer']} link ({cap}, {link['address']}): {link['wire_bytes_sent']:,} B sent, "
              f"{link['wire_bytes_received']:,} B received on the wire")
    print(f"report: {out_dir / 'report.json'}  plot: {out_dir / 'report.png'}", flush=True)
