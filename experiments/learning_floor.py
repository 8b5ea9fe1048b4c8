"""The learning study's floor phases (floor, floor-length, floor-clip: DiLoCo at H = 1, what is left of the gap
when the islands never drift apart) and the floor probe's runs, planned from the results so far."""

from __future__ import annotations

from dataclasses import replace

from experiments.learning_grids import (
    FLOOR_CARRIED,
    FLOOR_CLIP_CARRIED,
    FLOOR_CLIP_DP_FACTORS,
    FLOOR_CLIP_FACTORS,
    FLOOR_CLIP_ISLAND_NORMS,
    FLOOR_ISLAND_FACTORS,
    FLOOR_LENGTH_DP_LRS,
    FLOOR_LENGTH_FACTORS,
    FLOOR_LENGTHS,
    FLOOR_MORE_PROBES,
    FLOOR_NESTEROV,
    FLOOR_POINTS,
    FLOOR_PROBES,
    INNER_LR_LIMIT,
    ISLAND_BATCH,
    ISLAND_STEPS,
    SEEDS,
    _best,
    _island_syncdp,
    _muon_dp,
    _past_edge,
    _standard,
)
from experiments.learning_runs import BATCH, CLIP, D_MODEL, PEERS, STEPS, Run


def _floor_plan(lr: float, results: list[dict]) -> list[Run]:
    """Phase floor: DiLoCo at H = 1 with plain averaging at FLOOR_POINTS (multiples of sync DP's best ``lr``) and, once
    sync DP at ISLAND_BATCH is tuned, at FLOOR_ISLAND_FACTORS of its best; each of these grids grown by doubling or
    halving while its best is at its edge (up to INNER_LR_LIMIT); AdamW at H = 1 with FLOOR_NESTEROV. Once a grid
    brackets its best: that run at SEEDS[1:] (at ISLAND_BATCH with sync DP's best there at those seeds), and the
    AdamW floor's inner lr with plain averaging at FLOOR_CARRIED."""
    done = {r["key"]: r for r in results}
    grids = [[Run("diloco", lr * f, optimizer=opt) for f in factors] for opt, factors in FLOOR_POINTS]
    if (island_lr := _island_syncdp(results)) is not None:
        grids.append([Run("diloco", island_lr * f, batch_size=ISLAND_BATCH, steps=ISLAND_STEPS[0])
                      for f in FLOOR_ISLAND_FACTORS])
    o, m, f = FLOOR_NESTEROV
    runs, bests = [], []
    for grid in grids:  # one optimizer at one batch, the grid grown at its edge from what is done
        tried = [replace(grid[0], inner_lr=r["inner_lr"]) for r in results if r["method"] == "diloco"]
        grid = sorted({*grid, *(run for run in tried if run.key in done)}, key=lambda run: run.inner_lr)
        runs += grid
        if not all(run.key in done for run in grid):
            continue
        best = min(grid, key=lambda run: done[run.key]["final_loss"])
        base = island_lr if best.batch_size == ISLAND_BATCH else lr
        past = _past_edge([run.inner_lr for run in grid], best.inner_lr, base / INNER_LR_LIMIT, base * INNER_LR_LIMIT)
        if past is not None:
            runs.append(replace(best, inner_lr=past))
        else:
            bests.append(best)
    runs.append(Run("diloco", lr * f, outer_lr=o, outer_momentum=m))
    for best in bests:
        runs += [replace(best, seed=s) for s in SEEDS[1:]]
        if best.batch_size == ISLAND_BATCH:
            runs += [Run("syncdp", island_lr, seed=s, batch_size=ISLAND_BATCH, steps=ISLAND_STEPS[0]) for s in SEEDS[1:]]
        elif best.optimizer == "adamw":
            runs += [replace(best, inner_steps=h, compression=c) for h, c in FLOOR_CARRIED]
    return list(dict.fromkeys(runs))


def _floor_length(result: dict, steps: int) -> bool:
    """A run of phase floor-length (any seed) over ``steps``: the study's islands and data; DiLoCo's at H = 1, fp32,
    plain averaging."""
    return ((result["peers"], result["batch_size"], result["steps"], result["data"], result["d_model"], result["optimizer"],
             result.get("clip", CLIP)) == (PEERS, BATCH, steps, "shards", D_MODEL, "adamw", CLIP)
            and (result["method"] == "syncdp" or (result["inner_steps"], result["compression"], result["outer_lr"],
                                                  result["outer_momentum"], result["schedule"]) == (1, "none", 1.0, 0.0, "fixed")))


def _tuned(grid: list[Run], done: dict[str, dict], low: float, high: float) -> tuple[Run | None, Run | None]:
    """A grid of runs (one method, sorted by lr) against the runs ``done``: (its best, None) once all are done and
    the best is bracketed or at a limit in [``low``, ``high``]; (None, the next run) while the best is at its edge;
    (None, None) while some are still to run."""
    if not all(run.key in done for run in grid):
        return None, None
    best = min(grid, key=lambda run: done[run.key]["final_loss"])
    past = _past_edge([run.inner_lr for run in grid], best.inner_lr, low, high)
    return (best, None) if past is None else (None, replace(best, inner_lr=past))


def _floor_length_plan(results: list[dict]) -> list[Run]:
    """Phase floor-length: at each of FLOOR_LENGTHS, on its own, sync DP's lr grid grown at its edge until it brackets
    its best; then DiLoCo at H = 1 at FLOOR_LENGTH_FACTORS of that best, grown likewise (within INNER_LR_LIMIT); then
    both bests at SEEDS[1:], seed by seed."""
    done = {r["key"]: r for r in results}
    runs: list[Run] = []
    for steps in FLOOR_LENGTHS:
        bests: list[Run] = []
        base = None
        for method in ("syncdp", "diloco"):
            lrs = FLOOR_LENGTH_DP_LRS if base is None else tuple(base * f for f in FLOOR_LENGTH_FACTORS)
            tried = {r["inner_lr"] for r in results if _floor_length(r, steps) and r["method"] == method and r["seed"] == 0}
            grid = [Run(method, lr, steps=steps) for lr in sorted({*lrs, *tried})]
            limits = (0.0, float("inf")) if base is None else (base / INNER_LR_LIMIT, base * INNER_LR_LIMIT)
            best, grow = _tuned(grid, done, *limits)
            runs += [*grid, *([grow] if grow else [])]
            if best is None:
                break
            bests.append(best)
            base = best.inner_lr
        if len(bests) == 2:  # seed by seed, both methods: a run cut short still leaves whole pairs
            runs += [replace(best, seed=s) for s in SEEDS[1:] for best in bests]
    return runs


def _floor_clip(result: dict) -> bool:
    """A run of phase floor-clip (any seed): the study's size, unclipped or DiLoCo's islands clipped at one of
    FLOOR_CLIP_ISLAND_NORMS; sync DP, or DiLoCo at H = 1, fp32, plain averaging, or at a FLOOR_CLIP_CARRIED point."""
    clip = result.get("clip", CLIP)
    if not ((clip == 0 or (clip in FLOOR_CLIP_ISLAND_NORMS and result["method"] == "diloco"))
            and _standard(dict(result, clip=CLIP))):
        return False
    outer = (result["inner_steps"], result["compression"], result["outer_lr"], result["outer_momentum"])
    return result["method"] == "syncdp" or outer == (1, "none", 1.0, 0.0) or outer in {p[:4] for p in FLOOR_CLIP_CARRIED}


def _floor_clip_plan(lr: float, results: list[dict]) -> list[Run]:
    """Phase floor-clip, given the clipped sync DP's best ``lr``: DiLoCo at H = 1 unclipped at FLOOR_CLIP_FACTORS of
    it and sync DP unclipped at FLOOR_CLIP_DP_FACTORS, each grid grown at its edge; once both are bracketed, both
    bests at SEEDS[1:], then FLOOR_CLIP_CARRIED; and DiLoCo at H = 1 with its islands clipped at each of
    FLOOR_CLIP_ISLAND_NORMS, at FLOOR_CLIP_FACTORS grown at the edge, then its best at SEEDS[1:]."""
    done = {r["key"]: r for r in results}
    runs: list[Run] = []
    bests: list[Run] = []
    for method, factors, clip in (("diloco", FLOOR_CLIP_FACTORS, 0.0), ("syncdp", FLOOR_CLIP_DP_FACTORS, 0.0),
                                  *(("diloco", FLOOR_CLIP_FACTORS, norm) for norm in FLOOR_CLIP_ISLAND_NORMS)):
        tried = {r["inner_lr"] for r in results if _floor_clip(r) and r["method"] == method and r["seed"] == 0
                 and r["inner_steps"] == 1 and r["clip"] == clip}
        grid = [Run(method, x, clip=clip) for x in sorted({*(lr * f for f in factors), *tried})]
        best, grow = _tuned(grid, done, lr / INNER_LR_LIMIT, lr * INNER_LR_LIMIT)
        runs += [*grid, *([grow] if grow else [])]
        if best is None:
            continue
        bests.append(best)
        if clip:  # the islands clipped at a higher norm, against the clipped sync DP: their best's seeds
            runs += [replace(best, seed=s) for s in SEEDS[1:]]
        elif len(bests) == 2:  # the unclipped pair, both bracketed
            runs += [replace(best, seed=s) for best in bests for s in SEEDS[1:]]
            runs += [Run("diloco", lr * f, inner_steps=h, compression=c, outer_lr=o, outer_momentum=m, reducer_feedback=True,
                         clip=0.0) for h, c, o, m, f in FLOOR_CLIP_CARRIED]
    return runs


def probe_runs(results: list[dict]) -> list[tuple[Run, float]]:
    """FLOOR_PROBES' and FLOOR_MORE_PROBES' runs, each with the lr of the sync DP it is compared with (its optimizer's,
    at its batch, steps and clip), those whose sync DP is tuned."""
    best = _best(results, method="syncdp")
    base = {("adamw", BATCH): best and best["inner_lr"], ("muon", BATCH): _muon_dp(results),
            ("adamw", ISLAND_BATCH): _island_syncdp(results)}
    runs = [(Run("diloco", base[opt, batch] * f, batch_size=batch, optimizer=opt,
                 steps=STEPS if batch == BATCH else ISLAND_STEPS[0]), base[opt, batch])
            for opt, batch, f in FLOOR_PROBES if base[opt, batch] is not None]
    for steps, clip, f in FLOOR_MORE_PROBES:
        lr = _tuned_lr([r for r in results if (_floor_clip(r) if clip == 0 else _floor_length(r, steps)) and r["steps"] == steps])
        if lr is not None:
            runs.append((Run("diloco", lr * f, steps=steps, clip=clip), lr))
    return runs


def _tuned_lr(runs: list[dict]) -> float | None:
    """The best lr of these runs' sync DP grid at seed 0, once the grid brackets it."""
    grid = {r["inner_lr"]: r["final_loss"] for r in runs if r["method"] == "syncdp" and r["seed"] == 0}
    best = min(grid, key=grid.get) if grid else None
    return best if grid and min(grid) < best < max(grid) else None
