"""Chaos: a local swarm whose peers are killed (SIGKILL) or frozen (SIGSTOP) on a schedule and come back,
beside a calm swarm of the same peers; then what it cost.

Every peer runs with ``--checkpoint-dir`` and ``--checkpoint-every 1``. A killed peer is restarted with
``--resume`` after ``restart_after_s`` (joining through whichever peers are up); a frozen one is thawed
(SIGCONT) after the same time. The whole process group gets the signal: trainer, averager, DHT and ``p2pd``,
like a machine that dies or hangs. Faults never take down the last two peers that are up.

Figures (``analyse``), all from the peers' own metrics files and the fault log:

- *survivors' goodput*: compute time / wall time of the peers that were up and not recovering, over every
  interval between two of their records (an interval that overlaps the peer's own fault or recovery is left
  out); *swarm goodput*: all compute time / (peers x duration), downtime and restarts included;
- *longest stall*: the longest single wait of each peer's training loop (``longest_block_s``), survivors only;
  *survivors' blocked time*: all of each peer's waits while a survivor, added up (invariant 3 bounds it by one
  timeout per fault, plus the short waits of calm rounds);
- *time to contribute*: from a restart (or thaw) to the peer's first averaging that succeeded;
- invariant 1 over every record of both runs, NaN anywhere, checkpoints that could not be resumed;
- final eval loss of the global params, chaotic vs calm.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from p2p_diloco.cli.peer_processes import PeerProcess, joining, start_peer, wait_for_address
from p2p_diloco.core import checkpoint
from p2p_diloco.observe.report import check_invariant_1, read_metrics, split_lives


@dataclass
class Fault:
    peer: str
    kind: str  # "kill" (SIGKILL, then restart with --resume) or "stop" (SIGSTOP, then SIGCONT)
    at: float  # unix time of the signal
    back_at: float | None = None  # unix time of the restart or thaw
    had_checkpoint: bool = False  # a checkpoint was on disk when the peer was restarted


class ChaosSwarm:
    """Peers on 127.0.0.1 with per-peer checkpoint folders; kill/freeze/restart/thaw by name."""

    def __init__(self, out_dir: Path, flags: list[str], peers: int, max_time_s: float):
        self.out_dir, self.flags, self.count = out_dir, list(flags), peers
        self.max_time_s = max_time_s  # each peer also stops by itself after this, should the driver die
        self.started_at = time.time()
        self.processes: dict[str, PeerProcess] = {}
        self.addresses: dict[str, str] = {}
        self.down: dict[str, str] = {}  # name -> "kill" | "stop"
        self.lives: dict[str, int] = {}
        out_dir.mkdir(parents=True, exist_ok=True)
        # a rerun into the same folder starts clean: a peer refuses to start fresh over checkpoints (and, restarted
        # with --resume, would otherwise pick up the previous run's)
        shutil.rmtree(self.out_dir / "checkpoints", ignore_errors=True)

    def checkpoint_dir(self, name: str) -> Path:
        return self.out_dir / "checkpoints" / name

    def _flags(self, name: str, index: int) -> list[str]:
        remaining = max(30.0, self.max_time_s - (time.time() - self.started_at))
        return [
            "--eval-every", "1", *self.flags,  # a held-out loss at every outer step: the run's curve
            "--shard-index", str(index), "--num-shards", str(self.count),
            "--checkpoint-dir", str(self.checkpoint_dir(name)), "--checkpoint-every", "1",
            "--max-time-s", f"{remaining:.0f}",
        ]

    def start_all(self) -> None:
        for index in range(self.count):
            name = f"peer{index}"
            # the first start only: all begin training together (a peer that starts seconds early trains alone and is
            # outvoted back to the start, docs/design.md §4); a restart joins whoever is there
            flags = [*self._flags(name, index), "--wait-for-peers", str(self.count)]
            if index > 0:  # started together: the others join the first once it is in the swarm
                flags += joining(self.processes["peer0"])
            self.processes[name], self.lives[name] = start_peer(name, self.out_dir, flags, None), 1
        for name, peer in self.processes.items():
            self.addresses[name] = wait_for_address(peer)

    def up(self) -> list[str]:
        return [name for name, peer in self.processes.items() if peer.alive and name not in self.down]

    def fault(self, name: str, kind: str) -> Fault:
        peer = self.processes[name]
        fault = Fault(name, kind, time.time())
        if kind == "kill":
            peer.signal_group(signal.SIGKILL)  # trainer, averager, DHT and p2pd at once: a machine gone
            peer.process.wait(timeout=30)
        else:
            peer.signal_group(signal.SIGSTOP)  # frozen with its sockets open: a machine that hangs
        self.down[name] = kind
        return fault

    def recover(self, fault: Fault) -> None:
        name = fault.peer
        fault.back_at = time.time()  # the restart (or thaw) begins: time to contribute counts from here
        if fault.kind == "kill":
            fault.had_checkpoint = checkpoint.newest(self.checkpoint_dir(name)) is not None
            initial = [address for other, address in self.addresses.items() if other in self.up()]
            index = int(name.removeprefix("peer"))
            peer = start_peer(name, self.out_dir, [*self._flags(name, index), "--resume"], initial, append=True)
            self.processes[name] = peer
            self.lives[name] += 1
            self.addresses[name] = wait_for_address(peer)  # the restart's own ready file
        else:
            self.processes[name].signal_group(signal.SIGCONT)
        del self.down[name]

    def stop_all(self) -> dict[str, int | None]:
        for name in list(self.down):
            self.processes[name].signal_group(signal.SIGCONT)  # a frozen peer cannot handle SIGTERM
        for peer in self.processes.values():
            peer.terminate()
        return {name: peer.stop(grace_s=40) for name, peer in self.processes.items()}


def run_swarm(
    out_dir: Path,
    flags: list[str],
    peers: int,
    duration_s: float,
    kill_every_s: float | None,
    restart_after_s: float,
    stop_fraction: float,
    seed: int,
    progress: Any = None,
    settle_s: float = 30.0,
) -> dict[str, Any]:
    """Run one swarm for ``duration_s`` (faults every ``kill_every_s``, none if None); return its fault log.

    No fault starts in the last ``restart_after_s + settle_s`` seconds, so that every faulted peer has the
    time to come back and contribute before the end (what the run measures)."""
    rng = random.Random(seed)
    swarm = ChaosSwarm(out_dir, flags, peers, max_time_s=duration_s + 120)
    faults: list[Fault] = []
    try:
        swarm.start_all()
        began = time.time()
        next_fault = began + kill_every_s if kill_every_s else math.inf
        while time.time() < began + duration_s:
            now = time.time()
            for fault in faults:
                if fault.back_at is None and now >= fault.at + restart_after_s:
                    swarm.recover(fault)
            candidates = swarm.up()
            if now >= next_fault and now < began + duration_s - restart_after_s - settle_s:
                next_fault += kill_every_s or math.inf
                if len(candidates) > 2:
                    kind = "stop" if rng.random() < stop_fraction else "kill"
                    faults.append(swarm.fault(rng.choice(candidates), kind))
                    if progress:
                        progress(f"{now - began:6.0f} s  {faults[-1].kind} {faults[-1].peer}")
            for name, peer in swarm.processes.items():
                if not peer.alive and name not in swarm.down:
                    raise RuntimeError(f"{name} exited by itself (code {peer.process.returncode}); see {peer.log_file}")
            time.sleep(0.25)
        ended = time.time()
    finally:
        exit_codes = swarm.stop_all()
    return dict(
        began=began,
        ended=ended,
        faults=[asdict(f) for f in faults],
        exit_codes=exit_codes,
        lives=swarm.lives,
        metrics={name: str(p.metrics_file) for name, p in swarm.processes.items()},
        checkpoints={name: str(swarm.checkpoint_dir(name)) for name in swarm.processes},
    )


def _final_eval(records_by_peer: dict[str, list[dict]]) -> float | None:
    evaluated = [r for records in records_by_peer.values() for r in records if r.get("eval_loss") is not None]
    if not evaluated:
        return None
    last = max(r["outer_step"] for r in evaluated)
    return min(r["eval_loss"] for r in evaluated if r["outer_step"] == last)


def analyse(run: dict[str, Any], averaging_timeout_s: float) -> dict[str, Any]:
    """The figures of the module docstring for one run of ``run_swarm``."""
    records = {name: read_metrics(path) for name, path in run["metrics"].items() if Path(path).exists()}
    faults = run["faults"]
    windows: dict[str, list[tuple[float, float]]] = {name: [] for name in records}  # fault -> contributing again
    restarts = []
    for fault in faults:
        back = fault["back_at"] or run["ended"]
        first_ok = next(
            (r["unix_time"] for r in records.get(fault["peer"], []) if r.get("status") == "ok" and r["unix_time"] > back),
            None,
        )
        # a restart cut short by the peer's next fault never had its chance: reported, but not timed
        next_fault = min((f["at"] for f in faults if f["peer"] == fault["peer"] and f["at"] > fault["at"]), default=math.inf)
        interrupted = next_fault < (first_ok if first_ok is not None else math.inf)
        windows[fault["peer"]].append((fault["at"], min(next_fault, first_ok if first_ok is not None else math.inf)))
        if interrupted:
            first_ok = None
        resumed = None
        if fault["kind"] == "kill" and fault["back_at"] is not None:
            init = next((r for r in records.get(fault["peer"], []) if r.get("status") == "init" and r["unix_time"] > back), None)
            if init is not None and init["unix_time"] < next_fault:  # this restart got as far as training
                resumed = str(init.get("reason", "")).startswith("resumed from")
        restarts.append(dict(
            peer=fault["peer"], kind=fault["kind"], at_s=round(fault["at"] - run["began"], 1),
            down_s=round(back - fault["at"], 1),
            to_first_contribution_s=round(first_ok - back, 1) if first_ok else None,
            interrupted_by_next_fault=interrupted,
            resumed_from_checkpoint=resumed, had_checkpoint=fault["had_checkpoint"],
        ))
    compute = wall = 0.0
    longest_stall: dict[str, float] = {}
    blocked: dict[str, float] = {}  # each peer's training loop blocked on the network while a survivor, in all
    for name, peer_records in records.items():
        stall = blocked_s = 0.0
        for life in split_lives(peer_records):
            for before, after in zip(life, life[1:]):
                start, end = before["unix_time"], after["unix_time"]
                if any(start < w_end and end > w_start for w_start, w_end in windows[name]):
                    continue  # the peer's own fault or recovery: not a survivor then
                if end > run["ended"]:
                    # the harness was stopping the peers: a last round that waits for them is no fault's cost (nor,
                    # then, is a wait that began in the run's last seconds seen: its end is confounded with the stop)
                    continue
                compute += after["compute_s"] - before["compute_s"]
                wall += end - start
                stall = max(stall, after.get("longest_block_s", 0.0))
                blocked_s += after.get("interval_blocked_s", 0.0)
        longest_stall[name] = round(stall, 2)
        blocked[name] = round(blocked_s, 2)
    total_compute = sum(  # within the run: what a peer computed while the harness stopped it is past its end
        max((r["compute_s"] for r in life if r["unix_time"] <= run["ended"]), default=0.0)
        for peer_records in records.values() for life in split_lives(peer_records)
    )
    numbers = [
        v for peer_records in records.values() for r in peer_records for v in (r.get("loss"), r.get("eval_loss"))
        if v is not None
    ]
    unreadable = []
    for name, directory in run["checkpoints"].items():
        newest = checkpoint.newest(directory)
        try:
            if newest is None:
                raise ValueError(f"no checkpoint in {directory}")
            checkpoint.load(newest)
        except ValueError as e:
            unreadable.append(f"{name}: {e}")
    contributed = [r["to_first_contribution_s"] for r in restarts if not r["interrupted_by_next_fault"]]
    return dict(
        duration_s=round(run["ended"] - run["began"], 1),
        faults=len(faults),
        survivors_goodput=round(compute / wall, 4) if wall else None,
        swarm_goodput=round(total_compute / (len(records) * (run["ended"] - run["began"])), 4) if records else None,
        longest_stall_s=longest_stall,
        survivors_blocked_s=blocked,
        stall_bound_s=averaging_timeout_s,
        restarts=restarts,
        every_restart_contributed=all(c is not None for c in contributed),
        longest_time_to_contribute_s=max((c for c in contributed if c is not None), default=None),
        lost_checkpoints=sum(1 for r in restarts if r["had_checkpoint"] and r["resumed_from_checkpoint"] is False),
        unreadable_checkpoints=unreadable,
        non_finite_values=sum(1 for v in numbers if not math.isfinite(v)),
        invariant_1=check_invariant_1(records),
        final_eval_loss=_final_eval(records),
        final_outer_step=max((r["outer_step"] for rs in records.values() for r in rs), default=0),
        exit_codes=run["exit_codes"],
        records=records,
    )


def plot(chaotic: dict[str, Any], calm: dict[str, Any] | None, run: dict[str, Any], path: Path) -> None:
    """Timeline: who was up, each peer's outer step, and the eval loss of the chaotic and calm runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    began, ended = run["began"], run["ended"]
    names = sorted(chaotic["records"])
    figure, (alive, steps, losses) = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    for row, name in enumerate(names):
        alive.broken_barh([(0, ended - began)], (row - 0.35, 0.7), color="tab:green", alpha=0.6)
        for fault in run["faults"]:
            if fault["peer"] == name:
                back = (fault["back_at"] or ended) - began
                color = "tab:red" if fault["kind"] == "kill" else "tab:orange"
                alive.broken_barh([(fault["at"] - began, back - (fault["at"] - began))], (row - 0.35, 0.7), color=color)
    alive.set_yticks(range(len(names)), names)
    alive.set_title("up (green), killed until restarted (red), frozen until thawed (orange)")
    for index, name in enumerate(names):
        records = chaotic["records"][name]
        steps.plot([r["unix_time"] - began for r in records], [r["outer_step"] for r in records], ".-", color=f"C{index}", label=name)
    steps.set_ylabel("outer step")
    steps.legend(fontsize=8)
    for label, result, style in (("chaotic", chaotic, "-"), ("calm", calm, "--")):
        if not result:
            continue
        start = min(r["unix_time"] for rs in result["records"].values() for r in rs)
        best: dict[int, tuple[float, float]] = {}
        for rs in result["records"].values():
            for r in rs:
                if r.get("eval_loss") is not None and r["outer_step"] not in best:
                    best[r["outer_step"]] = (r["unix_time"] - start, r["eval_loss"])
        points = sorted(best.values())
        losses.plot([p[0] for p in points], [p[1] for p in points], style, marker=".", label=f"{label} (final {result['final_eval_loss']:.3f})")
    losses.set_ylabel("eval loss of the global params")
    losses.set_xlabel("seconds since the swarm started")
    losses.legend(fontsize=8)
    for axis in (alive, steps, losses):
        axis.grid(alpha=0.3)
    figure.suptitle(f"chaos: {chaotic['faults']} faults, survivors' goodput {100 * (chaotic['survivors_goodput'] or 0):.1f}%, "
                    f"invariant 1 {'held' if chaotic['invariant_1']['held'] else 'VIOLATED'}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_result(out_dir: Path, result: dict[str, Any]) -> Path:
    path = out_dir / "chaos.json"
    slim = {k: ({kk: vv for kk, vv in v.items() if kk != "records"} if isinstance(v, dict) else v) for k, v in result.items()}
    path.write_text(json.dumps(slim, indent=1))
    return path


def main(argv: list[str] | None = None, prog: str = "chaos.py") -> int:
    import sys

    from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, resolve_config

    parser = OneLineParser(prog=prog, description="Kill and freeze peers of a local swarm on a schedule, restart them, "
                            "and compare with a calm swarm; writes OUT/chaos.json and OUT/chaos.png.")
    own = parser.add_argument_group("chaos")
    own.add_argument("--peers", type=int, default=4, help="peers in the swarm (default 4)")
    own.add_argument("--duration-s", type=float, default=300, help="seconds each swarm trains (default 300)")
    own.add_argument("--kill-every-s", type=float, default=30, help="seconds between faults (default 30)")
    own.add_argument("--restart-after-s", type=float, default=10, help="seconds a faulted peer stays down (default 10)")
    own.add_argument("--stop-fraction", type=float, default=0.3, help="share of faults that freeze (SIGSTOP) instead of kill (default 0.3)")
    own.add_argument("--fault-seed", type=int, default=0, help="seed of the fault schedule (default 0)")
    own.add_argument("--settle-s", type=float, default=30, help="no fault starts in the last restart-after + this many seconds, so every faulted peer can contribute again before the end (default 30)")
    own.add_argument("--no-calm", action="store_true", help="skip the calm comparison run")
    own.add_argument("--out", default="runs/chaos", help="output folder (default runs/chaos)")
    own.add_argument("--reanalyse", action="store_true", help="do not run anything: recompute OUT/chaos.json and OUT/chaos.png from the fault log and metrics files a previous run left in OUT")
    add_peer_flags(parser)
    args = parser.parse_args(argv)
    problems = [
        (args.peers < 3, "--peers must be >= 3 (faults never take down the last two peers)"),
        (min(args.duration_s, args.kill_every_s, args.restart_after_s) <= 0 or args.settle_s < 0, "durations must be > 0"),
        (not 0 <= args.stop_fraction <= 1, "--stop-fraction must be in [0, 1]"),
    ]
    for bad, message in problems:
        if bad:
            print(f"{prog}: error: {message}", file=sys.stderr)
            return 2
    try:
        config = resolve_config(args)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    own_flags = {"--peers", "--duration-s", "--kill-every-s", "--restart-after-s", "--stop-fraction", "--fault-seed", "--settle-s", "--no-calm", "--out", "--reanalyse"}
    peer_flags, skip = [], False
    for token in argv if argv is not None else sys.argv[1:]:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in own_flags:
            skip = "=" not in token and name not in ("--no-calm", "--reanalyse")
            continue
        peer_flags.append(token)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timeout = config.swarm.averaging_timeout_s
    if args.reanalyse:
        return _reanalyse(out, timeout, prog)
    result: dict[str, Any] = dict(command=" ".join([prog, *(argv if argv is not None else sys.argv[1:])]))
    print(f"chaotic swarm: {args.peers} peers, {args.duration_s:.0f} s, a fault every {args.kill_every_s:.0f} s, "
          f"back after {args.restart_after_s:.0f} s", flush=True)
    run = run_swarm(out / "chaotic", peer_flags, args.peers, args.duration_s, args.kill_every_s, args.restart_after_s,
                    args.stop_fraction, args.fault_seed, progress=lambda line: print(line, flush=True), settle_s=args.settle_s)
    result["chaotic"] = analyse(run, timeout)
    result["chaotic_run"] = run  # the fault log and times, to re-analyse from the metrics files
    if not args.no_calm:
        print(f"calm swarm: {args.peers} peers, {args.duration_s:.0f} s, no faults", flush=True)
        calm_run = run_swarm(out / "calm", peer_flags, args.peers, args.duration_s, None, args.restart_after_s, 0.0, args.fault_seed)
        result["calm"] = analyse(calm_run, timeout)
        result["calm_run"] = calm_run
    return _finish(out, result, run, timeout)


def _reanalyse(out: Path, timeout: float, prog: str) -> int:
    import sys

    try:
        previous = json.loads((out / "chaos.json").read_text())
        run = previous["chaotic_run"]
    except (OSError, ValueError, KeyError) as e:
        print(f"{prog}: error: no chaos run to re-analyse in {out} ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    result = dict(previous, chaotic=analyse(run, timeout))
    if "calm_run" in previous:
        result["calm"] = analyse(previous["calm_run"], timeout)
    return _finish(out, result, run, timeout)


def _finish(out: Path, result: dict[str, Any], run: dict[str, Any], timeout: float) -> int:
    if result.get("calm", {}).get("final_eval_loss") and result["chaotic"]["final_eval_loss"]:
        result["eval_loss_vs_calm"] = round(result["chaotic"]["final_eval_loss"] / result["calm"]["final_eval_loss"] - 1, 4)
    plot(result["chaotic"], result.get("calm"), run, out / "chaos.png")
    path = write_result(out, result)
    chaotic = result["chaotic"]
    print(f"faults {chaotic['faults']}; survivors' goodput {chaotic['survivors_goodput']}; swarm goodput {chaotic['swarm_goodput']}; "
          f"longest survivor stall {max(chaotic['longest_stall_s'].values(), default=0):.1f} s (bound {timeout:.0f} s); "
          f"most blocked survivor {max(chaotic['survivors_blocked_s'].values(), default=0):.1f} s in all; "
          f"longest time to contribute again {chaotic['longest_time_to_contribute_s']} s; "
          f"invariant 1 {'held' if chaotic['invariant_1']['held'] else 'VIOLATED'}; non-finite {chaotic['non_finite_values']}; "
          f"lost checkpoints {chaotic['lost_checkpoints']}; eval loss {chaotic['final_eval_loss']}"
          + (f" vs calm {result['calm']['final_eval_loss']} ({result['eval_loss_vs_calm']:+.2%})" if "eval_loss_vs_calm" in result else ""))
    print(f"report: {path}  timeline: {out / 'chaos.png'}", flush=True)
    return 0
