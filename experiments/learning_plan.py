"""The learning study's plan: the runs each phase makes given the results so far (a later phase builds on an
earlier one's best settings; the floor phases' plans are experiments/learning_floor.py's), and what each phase
waits for."""

from __future__ import annotations

from dataclasses import replace

from experiments.learning_floor import _floor_clip_plan, _floor_length_plan, _floor_plan
from experiments.learning_grids import (
    DILOCO_POINTS,
    IID_INNER_LR_FACTORS,
    INNER_LR_FACTORS,
    INNER_LR_LIMIT,
    ISLAND_BATCH,
    ISLAND_DP_LRS,
    ISLAND_POINTS,
    ISLAND_STEPS,
    LOW_BIT_POINTS,
    LOW_BIT_TARGETS,
    MUON_DP_LRS,
    MUON_INNER_LRS,
    MUON_OUTER_GRID,
    MUON_POINTS,
    MUON_SEEDED,
    OUTER_GRID,
    OUTER_WARMUP_POINTS,
    OVERLAP_EAGER,
    OVERLAP_POINTS,
    OVERLAP_SEEDED,
    OVERLAP_WAITING,
    SEEDS,
    SIZE_DILOCO,
    SIZE_POINTS,
    SIZE_SEEDS,
    SPARSE_H,
    SYNC_DP_LRS,
    _best,
    _island_syncdp,
    _island_syncdp_grid,
    _like,
    _muon_dp,
    _muon_runs,
    _past_edge,
    _same_outer,
    _standard,
)
from experiments.learning_runs import STEPS, Run


def plan(phase: str, results: list[dict]) -> list[Run]:
    """The runs of ``phase``, given what is done: a later phase builds on an earlier one's best settings."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    if phase == "tune-syncdp":
        return [Run("syncdp", lr) for lr in SYNC_DP_LRS]
    if phase == "floor-clip":
        best = _best(results, method="syncdp")
        return [] if best is None else _floor_clip_plan(best["inner_lr"], results)
    if phase == "floor-length":  # needs nothing: its own sync DP grids first
        return _floor_length_plan(results)
    if phase == "sizes":  # needs nothing: its grids are fixed, and the gap is taken to the best sync DP at each width
        h, c, o, m = SIZE_DILOCO
        grids = {d: [*(Run("syncdp", lr, d_model=d) for lr in lrs),
                     *(Run("diloco", lr / 2, inner_steps=h, compression=c, outer_lr=o, outer_momentum=m, d_model=d) for lr in lrs)]
                 for d, lrs in SIZE_POINTS}
        done = {r["key"]: r for r in results}
        seeds = []
        for grid in grids.values():
            if all(run.key in done for run in grid):
                for method in ("syncdp", "diloco"):
                    best = min((run for run in grid if run.method == method), key=lambda run: done[run.key]["final_loss"])
                    seeds += [replace(best, seed=s) for s in SIZE_SEEDS]
        return [run for grid in grids.values() for run in grid] + seeds
    best_dp = _best(results, method="syncdp")
    if best_dp is None:
        return []  # nothing to build on yet
    lr = best_dp["inner_lr"]
    if phase == "low-bit":
        runs = [Run("diloco", lr / 2, inner_steps=h, compression=c, outer_lr=o, outer_momentum=m, reducer_feedback=True)
                for h, c, grid in LOW_BIT_POINTS for o, m in grid]
        done = {r["key"]: r for r in results}
        if all(run.key in done for run in runs):
            for low, high in zip(LOW_BIT_TARGETS, (*LOW_BIT_TARGETS[1:], float("inf"))):
                for codec in dict.fromkeys(c for _, c, _ in LOW_BIT_POINTS):
                    bracket = [run for run in runs if low <= run.fewer_bytes_than_syncdp < high and run.compression == codec]
                    best = min(bracket, key=lambda run: done[run.key]["final_loss"])
                    runs += [replace(best, seed=s) for s in SEEDS[1:]]
        return runs
    if phase == "muon":
        return _muon_plan(lr, results)
    if phase == "outer-warmup":
        return [Run("diloco", lr * f, inner_steps=h, compression=c, outer_lr=o, outer_momentum=m, reducer_feedback=True,
                    optimizer=opt, outer_warmup=w) for opt, h, c, o, m, f, warmups in OUTER_WARMUP_POINTS for w in warmups]
    if phase == "floor":
        return _floor_plan(lr, results)
    if phase == "overlap":  # per point: its overlaps, the eager ones, then the seeded ones at SEEDS[1:]
        runs = []
        for h, c, o, m, f, overlaps in OVERLAP_POINTS:
            late = [Run("diloco", lr * f, inner_steps=h, compression=c, outer_lr=o, outer_momentum=m,
                        reducer_feedback=True, overlap=t) for t in overlaps]
            eager = [replace(run, eager=True) for run in late if (h, run.overlap) in OVERLAP_EAGER]
            runs += late + eager + [replace(run, seed=s) for run in late if (h, run.overlap) in OVERLAP_SEEDED
                                    for s in SEEDS[1:]]
            runs += [replace(run, overlap=0, steps=STEPS * h // (h + run.overlap)) for run in late
                     if (h, run.overlap) in OVERLAP_WAITING]
        return runs
    if phase == "outer-grid":
        return [Run("diloco", lr, inner_steps=h, compression=c, outer_lr=o, outer_momentum=m)
                for h, c in DILOCO_POINTS for o, m in OUTER_GRID]
    grid = [b for h, c in DILOCO_POINTS if (b := _best(results, method="diloco", inner_steps=h, compression=c,
                                                        inner_lr=lr, schedule="fixed", reducer_feedback=False))]
    if phase == "inner-lr":  # DiLoCo's own inner lr (its islands step on PEERS x smaller batches than sync DP)
        runs = []
        for b in grid:
            runs += [_like(b, inner_lr=lr * f) for f in INNER_LR_FACTORS]
            tried = sorted(r["inner_lr"] for r in results if _standard(r) and r["seed"] == 0 and r["method"] == "diloco"
                           and r["schedule"] == "fixed" and not r["reducer_feedback"] and _same_outer(r, b))
            best = _best(results, method="diloco", schedule="fixed", reducer_feedback=False, inner_steps=b["inner_steps"],
                         compression=b["compression"], outer_lr=b["outer_lr"], outer_momentum=b["outer_momentum"])
            if len(tried) < 1 + len(INNER_LR_FACTORS):
                continue  # the edge is known once the first grid is done
            if (past := _past_edge(tried, best["inner_lr"], lr / INNER_LR_LIMIT, lr * INNER_LR_LIMIT)) is not None:
                runs.append(_like(b, inner_lr=past))
        return list(dict.fromkeys(runs))
    # the best of every inner lr tried, per point
    bests = [b for h, c in DILOCO_POINTS if (b := _best(results, method="diloco", inner_steps=h, compression=c,
                                                         schedule="fixed", reducer_feedback=False))]
    targets = [b for b in bests if b["fewer_bytes_than_syncdp"] >= 400]  # the points of the targets
    if phase == "outer-retune":  # the grid's runner-up outer optimizer at each target point, at its best inner lr
        runs = []
        for b in targets:
            at_dp = sorted((r for r in results if _standard(r) and r["seed"] == 0 and r["method"] == "diloco"
                            and r["schedule"] == "fixed" and not r["reducer_feedback"] and r["inner_lr"] == lr
                            and (r["inner_steps"], r["compression"]) == (b["inner_steps"], b["compression"])),
                           key=lambda r: r["final_loss"])
            runner_up = next((r for r in at_dp if not _same_outer(r, b)), None)
            if runner_up is not None and b["inner_lr"] != lr:
                runs.append(_like(b, outer_lr=runner_up["outer_lr"], outer_momentum=runner_up["outer_momentum"]))
        return runs
    if phase == "seeds":  # the target points first, then the curve's cheaper points (their gap, not only seed 0's)
        return [Run("syncdp", lr, seed=s) for s in SEEDS[1:]] + [
            _like(b, seed=s) for b in targets + [b for b in bests if b not in targets] for s in SEEDS[1:]]
    if phase == "schedule":
        return [_like(b, schedule="grow") for b in bests]
    if phase == "iid":  # how much of the gap is the shards' difference: the same runs, every island on all the data;
        # then the first at smaller inner lrs (IID_INNER_LR_FACTORS), and on the shards at the first of them (the
        # islands' agreement measured on both at one setting)
        runs = [Run("syncdp", lr, data="iid")] + [_like(b, data="iid") for b in targets]
        for b in targets[:1]:
            runs.append(_like(b, inner_lr=b["inner_lr"] * IID_INNER_LR_FACTORS[0]))
            runs += [_like(b, data="iid", inner_lr=b["inner_lr"] * f) for f in IID_INNER_LR_FACTORS]
        return list(dict.fromkeys(runs))
    if phase == "islands-syncdp":  # sync DP's lr at the larger islands' global batch, the grid growing past its edge
        tried, best = _island_syncdp_grid(results)
        runs = [Run("syncdp", lr, batch_size=ISLAND_BATCH, steps=ISLAND_STEPS[0]) for lr in ISLAND_DP_LRS]
        if set(tried) >= set(ISLAND_DP_LRS):
            if (past := _past_edge(tried, best)) is not None:
                runs.append(Run("syncdp", past, batch_size=ISLAND_BATCH, steps=ISLAND_STEPS[0]))
            else:  # the grid brackets its best: the longer runs at that lr
                runs += [Run("syncdp", best, batch_size=ISLAND_BATCH, steps=s) for s in ISLAND_STEPS[1:]]
        return runs
    if phase == "islands":  # DiLoCo at the larger islands: the standard study's outer optimizer per H, inner lr 1/2
        # sync DP's best at the same size (the standard study's rule), and 1x at H = 40
        best = _island_syncdp(results)
        if best is None:
            return []
        return [Run("diloco", best * f, inner_steps=h, compression=c, outer_lr=o, outer_momentum=m,
                    batch_size=ISLAND_BATCH, steps=s)
                for h, c, o, m, s, factors in ISLAND_POINTS for f in factors]
    if phase == "codecs":  # the reducer's error feedback at the int4 point; sparse top-k on the smallest H's settings,
        # and with plain averaging as SparseLoCo steps (its error feedback standing in for the outer momentum)
        runs = [_like(b, reducer_feedback=True) for b in bests if b["compression"] == "int4"]
        if bests:
            runs += [_like(bests[0], inner_steps=h, compression="topk", reducer_feedback=f)
                     for h in SPARSE_H for f in (False, True)]
            runs += [_like(bests[0], inner_steps=h, compression="topk", reducer_feedback=f, outer_lr=1.0, outer_momentum=0.0)
                     for h in SPARSE_H for f in (True, False)]
        return list(dict.fromkeys(runs))
    # checks: one island, tuned outer optimizer (the >= 400x point's), against plain AdamW on the same batches
    if not targets:
        return []
    one = dict(peers=1, steps=STEPS)
    return [Run("syncdp", targets[0]["inner_lr"], **one), _like(targets[0], **one),
            _like(targets[0], outer_lr=1.0, outer_momentum=0.0, **one)]


def _muon_plan(lr: float, results: list[dict]) -> list[Run]:
    """Phase muon: DiLoCo with Muon islands at MUON_INNER_LRS, MUON_OUTER_GRID and at MUON_POINTS (inner lr 1/2 of
    AdamW sync DP's ``lr``), and Muon sync DP over its lr grid, grown past the edge where its best is; once that
    brackets its best, Muon sync DP's best and MUON_SEEDED at SEEDS[1:] and MUON_POINTS again at 1/2 of Muon sync DP's
    best (the study's rule for the inner lr); then each codec's best DiLoCo run at each target's bytes at SEEDS[1:]."""
    def island(inner_lr: float, h: int, codec: str, outer_lr: float, momentum: float) -> Run:
        return Run("diloco", inner_lr, inner_steps=h, compression=codec, outer_lr=outer_lr, outer_momentum=momentum,
                   reducer_feedback=True, optimizer="muon")

    def points(inner_lr: float) -> list[Run]:
        return [island(inner_lr, h, c, o, m) for h, c, grid in MUON_POINTS for o, m in grid]

    diloco = [island(lr * f, h, c, o, m) for h, c, o, m, factors in MUON_INNER_LRS for f in factors] + points(lr / 2)
    diloco += [island(lr * f, h, c, o, m) for h, c, f, grid in MUON_OUTER_GRID for o, m in grid]
    grid = {r["inner_lr"]: r["final_loss"] for r in _muon_runs(results, "syncdp") if r["seed"] == 0}
    runs = diloco + [Run("syncdp", x, optimizer="muon") for x in sorted({*MUON_DP_LRS, *grid})]
    best_dp = _muon_dp(results)
    if set(MUON_DP_LRS) <= set(grid) and best_dp is None:
        runs.append(Run("syncdp", _past_edge(sorted(grid), min(grid, key=grid.get)), optimizer="muon"))  # at its edge
    if best_dp is not None:
        runs += [Run("syncdp", best_dp, seed=s, optimizer="muon") for s in SEEDS[1:]]
        runs += [replace(island(lr * f, h, c, o, m), seed=s) for h, c, o, m, f in MUON_SEEDED for s in SEEDS[1:]]
        if best_dp != lr:
            own = points(best_dp / 2)  # Muon sync DP's own rule first: the seeds wait for both
            diloco, runs = own + diloco, own + runs
    done = {r["key"]: r for r in results}
    if best_dp is not None and all(run.key in done for run in diloco):
        for low, high in zip(LOW_BIT_TARGETS, (*LOW_BIT_TARGETS[1:], float("inf"))):
            for codec in dict.fromkeys(c for _, c, _ in MUON_POINTS):
                bracket = [run for run in diloco if low <= run.fewer_bytes_than_syncdp < high and run.compression == codec]
                if bracket:
                    best = min(bracket, key=lambda run: done[run.key]["final_loss"])
                    runs += [replace(best, seed=s) for s in SEEDS[1:]]
    return list(dict.fromkeys(runs))


PHASES = ("tune-syncdp", "outer-grid", "inner-lr", "outer-retune", "codecs", "seeds", "iid", "checks", "schedule",
          "islands-syncdp", "islands", "sizes", "low-bit", "muon", "outer-warmup", "floor", "floor-length", "floor-clip",
          "overlap")


# what each phase builds on: its runs are planned only once these phases have none left to run
NEEDS = {"tune-syncdp": (), "outer-grid": ("tune-syncdp",), "inner-lr": ("tune-syncdp", "outer-grid")}
NEEDS.update({phase: ("tune-syncdp", "outer-grid", "inner-lr") for phase in ("codecs", "outer-retune")})
NEEDS.update({phase: ("tune-syncdp", "outer-grid", "inner-lr", "outer-retune") for phase in PHASES[5:9]})  # seeds ...
NEEDS.update({"islands-syncdp": (), "islands": (), "sizes": (), "low-bit": ("tune-syncdp",), "muon": ("tune-syncdp",),
              "outer-warmup": ("tune-syncdp",), "floor": ("tune-syncdp",), "floor-length": (), "floor-clip": ("tune-syncdp",),
              "overlap": ("tune-syncdp",)})  # islands plans nothing until sync DP's grid brackets its best


def _remaining(phase: str, results: list[dict]) -> list[Run]:
    done = {r["key"] for r in results}
    return [run for run in plan(phase, results) if run.key not in done]


def next_runs(phases: list[str], results: list[dict], running: set[str]) -> list[Run]:
    """The runs that may start now, in phase order: those of every asked phase whose prerequisites are complete,
    not done and not running. Phases that build on the same finished phases run side by side."""
    runs = []
    for phase in phases:
        if all(not _remaining(need, results) for need in NEEDS[phase]):
            runs += [run for run in _remaining(phase, results) if run.key not in running and run not in runs]
    return runs


