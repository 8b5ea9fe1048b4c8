"""A local multiprocess swarm: N peer processes on 127.0.0.1, live progress, clean stop, run report.

Each peer runs ``python -m p2p_diloco.cli peer`` in its own process group (cli/peer_processes.py: its averager,
DHT process and ``p2pd`` go with it), so that stopping or killing a peer never leaves children behind. The first
peer starts the swarm; the others join through the address it writes to its ready file (cli/ready.py). The peers
start training together (``--wait-for-peers``), and a peer that fails to join or exits with an error is named
and makes the launcher exit non-zero. This module holds no training logic.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, resolve_config
from p2p_diloco.cli.peer import fail
from p2p_diloco.cli.peer_processes import (
    PeerProcess,
    joining,
    last_log_line,
    start_peer,
    wait_for_address,
    wait_for_ready,
)
from p2p_diloco.core import extras
from p2p_diloco.observe.report import build_report, invariant_1_status, plot_report, read_metrics


def _progress(peer: PeerProcess) -> tuple[tuple, str]:
    """(what changed, one line) of a peer: its state and last metrics record."""
    records = read_metrics(peer.metrics_file) if peer.metrics_file.exists() else []
    state = "running" if peer.alive else f"exited({peer.process.returncode})"
    if not records:
        return (state, 0), f"{peer.name:>7} {state:<11} starting"
    last = records[-1]
    loss = last.get("eval_loss") if last.get("eval_loss") is not None else last.get("loss")
    loss_text = f"{loss:6.3f}" if loss is not None else "   -  "
    blocked = last["blocked_s"] / max(1e-9, last["blocked_s"] + last["compute_s"])
    line = (
        f"{peer.name:>7} {state:<11} outer_step {last['outer_step']:>4}  loss {loss_text}  "
        f"{last['tokens_per_s']:>8.0f} tok/s  group {last['group_size']}  blocked {100 * blocked:4.1f}%  "
        f"sha {last['global_sha256'][:10]}  {last['status']}"
    )
    return (state, len(records)), line


class ProgressView:
    """On a terminal, one line per peer redrawn in place. Elsewhere (a log file, CI, nohup) a peer's line is
    printed once per new metrics record (an outer step, or a failed round) and when it starts or exits: a log
    that reads top to bottom, nothing repeated."""

    def __init__(self, stream: TextIO | None = None):
        self._stream = stream or sys.stdout
        self._tty = self._stream.isatty()
        self._lines, self._shown = 0, {}

    def show(self, peers: list[PeerProcess]) -> None:
        progress = [(p.name, *_progress(p)) for p in peers]
        if self._tty:
            if self._lines:
                self._stream.write(f"\x1b[{self._lines}F")
            self._stream.write("".join(f"\x1b[2K{line}\n" for _, _, line in progress))
            self._lines = len(progress)
        else:
            for name, key, line in progress:
                if self._shown.get(name) != key:
                    self._shown[name] = key
                    self._stream.write(f"{line}\n")
        self._stream.flush()


def swarm_main(argv: list[str] | None = None, prog: str = "swarm.py") -> int:
    parser = OneLineParser(prog=prog, description="Run a local p2p-diloco swarm of N peer processes and write a report.")
    parser.add_argument("--peers", type=int, default=3, help="number of peer processes (default 3)")
    parser.add_argument("--out", default="runs/swarm", help="folder for metrics, logs, report.json and report.png")
    parser.add_argument("--late-peers", type=int, default=0, help="of the N peers, how many join late (default 0)")
    parser.add_argument("--late-after-s", type=float, default=60.0, help="seconds after the start that late peers join")
    parser.add_argument("--peer-env", nargs="+", default=[], metavar="PEER:NAME=VALUE",
                        help="an environment variable for one peer (numbered from 0), e.g. 1:ATEN_CPU_CAPABILITY=default "
                        "to run peer1 on torch's kernels for CPUs without vector units")
    parser.add_argument("--peer-flag", nargs="+", default=[], metavar="PEER:--FLAG=VALUE",
                        help="a peer flag for one peer (numbered from 0), after the shared ones, e.g. "
                        "1:--inner-optimizer=muon to run peer1 with Muon islands in a swarm of AdamW ones")
    parser.add_argument("--config", metavar="FILE", help="TOML config passed to every peer")
    add_peer_flags(parser)
    args = parser.parse_args(argv)
    if args.peers < 1 or not 0 <= args.late_peers < args.peers:
        return fail(prog, "--peers must be >= 1 and --late-peers in [0, peers)")
    try:
        args.peer_env = parse_peer_env(args.peer_env, args.peers)
        args.peer_flag = parse_peer_flags(args.peer_flag, args.peers)
    except ValueError as e:
        return fail(prog, str(e))
    peer_args = peer_args_without(argv or [], SWARM_FLAGS)
    try:
        resolve_config(args)  # validate the peers' flags once, here, before starting anything
        for index, flags in args.peer_flag.items():  # and each peer's own on top of them
            own = OneLineParser(prog=f"{prog} (peer{index}'s flags)")
            own.add_argument("--config")
            add_peer_flags(own)
            resolve_config(own.parse_args([*peer_args, *flags]))
    except ValueError as e:
        return fail(prog, str(e))
    if not any(a.startswith("--max-time-s") or a.startswith("--max-outer-steps") for a in peer_args):
        peer_args += ["--max-time-s", "180"]
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # --out names a file, or a folder we may not write in
        return fail(prog, f"cannot use --out {out_dir}: {e.strerror or e}")
    return run_swarm(args, peer_args, out_dir, prog)


SWARM_FLAGS = {"--peers", "--out", "--late-peers", "--late-after-s", "--peer-env", "--peer-flag"}


def parse_peer_flags(items: list[str], peers: int) -> dict[int, list[str]]:
    """``PEER:--FLAG=VALUE`` (or ``PEER:--FLAG`` for a switch) items -> {peer index: [flags]}; ValueError naming a
    malformed item. The flags themselves are checked as a peer would check them, by the caller."""
    found: dict[int, list[str]] = {}
    for item in items:
        index, _, flag = item.partition(":")
        if not (index.isdigit() and int(index) < peers and flag.startswith("--") and len(flag) > 2):
            raise ValueError(f"--peer-flag {item!r}: expected PEER:--FLAG=VALUE with PEER in [0, {peers})")
        found.setdefault(int(index), []).append(flag)
    return found


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
    own_flags = getattr(args, "peer_flag", {}) or {}
    try:
        def start(index: int, address: str | None, extra: list[str]) -> PeerProcess:
            place = dict(command_prefix=wan.command_prefix(index), host=wan.host(index)) if wan else {}
            shard = ["--shard-index", str(index), "--num-shards", str(args.peers)]
            flags = [*peer_args, *extra, *own_flags.get(index, []), *shard]
            peer = start_peer(f"peer{index}", out_dir, flags, address, env=envs.get(index), **place)
            peers.append(peer)
            return peer

        def stop_requested() -> bool:
            return stopping["signal"] is not None

        # all at once: the others join the first through its ready file as soon as it is in the swarm
        first = start(0, None, first_args)
        others = [start(index, None, joining(first)) for index in range(1, on_time)]
        address = wait_for_address(first, stop=stop_requested)
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
    view.show(peers)
    exit_codes = {p.name: p.process.returncode for p in peers}
    extra = dict(peers_started=len(peers), wall_time_s=round(time.monotonic() - started, 1), exit_codes=exit_codes,
                 peer_args=peer_args, failures=failures)
    if wan is not None:
        extra["wan"] = [dict(link, wire_bytes_sent=sent, wire_bytes_received=received)
                        for link, (sent, received) in zip(wan.describe(), map(wan.wire_bytes, range(len(peers))))]
    report = build_report({p.name: p.metrics_file for p in peers}, extra=extra)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    if report["peers"] and not extras.missing("plot"):
        plot_report(report, out_dir / "report.png")
    elif report["peers"]:
        print("no report.png: plotting needs matplotlib (pip install 'p2p-diloco[plot]')", flush=True)
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
        lag = "" if peer.get("outer_step_lag") is None else f", outer steps {100 * peer['outer_step_lag']:.0f}% of a round late"
        print(f"  {name}: outer step {peer['final_outer_step']}, {peer['tokens']:,} tokens, "
              f"{peer['tokens_per_s']:.0f} tok/s, blocked {100 * (peer['blocked_fraction'] or 0):.1f}%, "
              f"{peer['bytes_sent_per_round'] or 0:,} B sent/round, group {peer['mean_group_size']}{lag}{healing}{mismatches}")
    for link in report.get("wan", []):
        cap = f"{link['bandwidth_mbit']} Mbit/s" if link["bandwidth_mbit"] else "uncapped"
        print(f"  peer{link['peer']} link ({cap}, {link['address']}): {link['wire_bytes_sent']:,} B sent, "
              f"{link['wire_bytes_received']:,} B received on the wire")
    plot = out_dir / "report.png"
    print(f"report: {out_dir / 'report.json'}" + (f"  plot: {plot}" if plot.exists() else ""), flush=True)
