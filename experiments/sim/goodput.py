"""Discrete-event goodput simulator: chips grouped into slices and groups, interrupted at random, recovering.

Goodput = useful compute time / (chips x wall time). ``useful`` is chip-seconds of compute whose result
survived: compute done while a group was running, times the group's compute fraction (the share of running
time not spent waiting on the network or on per-round overheads), minus work lost to an interruption.

The three methods of issue 9 are one engine with three settings (``MethodConfig``):

- **synchronous data parallel** (``sync_dp``): one group of every chip. An interruption stops it; a spare slice
  takes the failed one's place; the job restarts (``restart_s``) from its last checkpoint, losing the work
  done since (checkpoints every ``save_interval_s`` of running time).
- **elastic data parallel** (``elastic_dp``): one group. An interruption stalls everyone ``reform_s`` while the
  failed slice is dropped; the rest go on without it; it comes back after ``repair_s`` and re-joining stalls
  everyone ``rejoin_s``. No work is lost.
- **decoupled islands** (``decoupled``): ``groups`` islands that fail independently. An interrupted island is
  down for ``restart_s`` (restart plus state download) and loses the work since its last completed round
  (``save_interval_s`` = round length, a checkpoint per outer step); the others keep going, except that each
  interruption may stall ``neighbours`` other islands (its averaging partners) ``neighbour_stall_s``. With
  ``elastic=True`` an island handles an interruption like elastic data parallel, but alone: the learners of
  the Decoupled DiLoCo report.

Interruptions arrive as a Poisson process over the chips that are computing (rate = computing chips /
``mtbi_chip_s``); a stalled or restarting group does not fail. A recorded fault log can be replayed instead
(``trace``). Deterministic given the seed.

Deliberately not modelled: learning (whether fewer tokens per outer step or a smaller group learn as well),
stragglers and speed variance, correlated failures (a whole data centre), network partitions, the
bandwidth of a restart's downloads beyond the ``restart_s`` given.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

YEAR_S = 365.0 * 24 * 3600

METHODS = ("sync_dp", "elastic_dp", "decoupled")


@dataclass(frozen=True)
class FaultConfig:
    mtbi_chip_s: float = YEAR_S  # mean time between interruptions of one chip while it computes (s)
    slice_chips: int = 1  # chips one interruption takes out of service: the failure domain
    repair_s: float = 3600.0  # an interrupted slice stays out this long (only elastic methods wait for it)

    def __post_init__(self) -> None:
        if not self.mtbi_chip_s > 0:
            raise ValueError(f"mtbi_chip_s must be > 0 seconds, got {self.mtbi_chip_s}")
        if self.slice_chips < 1:
            raise ValueError(f"slice_chips must be >= 1, got {self.slice_chips}")
        if self.repair_s < 0:
            raise ValueError(f"repair_s must be >= 0 seconds, got {self.repair_s}")


@dataclass(frozen=True)
class MethodConfig:
    name: str  # for reports: sync_dp, elastic_dp, decoupled, or any label
    groups: int = 1  # groups that fail and recover independently: 1 for data parallel, the islands otherwise
    elastic: bool = False  # a group drops an interrupted slice and goes on (else it restarts whole)
    restart_s: float = 0.0  # non-elastic: a group is down this long after an interruption (restart + download)
    save_interval_s: float = 1.0  # non-elastic: running time between save points; work since the last is lost
    reform_s: float = 0.0  # elastic: the group stalls this long to drop an interrupted slice
    rejoin_s: float = 0.0  # elastic: the group stalls this long to take a repaired slice back
    compute_fraction: float = 1.0  # share of a running group's wall time that is compute (0, 1]
    neighbours: int = 0  # other groups one interruption stalls (decoupled: its averaging partners)
    neighbour_stall_s: float = 0.0  # how long each of those stalls (a bounded averaging timeout)
    startup_s: float = 0.0  # every group starts computing this long after t = 0

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"{self.name}: groups must be >= 1, got {self.groups}")
        for field in ("restart_s", "reform_s", "rejoin_s", "neighbour_stall_s", "startup_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"{self.name}: {field} must be >= 0 seconds, got {getattr(self, field)}")
        if not self.save_interval_s > 0:
            raise ValueError(f"{self.name}: save_interval_s must be > 0 seconds, got {self.save_interval_s}")
        if not 0 < self.compute_fraction <= 1:
            raise ValueError(f"{self.name}: compute_fraction must be in (0, 1], got {self.compute_fraction}")
        if not 0 <= self.neighbours <= self.groups - 1:
            raise ValueError(f"{self.name}: neighbours must be in [0, groups - 1 = {self.groups - 1}], got {self.neighbours}")


@dataclass(frozen=True)
class Interruption:
    """One recorded fault to replay: group ``group`` is interrupted at ``at_s``."""

    at_s: float
    group: int
    down_s: float | None = None  # this fault's own downtime instead of restart_s (a measured restart)
    loses_work: bool = True  # False for a freeze (SIGSTOP): the group is down but keeps its progress


@dataclass(frozen=True)
class GoodputResult:
    method: str
    total_chips: int
    groups: int
    horizon_s: float
    interruptions: int
    useful_chip_s: float
    lost_chip_s: float  # compute done, then lost to an interruption (work since the last save point)
    goodput: float  # useful_chip_s / (total_chips x horizon_s)

    def to_dict(self) -> dict:
        return asdict(self)


def sync_dp(restart_s: float, checkpoint_interval_s: float, compute_fraction: float = 1.0) -> MethodConfig:
    return MethodConfig("sync_dp", restart_s=restart_s, save_interval_s=checkpoint_interval_s,
                        compute_fraction=compute_fraction)


def elastic_dp(reform_s: float, rejoin_s: float, compute_fraction: float = 1.0) -> MethodConfig:
    return MethodConfig("elastic_dp", elastic=True, reform_s=reform_s, rejoin_s=rejoin_s,
                        compute_fraction=compute_fraction)


class _Engine:
    """State of every group, and the event loop. Chip-seconds are accumulated lazily, per group."""

    def __init__(self, method: MethodConfig, faults: FaultConfig, total_chips: int, seed: int):
        per_group = total_chips // method.groups
        if total_chips < 1 or total_chips % method.groups or per_group % faults.slice_chips:
            raise ValueError(f"{total_chips} chips do not split into {method.groups} groups of whole "
                             f"{faults.slice_chips}-chip slices; pick a multiple of groups x slice_chips")
        self.method, self.faults = method, faults
        self.slices = per_group // faults.slice_chips  # slices per group when all are in service
        self.total_chips = total_chips
        groups = method.groups
        self.active = [self.slices] * groups  # slices in service
        self.running = [False] * groups
        self.until = [0.0] * groups  # stalled until
        self.since_save = [0.0] * groups  # running time since the last save point (non-elastic)
        self.last_t = [0.0] * groups
        self.running_chips = 0
        self.useful = self.lost = 0.0
        self.count = 0
        self.heap: list[tuple[float, int, str, int]] = []
        self._seq = 0
        self.rng = random.Random(seed)

    def _push(self, t: float, kind: str, group: int) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, group))

    def advance(self, g: int, t: float) -> None:
        dt = t - self.last_t[g]
        if dt > 0 and self.running[g]:
            self.useful += self.active[g] * self.faults.slice_chips * self.method.compute_fraction * dt
            self.since_save[g] = (self.since_save[g] + dt) % self.method.save_interval_s
        self.last_t[g] = t

    def _set_running(self, g: int, running: bool) -> None:
        if running != self.running[g]:
            sign = 1 if running else -1
            self.running_chips += sign * self.active[g] * self.faults.slice_chips
            self.running[g] = running

    def _set_active(self, g: int, slices: int) -> None:
        if self.running[g]:
            self.running_chips += (slices - self.active[g]) * self.faults.slice_chips
        self.active[g] = slices

    def stall(self, g: int, t: float, duration_s: float) -> None:
        self.advance(g, t)
        self._set_running(g, False)
        self.until[g] = max(self.until[g], t + duration_s)
        self._push(self.until[g], "resume", g)

    def resume(self, g: int, t: float) -> None:
        if t < self.until[g] or self.running[g]:
            return  # superseded by a later stall, or already running
        self.advance(g, t)
        if self.active[g] > 0:
            self._set_running(g, True)

    def give_back(self, g: int, t: float) -> None:
        """A repaired slice returns to an elastic group."""
        self.advance(g, t)
        self._set_active(g, self.active[g] + 1)
        self.stall(g, t, self.method.rejoin_s)

    def interrupt(self, g: int, t: float, down_s: float | None = None, loses_work: bool = True) -> None:
        self.advance(g, t)
        self.count += 1
        method = self.method
        if method.elastic and loses_work:
            if self.active[g] > 0:
                self._set_active(g, self.active[g] - 1)
                self._push(t + self.faults.repair_s, "return", g)
            self.stall(g, t, method.reform_s if down_s is None else down_s)
        else:
            if loses_work:  # back to the last save point; a spare slice takes the failed one's place
                lost = self.active[g] * self.faults.slice_chips * method.compute_fraction * self.since_save[g]
                self.useful -= lost
                self.lost += lost
                self.since_save[g] = 0.0
            self.stall(g, t, method.restart_s if down_s is None else down_s)
        if method.neighbours and method.neighbour_stall_s > 0:
            others = self.rng.sample(range(method.groups - 1), method.neighbours)
            for other in others:
                self.stall(other + (other >= g), t, method.neighbour_stall_s)

    def pick_group(self) -> int:
        """A group with probability proportional to its computing chips."""
        groups = self.method.groups
        for _ in range(64):  # rejection sampling: O(1) while most groups run
            g = self.rng.randrange(groups)
            if self.running[g] and self.rng.random() * self.slices < self.active[g]:
                return g
        target = self.rng.random() * self.running_chips
        for g in range(groups):
            if self.running[g]:
                target -= self.active[g] * self.faults.slice_chips
                if target < 0:
                    return g
        return max(range(groups), key=lambda g: self.running[g])

    def run(self, horizon_s: float, trace: Sequence[Interruption] | None,
            progress: Callable[[float], None] | None) -> None:
        """The event loop: the next interruption (drawn, or from the trace) or the next scheduled event."""
        for g in range(self.method.groups):
            self.stall(g, 0.0, self.method.startup_s)
            self.resume(g, 0.0)
        pending = sorted(trace, key=lambda f: f.at_s, reverse=True) if trace is not None else None
        t, steps = 0.0, 0
        while True:
            if pending is not None:
                t_fault = pending[-1].at_s if pending else float("inf")
            else:  # memoryless: redrawing after every event leaves the process Poisson
                rate = self.running_chips / self.faults.mtbi_chip_s
                t_fault = t + self.rng.expovariate(rate) if rate > 0 else float("inf")
            t_event = self.heap[0][0] if self.heap else float("inf")
            if min(t_fault, t_event) >= horizon_s:
                break
            if t_event <= t_fault:
                t, _, kind, g = heapq.heappop(self.heap)
                (self.resume if kind == "resume" else self.give_back)(g, t)
            elif pending is not None:
                fault = pending.pop()
                t = fault.at_s
                self.interrupt(fault.group, t, fault.down_s, fault.loses_work)
            else:
                t = t_fault
                self.interrupt(self.pick_group(), t)
            steps += 1
            if progress is not None and steps % 4096 == 0:
                progress(t / horizon_s)
        for g in range(self.method.groups):
            self.advance(g, horizon_s)


def simulate(
    method: MethodConfig,
    faults: FaultConfig,
    total_chips: int,
    horizon_s: float,
    seed: int = 0,
    trace: Sequence[Interruption] | None = None,
    progress: Callable[[float], None] | None = None,
) -> GoodputResult:
    """Run ``method`` on ``total_chips`` chips for ``horizon_s`` seconds of wall time.

    Interruptions are drawn at random (``seed``) unless ``trace`` gives them. ``progress`` is called now and
    then with the fraction of the horizon simulated."""
    if not horizon_s > 0:
        raise ValueError(f"horizon_s must be > 0 seconds, got {horizon_s}")
    if trace and max(f.group for f in trace) >= method.groups:
        raise ValueError(f"the trace names a group >= {method.groups}, the number of groups")
    engine = _Engine(method, faults, total_chips, seed)
    engine.run(horizon_s, trace, progress)
    return GoodputResult(
        method=method.name,
        total_chips=total_chips,
        groups=method.groups,
        horizon_s=horizon_s,
        interruptions=engine.count,
        useful_chip_s=engine.useful,
        lost_chip_s=engine.lost,
        goodput=engine.useful / (total_chips * horizon_s),
    )
