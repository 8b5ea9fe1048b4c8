"""The learning study's grids, what each phase tries (each with why), and how a grid's best is read from the
results so far: the plans (experiments/learning_plan.py, experiments/learning_floor.py) and the report build on them."""

from __future__ import annotations

from experiments.learning_runs import BATCH, CLIP, D_MODEL, PEERS, STEPS, Run

SYNC_DP_LRS = (1e-3, 2e-3, 4e-3, 8e-3)  # inner (AdamW) peak lr grid, shared: DiLoCo uses sync DP's best
DILOCO_POINTS = ((10, "int8"), (40, "int8"), (120, "int8"), (160, "int4"))  # (H, codec): 39x, 158x, 473x, 1138x
OUTER_GRID = ((1.0, 0.0), (0.7, 0.9), (0.35, 0.9), (0.8, 0.6))  # (outer lr, Nesterov momentum)
SEEDS = (0, 1, 2)
INNER_LR_FACTORS = (0.5, 2.0)  # DiLoCo's inner lr tried at these multiples of sync DP's, at every H
INNER_LR_LIMIT = 8.0  # the grid grows past its edge (halving or doubling) while the best is there, up to this factor
PLOT_GAP_LIMIT = 0.6  # the picture leaves out runs further behind than this (they stay in the table)
SPARSE_H = (10, 24)  # top-k + 2 bits (0.094 B/value): 427x and 1024x fewer bytes than fp32 sync DP
# larger islands (the "small islands" suspect): 4x the sequences per inner step, the same tokens (so 4x fewer steps),
# and 3x the tokens where H = 120 needs it for 30 outer steps; sync DP at the same global batch and steps, retuned
ISLAND_BATCH = 8
ISLAND_STEPS = (1200, 3600)
ISLAND_DP_LRS = (4e-3, 8e-3, 16e-3)
# (H, codec, outer lr, momentum, inner steps, DiLoCo's inner lr as multiples of sync DP's best at this size), the
# longest first so that two jobs end together
ISLAND_POINTS = ((120, "int8", 0.8, 0.6, 3600, (0.5,)), (40, "int8", 0.7, 0.9, 1200, (0.5, 1.0)),
                 (10, "int8", 0.35, 0.9, 1200, (0.5,)))
# model size (the "small model" suspect): the default model's width halved and doubled (about 1/4 and 4x the params),
# the same tokens; sync DP over a small lr grid at each width (grown at the edge where the best was: 16e-3 at d 64,
# 1e-3 and 5e-4 at d 256), DiLoCo at the 473x point with the outer optimizer the standard study found there and its
# inner lr at 1/2 of each sync DP lr (its rule); the smaller width first
SIZE_POINTS = ((64, (4e-3, 8e-3, 16e-3)), (256, (5e-4, 1e-3, 2e-3, 4e-3)))  # (d_model, sync DP's lr grid)
SIZE_DILOCO = (120, "int8", 0.8, 0.6)  # (H, codec, outer lr, momentum)
SIZE_SEEDS = (1,)  # once a width's grid is done: its best sync DP lr and DiLoCo inner lr again at these seeds
# cheaper codecs at the targets' bytes, so more rounds (the gap grows with H): (H, codec, outer optimizers); the inner lr
# at 1/2 of sync DP's best (the study's rule), both error feedbacks on (the peer's default), the outer optimizer the
# study found nearest each H (and 0.8 / 0.6 at H = 32 too, what Muon islands did best with); int2 at H = 32 and 80 is
# 410x and 1024x fewer bytes than fp32 sync DP, int4 at H = 60 and 150 427x and 1067x
LOW_BIT_POINTS = ((32, "int2", ((0.7, 0.9), (0.8, 0.6))), (80, "int2", ((0.8, 0.6),)), (60, "int4", ((0.7, 0.9),)),
                  (150, "int4", ((0.8, 0.6),)))
LOW_BIT_TARGETS = (400, 1000)  # once the grid is done: each codec's best at each target's bytes (to the next) at SEEDS[1:]
# Muon as the inner optimizer (MuLoCo, Therien et al. 2025: with error feedback it kept 2-bit outer gradients close to
# uncompressed): the block matrices step with Muon (train/inner_optimizer.py, torch's arithmetic; its update scaled
# to AdamW's RMS, so AdamW's lr and weight decay carry over), the embeddings, biases and norms with AdamW. Sync DP
# with the same optimizer over its own lr grid, so that the gap is also taken to the better of the two baselines;
# DiLoCo at the low-bit phase's best settings at the targets' bytes, its inner lr at 1/2 of AdamW sync DP's best (the
# study's rule; the lrs are on the same scale). A Muon DiLoCo seed counts where AdamW sync DP ran that seed too
MUON_DP_LRS = (2e-3, 4e-3, 8e-3)
# (H, codec, outer optimizers): 410x, 427x, 1024x; the low-bit phase's best outer optimizer at each, then 0.8 / 0.6
# (less momentum: it won at H = 80) and plain averaging (less still)
MUON_POINTS = ((32, "int2", ((0.7, 0.9), (0.8, 0.6), (1.0, 0.0))), (60, "int4", ((0.7, 0.9), (0.8, 0.6))),
               (80, "int2", ((0.8, 0.6), (1.0, 0.0))))
# Muon islands' inner lr apart from the 1/2 rule: (H, codec, outer lr, momentum, multiples of AdamW sync DP's best).
# At H = 32, 1x beat 1/2 (and 1/4 lost): 2x too, and 1x at the 1024x and 427x points and at the curve's cheap end
# (int8 at H = 10, 39x fewer bytes)
MUON_INNER_LRS = ((32, "int2", 0.8, 0.6, (0.25, 1.0, 2.0)), (80, "int2", 0.8, 0.6, (1.0,)), (10, "int8", 0.8, 0.6, (1.0,)),
                  (60, "int4", 0.8, 0.6, (1.0,)))
# the outer optimizer again at Muon islands' own inner lr (1x, larger outer gradients than at 1/2, where 0.8 / 0.6 won
# between 0.7 / 0.9 and plain averaging): (H, codec, multiple of AdamW sync DP's best, outer optimizers) around 0.8 /
# 0.6, whose steady step is lr / (1 - momentum) = 2 times the outer gradient: 1.33 and 1.5 times (less), 2.5 and 3.2
MUON_OUTER_GRID = ((32, "int2", 1.0, ((0.8, 0.4), (0.6, 0.6), (1.0, 0.6), (0.8, 0.75))),)
# points off the targets' bytes at SEEDS[1:] too, (H, codec, outer lr, momentum, multiple of AdamW sync DP's best):
# the curve's cheap end (39x), where the gap left is the method's, not the bytes'
MUON_SEEDED = ((10, "int8", 0.8, 0.6, 1.0),)
# iid data (the study's open question): DiLoCo on iid data averages more alike outer gradients, so its outer step is
# longer at the same inner lr; the first iid run again at these multiples of its inner lr (1/2 won: 1/4 too), and on
# the shards at the first, the islands' agreement measured on both
IID_INNER_LR_FACTORS = (0.5, 0.25)
# a warm-up of the outer lr (the suggestion; OuterConfig.warmup_steps): the 410x point's best settings for
# each inner optimizer, (optimizer, H, codec, outer lr, momentum, multiple of sync DP's best lr, warm-ups in rounds)
OUTER_WARMUP_POINTS = (("adamw", 32, "int2", 0.8, 0.6, 0.5, (10, 30)), ("muon", 32, "int2", 0.8, 0.6, 1.0, (10,)))
# the gap's floor: DiLoCo averaging every inner step (H = 1, fp32 outer gradients, plain averaging), so the islands
# never drift apart and what is left is each island's own optimizer stepping on a quarter of sync DP's batch (the
# mean of 4 AdamW or Muon updates, not one update of the mean gradient): (optimizer, multiples of sync DP's best lr),
# each grid grown past its edge while its best is there, then its best at SEEDS[1:]; and AdamW at H = 1 with the
# outer optimizer H = 10 does best with (FLOOR_NESTEROV: lr, momentum, multiple)
FLOOR_POINTS = (("adamw", (0.5, 1.0)), ("muon", (1.0,)))
FLOOR_NESTEROV = (0.35, 0.9, 0.5)
# the best AdamW floor's inner lr and plain averaging carried to these (H, codec): the curve's cheap end (39x), where
# the grid tried plain averaging at sync DP's inner lr only
FLOOR_CARRIED = ((10, "int8"),)
# the same floor with islands of ISLAND_BATCH sequences at the same tokens (ISLAND_STEPS[0] steps), against sync DP
# tuned at that global batch (phase islands-syncdp): multiples of its best lr. Less noise per island's step, so its
# optimizer's step was expected nearer to the one a single machine would make of the mean gradient (the probe found
# the mean of their steps no nearer to sync DP's, and phase floor-length their lower floor to be their fewer steps:
# docs/learning.md, "The gap's floor")
FLOOR_ISLAND_FACTORS = (0.5, 1.0)
# the floor against the run's length: islands of BATCH sequences over FLOOR_LENGTHS steps instead of STEPS (phase
# floor), the tokens and the lr schedule with them. 1,200 is the larger islands' step count (1/4 of their tokens), so
# that their lower floor can be told apart from their fewer steps; 2,400 is half way to STEPS; 9,600 (2 x STEPS) asks
# whether the floor shrinks past the study's length (+1.1%, +4.6% and +3.5% at 1,200, 2,400, 4,800). At each length sync DP
# at its global batch over FLOOR_LENGTH_DP_LRS, DiLoCo at H = 1 (fp32, plain averaging) at FLOOR_LENGTH_FACTORS of its
# best, each grid grown at its edge; then both bests at SEEDS[1:]
FLOOR_LENGTHS = (ISLAND_STEPS[0], 2 * ISLAND_STEPS[0], 2 * STEPS)
FLOOR_LENGTH_DP_LRS = (2e-3, 4e-3, 8e-3)
# the peer's overlap (docs/design.md §2): a peer keeps training while its round's average is on the wire and keeps that
# work when the average lands (local <- global + (local - snapshot)), so the outer step reaches its params some inner
# steps late; the study's other runs apply it before the next inner step. How late, in the swarm runs' records
# (steps_during_averaging over the round's inner steps): ~4% of H on one machine's loopback, a median of 14% (90th
# percentile 41%) in the chaos runs, at most 100% (a peer waits rather than start a second average). The 410x and
# 1024x points' best AdamW settings with that many inner steps of overlap, (H, codec, outer lr, momentum, multiple of
# sync DP's best lr, overlaps in inner steps); then the quarter-round overlaps at SEEDS[1:] (OVERLAP_SEEDED: (H, overlap))
OVERLAP_POINTS = ((32, "int2", 0.8, 0.6, 0.5, (1, 8, 32)), (80, "int2", 0.8, 0.6, 0.5, (20, 80)))
OVERLAP_SEEDED = ((32, 8), (80, 20))
# eager updates (Kale, Douillard, Donchev 2025, arXiv 2502.12996): the steps taken meanwhile start from the outer
# step's preview with an estimate of the average (the island's own outer gradient for 1/n of it, the last round's
# average for the rest) instead of from the island's own params; (H, overlap) at seed 0 (at a quarter round it came to
# +26.2% against the plain overlap's +14.6%: not seeded)
OVERLAP_EAGER = ((32, 8), (32, 32))
# the other choice a peer has, waiting for the average instead of training meanwhile: in the wall time of the overlapped
# run it trains H / (H + overlap) of the tokens (a shorter run, its lr schedule over its own length); (H, overlap) at
# seed 0, compared with the overlapped run by the loss itself
OVERLAP_WAITING = ((32, 8), (32, 32))
FLOOR_LENGTH_FACTORS = (1.0, 2.0)
# the floor without gradient clipping (--grad-clip-norm 0): an island's gradient on its 2 sequences is clipped to norm
# 1 on 94-100% of its steps, so each island's step is scaled by its own quarter batch's noise (the probe: "The floor's
# steps"); unclipped, only AdamW's second moment normalizes it. Sync DP unclipped too, over FLOOR_CLIP_DP_FACTORS of
# the clipped sync DP's best lr, the gap taken to each and to the better of the two at each seed; DiLoCo at H = 1
# (fp32, plain averaging) at FLOOR_CLIP_FACTORS of that lr (phase floor's grid); each grid grown at its edge, then both
# bests at SEEDS[1:]; then FLOOR_CLIP_CARRIED, the 410x point (H, codec, outer lr, momentum, multiple of the clipped
# sync DP's best lr) with unclipped islands, seed 0
FLOOR_CLIP_DP_FACTORS = (0.5, 1.0, 2.0)
FLOOR_CLIP_FACTORS = (1.0, 2.0)
FLOOR_CLIP_CARRIED = ((32, "int2", 0.8, 0.6, 0.5),)
# and islands clipped at a higher norm against the clipped sync DP: sqrt(PEERS) x its clip, the ratio of the noise in
# a quarter batch's gradient to the whole batch's, so that an island's clipping acts about as often as sync DP's
FLOOR_CLIP_ISLAND_NORMS = (CLIP * PEERS ** 0.5,)
# the floor's mechanism (``probe``, _FloorProbe): these floor runs (seed 0) again with sync DP's step measured beside
# each of theirs, (optimizer, sequences per island, multiple of that sync DP's best lr): each optimizer at its sync
# DP's lr and at its best floor's (2x; Muon first: the longest), AdamW past it (4x), the larger islands at their best
FLOOR_PROBES = (("muon", BATCH, 2.0), ("adamw", BATCH, 1.0), ("adamw", BATCH, 2.0), ("adamw", ISLAND_BATCH, 1.0),
                ("muon", BATCH, 1.0), ("adamw", BATCH, 4.0))
# and AdamW floor runs of phases floor-clip and floor-length, (steps, clip, multiple of the best lr of the sync DP at
# the same steps and clip): the unclipped floor at its best (is the mean step short without the clipping?); the
# shortest length's at its best (1x) and at the 4,800-step floor's best (2x) (why the best lr moves with the length)
FLOOR_MORE_PROBES = ((STEPS, 0.0, 1.0), (FLOOR_LENGTHS[0], CLIP, 1.0), (FLOOR_LENGTHS[0], CLIP, 2.0))


def _standard(result: dict) -> bool:
    """A run of the study's own size on the peers' shards with AdamW, its gradients clipped as a peer clips them, its
    average applied before the next inner step (the one-island checks, the iid runs, other widths, the Muon runs, the
    unclipped ones and the overlapped ones are not)."""
    return ((result["peers"], result["batch_size"], result["steps"], result["data"], result.get("d_model", D_MODEL),
             result.get("optimizer", "adamw"), result.get("clip", CLIP), result.get("overlap", 0))
            == (PEERS, BATCH, STEPS, "shards", D_MODEL, "adamw", CLIP, 0))


def _best(results: list[dict], **match) -> dict | None:
    """The standard run with the lowest final loss among those of seed 0 matching every ``match`` field."""
    runs = [r for r in results if _standard(r) and r["seed"] == 0 and all(r[k] == v for k, v in match.items())]
    return min(runs, key=lambda r: r["final_loss"]) if runs else None


def _same_outer(run: dict, other: dict) -> bool:
    """Same H, codec and outer optimizer."""
    return all(run[k] == other[k] for k in ("inner_steps", "compression", "outer_lr", "outer_momentum"))


def _past_edge(tried: list[float], best: float, low: float = 0.0, high: float = float("inf")) -> float | None:
    """The lr a grid tries next while its best is at its edge: the best doubled at the top (first: a grid of one
    grows upward), halved at the bottom, if that stays within [``low``, ``high``]; None once the grid brackets its
    best or the limit is reached. ``tried``: the grid's lrs, sorted."""
    if best == tried[-1] and best * 2 <= high:
        return best * 2
    if best == tried[0] and best / 2 >= low:
        return best / 2
    return None


def _like(best: dict, **changes) -> Run:
    """``best``'s DiLoCo run with ``changes``."""
    fields = dict(inner_steps=best["inner_steps"], compression=best["compression"], outer_lr=best["outer_lr"],
                  outer_momentum=best["outer_momentum"], schedule=best["schedule"], reducer_feedback=best["reducer_feedback"])
    return Run("diloco", **{"inner_lr": best["inner_lr"], **fields, **changes})


def _island_syncdp_grid(results: list[dict]) -> tuple[list[float], float | None]:
    """Sync DP's lrs tried at the larger islands' size (seed 0, the shorter run), sorted, and the best of them."""
    short = [r for r in results if r["method"] == "syncdp" and r["batch_size"] == ISLAND_BATCH and r["peers"] == PEERS
             and r["steps"] == ISLAND_STEPS[0] and r["seed"] == 0 and r["data"] == "shards"]
    best = min(short, key=lambda r: r["final_loss"])["inner_lr"] if short else None
    return sorted(r["inner_lr"] for r in short), best


def _island_syncdp(results: list[dict]) -> float | None:
    """Sync DP's best lr at the larger islands' size, once its grid brackets it (islands-syncdp)."""
    tried, best = _island_syncdp_grid(results)
    return best if tried and tried[0] < best < tried[-1] else None


def _muon_runs(results: list[dict], method: str) -> list[dict]:
    return [r for r in results if r["method"] == method and r.get("optimizer") == "muon" and _standard(dict(r, optimizer="adamw"))]


def _muon_dp(results: list[dict]) -> float | None:
    """Muon sync DP's best lr at seed 0, once its grid brackets it (or reached INNER_LR_LIMIT from the first grid)."""
    grid = {r["inner_lr"]: r["final_loss"] for r in _muon_runs(results, "syncdp") if r["seed"] == 0}
    if not set(MUON_DP_LRS) <= set(grid):
        return None
    best, tried = min(grid, key=grid.get), sorted(grid)
    low, high = MUON_DP_LRS[0] / INNER_LR_LIMIT, MUON_DP_LRS[-1] * INNER_LR_LIMIT
    if _past_edge(tried, best, low, high) is not None:
        return None  # at the grid's edge: look past it first
    return best
