"""Calibration: the inputs of our own protocol, read from a real run's metrics, and a replay of that run.

A run folder is either a chaos folder (``OUT/chaos.json`` from ``scripts/chaos.py``, whose ``chaotic_run``
holds the fault log and the metrics files) or a plain swarm folder (``peer*.jsonl`` from
``scripts/swarm.py``, no faults). From the records (one per outer step per peer, see train/recorder.py):

- *compute fraction*: compute / wall over the training intervals between two records of a peer, leaving out
  its own fault windows (as ``chaos.analyse`` does for its survivors' goodput) and its join downloads;
- *round length*: the mean wall time of those intervals (a record per outer step; a checkpoint per outer step
  in chaos runs, so it is also the save interval: the work a killed peer loses);
- *process start*: from a killed peer's restart to its new process's first record;
- *rejoin*: from a (re)started process's first record to training again (DHT reads and the state download),
  and the download's own blocked time;
- *neighbour stall*: the extra blocked time of the other peers in the interval where a peer fails;
- the measured swarm goodput, computed as ``chaos.analyse`` computes it.

``replay`` runs the goodput simulator on the recorded fault log with those inputs; ``decoupled_method`` turns
them into a method for projections. Reading only: nothing here writes to the run folder.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.sim.goodput import FaultConfig, GoodputResult, Interruption, MethodConfig, simulate
from p2p_diloco.observe.report import ROUND_STATUSES, read_metrics, split_lives


class CalibrationError(ValueError):
    """The folder holds no run this module can read; the message says what is missing."""


@dataclass(frozen=True)
class RecordedFault:
    peer: str
    kind: str  # "kill" or "stop", as the chaos harness logs it
    at_s: float  # seconds after the run began
    down_s: float  # from the fault to training again (measured where the run shows it, else estimated)


@dataclass(frozen=True)
class Calibration:
    source: str  # what was read
    peers: tuple[str, ...]
    duration_s: float
    compute_fraction: float
    round_s: float
    process_start_s: float | None  # None: no killed peer restarted in this run
    rejoin_s: float
    state_download_s: float
    neighbour_stall_s: float
    startup_s: float
    faults: tuple[RecordedFault, ...]
    measured_swarm_goodput: float  # chaos.analyse's figure: the peers' recorded compute / (peers x duration)
    compute_before_start_s: float  # recorded compute done before the run's start (peers start before it)
    frozen_counted_s: float  # a peer frozen mid-step counts the frozen time as compute: the excess, estimated
    unrecorded_tail_s: float  # compute after each peer's last record, not in the recorded figure (estimated)
    window_goodput: float  # compute inside [start, end] / (peers x duration): what the simulator computes

    def to_dict(self) -> dict:
        return asdict(self)


def _mean(values: list[float], default: float = 0.0) -> float:
    return statistics.fmean(values) if values else default


def _load_run(run_dir: Path, part: str) -> tuple[str, dict, dict[str, list[dict]]]:
    """(source, run with began/ended/faults, records by peer) from a chaos or swarm folder."""
    chaos_file = run_dir / "chaos.json"
    if chaos_file.exists():
        try:
            run = json.loads(chaos_file.read_text())[f"{part}_run"]
            paths = {name: Path(path) for name, path in run["metrics"].items()}
        except (ValueError, KeyError, TypeError) as e:
            raise CalibrationError(f"{chaos_file} has no readable fault log ({type(e).__name__}: {e}); "
                                   "re-run scripts/chaos.py, or point at a swarm folder of peer*.jsonl") from None
        for name, path in paths.items():
            if not path.exists():  # the log names paths relative to where chaos ran; try the folder itself
                paths[name] = run_dir / part / path.name
        records = {name: read_metrics(path) for name, path in paths.items() if path.exists()}
        source = f"chaos run {chaos_file} ({part})"
    else:
        files = sorted(run_dir.glob("peer*.jsonl"))
        records = {path.stem: read_metrics(path) for path in files}
        times = [r["unix_time"] for rs in records.values() for r in rs if "unix_time" in r]
        if not times:
            raise CalibrationError(f"no chaos.json and no peer*.jsonl metrics in {run_dir}")
        run = dict(began=min(times), ended=max(times), faults=[])
        source = f"swarm run {run_dir} (no faults)"
    records = {name: rs for name, rs in sorted(records.items()) if rs}
    if not records:
        raise CalibrationError(f"the metrics files of {run_dir} hold no records")
    return source, run, records


def _own_windows(run: dict, records: dict[str, list[dict]]) -> dict[str, list[tuple[float, float]]]:
    """Per peer: from each of its faults to its first record after coming back that is not a process start."""
    windows: dict[str, list[tuple[float, float]]] = {name: [] for name in records}
    for fault in run["faults"]:
        back = fault.get("back_at") or run["ended"]
        after = next((r["unix_time"] for r in records.get(fault["peer"], [])
                      if r["unix_time"] > back and r.get("status") != "init"), run["ended"])
        windows.setdefault(fault["peer"], []).append((fault["at"], after))
    return windows


def _intervals(records: dict[str, list[dict]],
               windows: dict[str, list[tuple[float, float]]]) -> Iterator[tuple[str, str, dict, dict]]:
    """(peer, kind, before, after) for consecutive records of one life outside the peer's fault windows;
    kind is "join" for a start's download (init -> caught_up), else "train"."""
    for name, peer_records in records.items():
        for life in split_lives(peer_records):
            for before, after in zip(life, life[1:]):
                start, end = before["unix_time"], after["unix_time"]
                if before.get("status") == "init" and after.get("status") == "caught_up":
                    # a (re)start's download closes the peer's own fault window: kept unless a fault hit it
                    if not any(start < w_start < end for w_start, _ in windows[name]):
                        yield name, "join", before, after
                elif not any(start < w_end and end > w_start for w_start, w_end in windows[name]):
                    yield name, "train", before, after


def _process_starts(run: dict, records: dict[str, list[dict]]) -> list[float]:
    starts = []
    for fault in run["faults"]:
        if fault["kind"] != "kill" or not fault.get("back_at"):
            continue
        later = [f["at"] for f in run["faults"] if f["peer"] == fault["peer"] and f["at"] > fault["at"]]
        init = next((r["unix_time"] for r in records.get(fault["peer"], [])
                     if r.get("status") == "init" and r["unix_time"] > fault["back_at"]), None)
        if init is not None and init < min(later, default=float("inf")):
            starts.append(init - fault["back_at"])
    return starts


def _neighbour_stall(run: dict, trains: list[tuple[str, dict, dict]]) -> float:
    """Mean extra blocked time of another peer's training interval that contains a fault."""
    blocked = [after.get("blocked_s", 0.0) - before.get("blocked_s", 0.0) for _, before, after in trains]
    baseline = _mean(blocked)
    extra = [after.get("blocked_s", 0.0) - before.get("blocked_s", 0.0) - baseline
             for fault in run["faults"] for name, before, after in trains
             if name != fault["peer"] and before["unix_time"] <= fault["at"] < after["unix_time"]]
    return max(0.0, _mean(extra))


def _recorded_faults(run: dict, records: dict[str, list[dict]], estimate_kill_s: float) -> tuple[RecordedFault, ...]:
    faults = []
    for fault in run["faults"]:
        back = fault.get("back_at") or run["ended"]
        later = min((f["at"] for f in run["faults"] if f["peer"] == fault["peer"] and f["at"] > fault["at"]),
                    default=float("inf"))
        training = next((r["unix_time"] for r in records.get(fault["peer"], [])
                         if r["unix_time"] > back and r.get("status") != "init"), None)
        if fault["kind"] == "stop":
            down = back - fault["at"]
        elif training is not None and training < later:
            down = training - fault["at"]  # measured: down, process start, rejoin
        else:
            down = back - fault["at"] + estimate_kill_s  # cut short by the next fault, or the run ended first
        faults.append(RecordedFault(fault["peer"], fault["kind"], round(fault["at"] - run["began"], 3), round(down, 3)))
    return tuple(faults)


def _accounting(run: dict, records: dict[str, list[dict]], fraction: float) -> tuple[float, float, float]:
    """Where the recorded compute and the compute inside the run's window differ, in compute-seconds:
    (done before the start, frozen time counted as compute, done after each peer's last record)."""
    before = frozen = tail = 0.0
    for name, peer_records in records.items():
        for life in split_lives(peer_records):
            for a, b in zip(life, life[1:]):
                wall = b["unix_time"] - a["unix_time"]
                done = b["compute_s"] - a["compute_s"]
                if wall > 0 and a["unix_time"] < run["began"]:
                    before += done * min(1.0, (run["began"] - a["unix_time"]) / wall)
                stops = [f for f in run["faults"] if f["peer"] == name and f["kind"] == "stop"
                         and a["unix_time"] <= f["at"] < b["unix_time"]]
                for f in stops:
                    held = min(b["unix_time"], f.get("back_at") or run["ended"]) - f["at"]
                    frozen += max(0.0, done - fraction * (wall - held))
        last = peer_records[-1]["unix_time"]
        if not any(f["peer"] == name and f["at"] >= last for f in run["faults"]):
            tail += fraction * max(0.0, run["ended"] - last)
    return before, frozen, tail


def _training_start(records: list[dict]) -> float:
    """When a peer first trained: at its start, or after its first state download if it began with one."""
    first = split_lives(records)[0]
    if len(first) > 1 and first[1].get("status") == "caught_up":
        return first[1]["unix_time"]
    return first[0]["unix_time"]


def calibrate(run_dir: str | Path, part: str = "chaotic") -> Calibration:
    """Read a chaos folder (its ``part``: "chaotic" or "calm") or a swarm folder; raise CalibrationError
    saying what is missing if it cannot."""
    if part not in ("chaotic", "calm"):
        raise CalibrationError(f"part must be chaotic or calm, got {part!r}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CalibrationError(f"no such run folder: {run_dir}")
    source, run, records = _load_run(run_dir, part)
    windows = _own_windows(run, records)
    intervals = list(_intervals(records, windows))
    trains = [(name, before, after) for name, kind, before, after in intervals if kind == "train"]
    joins = [(before, after) for _, kind, before, after in intervals if kind == "join"]
    wall = sum(after["unix_time"] - before["unix_time"] for _, before, after in trains)
    compute = sum(after["compute_s"] - before["compute_s"] for _, before, after in trains)
    if wall <= 0:
        raise CalibrationError(f"{source}: no training interval between two records of a peer")
    rounds = [after["unix_time"] - before["unix_time"] for _, before, after in trains
              if after.get("status") in ROUND_STATUSES]
    process_starts = _process_starts(run, records)
    rejoin = _mean([after["unix_time"] - before["unix_time"] for before, after in joins])
    first_training = [_training_start(rs) for rs in records.values()]
    duration = run["ended"] - run["began"]
    total_compute = sum(life[-1].get("compute_s", 0.0) for rs in records.values() for life in split_lives(rs))
    fraction = compute / wall
    before, frozen, tail = _accounting(run, records, fraction)
    return Calibration(
        source=source,
        peers=tuple(records),
        duration_s=round(duration, 3),
        compute_fraction=round(fraction, 4),
        round_s=round(_mean(rounds, default=wall / max(1, len(trains))), 3),
        process_start_s=round(_mean(process_starts), 3) if process_starts else None,
        rejoin_s=round(rejoin, 3),
        state_download_s=round(_mean([after.get("blocked_s", 0.0) - before.get("blocked_s", 0.0) for before, after in joins]), 3),
        neighbour_stall_s=round(_neighbour_stall(run, trains), 3),
        startup_s=round(_mean([max(0.0, t - run["began"]) for t in first_training]), 3),
        faults=_recorded_faults(run, records, _mean(process_starts) + rejoin),
        measured_swarm_goodput=round(total_compute / (len(records) * duration), 4),
        compute_before_start_s=round(before, 2),
        frozen_counted_s=round(frozen, 2),
        unrecorded_tail_s=round(tail, 2),
        window_goodput=round((total_compute - before - frozen + tail) / (len(records) * duration), 4),
    )


def decoupled_method(calibration: Calibration, islands: int, restart_s: float, neighbours: int | None = None,
                     name: str = "decoupled") -> MethodConfig:
    """Our protocol's per-island behaviour as measured, for ``islands`` islands whose hardware takes
    ``restart_s`` to come back; the measured process start and rejoin are added to it."""
    overhead = (calibration.process_start_s or 0.0) + calibration.rejoin_s
    if neighbours is None:
        neighbours = min(islands, len(calibration.peers)) - 1  # one averaging group of the size we measured
    return MethodConfig(
        name=name, groups=islands, restart_s=restart_s + overhead, save_interval_s=calibration.round_s,
        compute_fraction=calibration.compute_fraction,
        neighbours=neighbours if calibration.neighbour_stall_s > 0 else 0,
        neighbour_stall_s=calibration.neighbour_stall_s,
    )


def replay(calibration: Calibration, seed: int = 0) -> GoodputResult:
    """The simulator on the recorded run: one chip per peer, the recorded faults at their recorded times."""
    peers = list(calibration.peers)
    kills = [f.down_s for f in calibration.faults if f.kind == "kill"]
    method = MethodConfig(
        name="decoupled (replay)", groups=len(peers), restart_s=_mean(kills),
        save_interval_s=calibration.round_s, compute_fraction=calibration.compute_fraction,
        neighbours=len(peers) - 1 if calibration.neighbour_stall_s > 0 else 0,
        neighbour_stall_s=calibration.neighbour_stall_s, startup_s=calibration.startup_s,
    )
    trace = [Interruption(f.at_s, peers.index(f.peer), f.down_s, loses_work=f.kind != "stop")
             for f in calibration.faults if f.peer in peers]
    return simulate(method, FaultConfig(), total_chips=len(peers), horizon_s=calibration.duration_s,
                    seed=seed, trace=trace)
