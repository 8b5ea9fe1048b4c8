"""Scenarios built from the simulator and the calculator: the chip sweep and the Decoupled DiLoCo report's cases.

- ``sweep``: goodput of the three methods from tens to a million chips, one layout and one set of timing
  assumptions (``SweepConfig``), optionally with our protocol's overheads from a calibration.
- ``report_goodput``: the report's failure scenario (1.2M chips, one interruption per chip-year). The report's
  restart and re-forming times are not in any source we could read, so the two data-parallel timings are
  *fitted* to the report's two data-parallel figures (27%, 58%); the decoupled figures (88% for 8 learners,
  93% for 16) are then *predicted* with those timings, and p2p-diloco's islands (which restart whole) are
  run with the same numbers.
- ``report_bandwidth``: the report's 12B case, H = 24, 24 fragments, overlap 2, int4, 8 data centres, under
  several accountings, the step time being the one the reported 198 Gbit/s implies.

Every figure is computed here from the inputs written in the config objects; nothing is copied from the
report except the targets the fit aims at, which are named as such.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from experiments.sim.bandwidth import BandwidthConfig, island_bandwidth, send_factor
from experiments.sim.calibrate import Calibration
from experiments.sim.goodput import YEAR_S, FaultConfig, MethodConfig, elastic_dp, simulate, sync_dp

Progress = Callable[[str], None]
GBIT = 1e9


@dataclass(frozen=True)
class SweepConfig:
    chips: tuple[int, ...] = (10, 100, 1_000, 10_000, 100_000, 1_000_000)  # requested totals (rounded down to fit)
    island_chips: int = 8  # decoupled: chips of one island (one machine of 8 accelerators)
    slice_chips: int = 8  # chips one interruption takes out (a machine), for every method
    mtbi_chip_s: float = YEAR_S  # the report's "high failure rate": one interruption per chip-year
    restart_s: float = 600.0  # sync DP: reschedule, replace the slice, load the checkpoint; an island: come back
    checkpoint_interval_s: float = 600.0  # sync DP: running time between checkpoints
    reform_s: float = 60.0  # elastic DP: stall to drop a failed slice
    rejoin_s: float = 60.0  # elastic DP: stall to take a repaired slice back
    repair_s: float = 3600.0  # a failed slice is out this long (elastic DP waits for it)
    round_s: float = 600.0  # decoupled: one outer round (H inner steps); the work a killed island loses is in it
    model_params: float = 1e9  # for the state download of a restarted island
    state_bytes_per_param: float = 8.0  # fp32 global params + fp32 outer momentum, as our state download sends
    link_gbit: float = 1.0  # an island's link to the swarm (Gbit/s): state download speed
    neighbours: int = 15  # islands one failure can stall: its averaging group (16 peers) less itself
    neighbour_stall_s: float = 0.0  # measured ~0 for a killed peer (chaos); up to the averaging timeout if hung
    compute_fraction_dp: float = 1.0  # data parallel's communication assumed hidden on its fabric
    compute_fraction_decoupled: float = 1.0  # replaced by the measured one when calibrated
    interruptions_per_point: int = 2000  # the horizon of each point is set to see about this many
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.chips or min(self.chips) < 1:
            raise ValueError("chips must list totals >= 1")
        if self.island_chips < self.slice_chips or self.island_chips % self.slice_chips:
            raise ValueError(f"island_chips ({self.island_chips}) must be a multiple of slice_chips ({self.slice_chips})")
        positive = ("mtbi_chip_s", "checkpoint_interval_s", "round_s", "model_params", "state_bytes_per_param", "link_gbit")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.interruptions_per_point < 1:
            raise ValueError(f"interruptions_per_point must be >= 1, got {self.interruptions_per_point}")
        # the remaining durations and fractions are checked where they become FaultConfig / MethodConfig

    @property
    def state_download_s(self) -> float:
        return self.model_params * self.state_bytes_per_param * 8 / (self.link_gbit * GBIT)


def _horizon_s(chips: int, mtbi_chip_s: float, interruptions: int, longest_s: float) -> float:
    return max(interruptions * mtbi_chip_s / chips, 20 * longest_s)


def sweep_methods(config: SweepConfig, islands: int, calibration: Calibration | None) -> list[MethodConfig]:
    """The three methods at one size (``islands`` islands for the decoupled one)."""
    decoupled = MethodConfig(
        name="decoupled", groups=islands, restart_s=config.restart_s + config.state_download_s,
        save_interval_s=config.round_s, compute_fraction=config.compute_fraction_decoupled,
        neighbours=min(config.neighbours, islands - 1), neighbour_stall_s=config.neighbour_stall_s,
    )
    if calibration is not None:  # our protocol's measured overheads on top of the hardware's restart
        overhead = (calibration.process_start_s or 0.0) + calibration.rejoin_s
        decoupled = replace(decoupled, restart_s=decoupled.restart_s + overhead,
                            compute_fraction=calibration.compute_fraction,
                            neighbour_stall_s=max(config.neighbour_stall_s, calibration.neighbour_stall_s))
    return [
        sync_dp(config.restart_s, config.checkpoint_interval_s, config.compute_fraction_dp),
        elastic_dp(config.reform_s, config.rejoin_s, config.compute_fraction_dp),
        decoupled,
    ]


def sweep(config: SweepConfig, calibration: Calibration | None = None, progress: Progress | None = None) -> list[dict]:
    """One row per (size, method): chips as laid out, islands, interruptions seen, goodput."""
    faults = FaultConfig(config.mtbi_chip_s, config.slice_chips, config.repair_s)
    rows = []
    longest = max(config.restart_s + config.state_download_s, config.checkpoint_interval_s, config.repair_s, config.round_s)
    for index, requested in enumerate(config.chips):
        # islands of island_chips; a total smaller than one island is one island of whole slices
        island = min(config.island_chips, max(config.slice_chips, requested // config.slice_chips * config.slice_chips))
        islands = max(1, requested // island)
        chips = islands * island
        horizon = _horizon_s(chips, config.mtbi_chip_s, config.interruptions_per_point, longest)
        for method in sweep_methods(config, islands, calibration):
            label = f"[{index + 1}/{len(config.chips)}] {method.name} on {chips:,} chips"
            if progress:
                progress(label)
            tick = (lambda done, label=label: progress(f"{label}: {done:.0%}")) if progress else None
            result = simulate(method, faults, chips, horizon, seed=config.seed, progress=tick)
            rows.append(dict(requested_chips=requested, **result.to_dict()))
    return rows


def fit(run: Callable[[float], float], target: float, low: float, high: float, tolerance: float = 0.002) -> float:
    """The x in [low, high] where the decreasing function ``run`` reaches ``target`` (bisection)."""
    if not run(low) >= target >= run(high):
        raise ValueError(f"target {target} is outside [{run(high):.3f}, {run(low):.3f}] for x in [{low}, {high}]")
    for _ in range(40):
        middle = (low + high) / 2
        value = run(middle)
        if abs(value - target) <= tolerance:
            return middle
        low, high = (middle, high) if value > target else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class ReportScenario:
    """The Decoupled DiLoCo report's failure simulation, as far as it is stated, and our choices for the rest."""

    chips: int = 1_200_128  # report: 1.2M simulated chips (rounded up to whole 64-chip slices in 16 groups and 256-chip islands)
    mtbi_chip_s: float = YEAR_S  # report: MTBI of one year per chip
    slice_chips: int = 64  # our choice: a TPU v4/v5p cube (4x4x4), the smallest unit a pod re-forms around
    repair_s: float = 3600.0  # our choice: a failed cube is back in an hour
    checkpoint_interval_s: float = 10.0  # our choice: in-memory snapshots every few steps (any slower never saves)
    target_sync_dp: float = 0.27  # report: non-elastic data parallel (fit target)
    target_elastic_dp: float = 0.58  # report: elastic data parallel (fit target)
    learners: tuple[int, ...] = (8, 16)  # report: learner counts simulated (predicted here)
    reported_learners: tuple[float, ...] = (0.88, 0.93)  # report: their goodput (compared against, not used)
    small_island_chips: int = 256  # p2p-diloco's way to scale: many small islands (our choice)
    model_params: float = 12e9  # report: the 12B model (for the state a restarted island downloads)
    state_bytes_per_param: float = 8.0  # fp32 global params + fp32 outer momentum, as our state download sends
    wan_gbit: float = 5.0  # report: 2-5 Gbit/s between regions; the faster end
    round_s: float = 60.0  # our choice: an island loses up to one round (checkpoint per outer step)
    interruptions: int = 20_000  # horizon: about this many interruptions per run
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("chips", "mtbi_chip_s", "slice_chips", "checkpoint_interval_s", "small_island_chips", "model_params",
                    "state_bytes_per_param", "wan_gbit", "round_s", "interruptions")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.repair_s < 0:
            raise ValueError(f"repair_s must be >= 0 seconds, got {self.repair_s}")
        if not 0 < self.target_sync_dp < self.target_elastic_dp < 1:
            raise ValueError("the fit targets must satisfy 0 < target_sync_dp < target_elastic_dp < 1")
        if len(self.learners) != len(self.reported_learners):
            raise ValueError("learners and reported_learners must have one entry each per learner count")

    @property
    def state_download_s(self) -> float:
        return self.model_params * self.state_bytes_per_param * 8 / (self.wan_gbit * GBIT)


def report_goodput(s: ReportScenario, progress: Progress | None = None) -> dict:
    """Fit sync DP's restart and elastic DP's re-form (= rejoin) time to the report's figures; predict the rest."""
    faults = FaultConfig(s.mtbi_chip_s, s.slice_chips, s.repair_s)
    horizon = _horizon_s(s.chips, s.mtbi_chip_s, s.interruptions, s.repair_s)

    def goodput(method: MethodConfig) -> float:
        return simulate(method, faults, s.chips, horizon, seed=s.seed).goodput

    say = progress or (lambda line: None)
    say("fitting sync DP's restart time to the report's non-elastic figure")
    restart_s = fit(lambda x: goodput(sync_dp(x, s.checkpoint_interval_s)), s.target_sync_dp, 0.0, 3600.0)
    say("fitting elastic DP's re-form time to the report's elastic figure")
    reform_s = fit(lambda x: goodput(elastic_dp(x, x)), s.target_elastic_dp, 0.0, 600.0)
    rows = [dict(method="sync_dp", groups=1, goodput=goodput(sync_dp(restart_s, s.checkpoint_interval_s)),
                 role="fitted", reported=s.target_sync_dp),
            dict(method="elastic_dp", groups=1, goodput=goodput(elastic_dp(reform_s, reform_s)),
                 role="fitted", reported=s.target_elastic_dp)]
    island_restart = restart_s + s.state_download_s
    for m, reported in zip(s.learners, s.reported_learners):
        say(f"{m} learners / islands")
        learners = MethodConfig(f"decoupled, elastic learners (report's design), M={m}", groups=m, elastic=True,
                                reform_s=reform_s, rejoin_s=reform_s)
        ours = MethodConfig(f"p2p-diloco islands as built (restart whole), M={m}", groups=m,
                            restart_s=island_restart, save_interval_s=s.round_s)
        rows += [dict(method=learners.name, groups=m, goodput=goodput(learners), role="predicted", reported=reported),
                 dict(method=ours.name, groups=m, goodput=goodput(ours), role="ours", reported=None)]
    small = s.chips // s.small_island_chips
    ours_small = MethodConfig(f"p2p-diloco islands of {s.small_island_chips} chips, M={small}", groups=small,
                              restart_s=island_restart, save_interval_s=s.round_s)
    say(f"{small} islands of {s.small_island_chips} chips")
    rows.append(dict(method=ours_small.name, groups=small, goodput=goodput(ours_small), role="ours", reported=None))
    return dict(scenario=asdict(s), state_download_s=s.state_download_s, horizon_s=horizon, fitted_restart_s=restart_s, fitted_reform_s=reform_s,
                cluster_mtbi_s=s.mtbi_chip_s / s.chips, rows=rows)


@dataclass(frozen=True)
class ReportBandwidth:
    params: float = 12e9  # report: a 12B model
    islands: int = 8  # report: 8 data centres
    inner_steps: int = 24  # report (as secondary sources give it): each fragment synced every H = 24 steps
    fragments: int = 24  # report: P = 24 fragments
    overlap_steps: float = 2.0  # report: tau = 2 (double buffering)
    outer_bits: float = 4.0  # report: int4 outer gradients
    dp_bits: float = 16.0  # our choice: bf16 gradients (fp32 shown as a variant)
    reported_dp_gbit: float = 198.0  # report: data parallel, 8 data centres (pins the step time)
    reported_decoupled_gbit: float = 0.84  # report: decoupled (the figure compared against)
    global_batch_tokens: float = 4 * 2**20  # our choice, to express the step as tokens/s per island

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.islands < 2:
            raise ValueError(f"islands must be >= 2, got {self.islands}")


def report_bandwidth(b: ReportBandwidth) -> dict:
    """The decoupled rate under four accountings, at the step time the reported data-parallel rate implies."""
    rows = []
    for dp_bits in (b.dp_bits, 32.0):
        for topology in ("allreduce", "syncer"):
            dp_bits_per_step = send_factor("allreduce", b.islands) * b.params * dp_bits
            step_s = dp_bits_per_step / (b.reported_dp_gbit * GBIT)  # what 198 Gbit/s implies
            tokens_per_step = b.global_batch_tokens / b.islands
            config = BandwidthConfig(
                params=b.params, islands=b.islands, tokens_per_s=tokens_per_step / step_s, tokens_per_step=tokens_per_step,
                inner_steps=b.inner_steps, outer_bits=b.outer_bits, dp_bits=dp_bits, fragments=b.fragments,
                overlap_steps=b.overlap_steps, topology=topology,
            )
            result = island_bandwidth(config)
            rows.append(dict(dp_bits=dp_bits, topology=topology, step_s=step_s, tokens_per_s_per_island=config.tokens_per_s,
                             dp_gbit=result.dp_required_bits_per_s / GBIT,
                             decoupled_sustained_gbit=result.diloco_sustained_bits_per_s / GBIT,
                             decoupled_required_gbit=result.diloco_required_bits_per_s / GBIT,
                             reduction=result.required_reduction,
                             vs_reported=result.diloco_required_bits_per_s / GBIT / b.reported_decoupled_gbit))
    return dict(inputs=asdict(b), reported_reduction=b.reported_dp_gbit / b.reported_decoupled_gbit, rows=rows,
                log10_gap=[math.log10(r["vs_reported"]) for r in rows])
