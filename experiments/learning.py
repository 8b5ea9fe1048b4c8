"""The learning study: DiLoCo's loss gap to tuned synchronous data parallel, against bytes on the wire per token.

    python scripts/learning_study.py run --out docs/learning [--jobs 2] [--phase tune-syncdp outer-grid seeds]
    python scripts/learning_study.py probe --out docs/learning [--jobs 2]
    python scripts/learning_study.py report --out docs/learning

Both methods are computed in one process each, without a network (as equal_tokens.py does, whose arithmetic this
shares), on the default model and the built-in corpus, with the settings the papers tune on (docs/learning.md):

- **the same budget**: ``STEPS`` inner steps per island, ``PEERS`` islands of ``BATCH`` sequences each; sync DP takes
  ``STEPS`` steps at the global batch (``PEERS x BATCH`` sequences, one forward of all of them: the mean of the
  shards' mean losses, as they are equal in size), so both see exactly the same tokens;
- **the same inner lr schedule**: linear warm-up over ``WARMUP`` steps, then a cosine decay to ``FINAL_LR_FRACTION``
  of the peak at the last step, indexed by the inner step (each island's AdamW keeps its state across rounds, as a
  peer's does);
- **the codec on both hops**: a sender's outer gradient goes through the codec (int4 with the sender's error
  feedback, as a peer sends it), the group's mean goes through it again (the reducer's re-encode);
- **one held-out set**: the loss at the end is measured on ``FINAL_EVAL_BATCHES`` batches of 16 held-out sequences
  (the same for every run); the curve on the way on the first 4 of them.

Each finished run is appended to ``results.jsonl`` under ``--out`` at once; ``run`` skips the runs already there,
so the study resumes where it stopped (and can grow across sessions). ``probe`` runs some of phase floor's runs again
with sync DP's step measured beside each of theirs (_FloorProbe), into ``floor_probe.jsonl``. ``report`` writes
``study.md`` (the tables) and ``study.png`` (the gap against bytes per token, seeds as a band) from those files alone
(experiments/learning_report.py).

Wire bytes per token count what one peer sends per token it trained: in a butterfly all-reduce of n peers each
sends (n - 1)/n of its outer gradient to the reducers and each reducer sends (n - 1)/n of its averaged part back,
so 2 (n - 1)/n x params x codec bytes per value per round, over H x batch tokens; fp32 sync DP sends the same
every step with 4 bytes per value. The ratio to fp32 sync DP is 4 H / bytes per value.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, as_completed, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from p2p_diloco.core.compression import make_codec
from p2p_diloco.core.config import COMPRESSIONS, INNER_OPTIMIZERS, DataConfig, InnerConfig, ModelConfig, OuterConfig
from p2p_diloco.core.feedback import FEEDBACK_CODECS, ErrorFeedback
from p2p_diloco.core.link import codec_round_trip
from p2p_diloco.core.outer import OuterOptimizer
from p2p_diloco.core.portable import fp32
from p2p_diloco.core.schedule import lr_factor as schedule_factor
from p2p_diloco.train.data import Dataset
from p2p_diloco.train.inner_optimizer import build_inner_optimizer
from p2p_diloco.train.model import build_model

PEERS = 4  # islands, and sync DP's data-parallel workers
BATCH = 2  # sequences per inner step per island (x 128 tokens): sync DP's global batch is PEERS x BATCH
STEPS = 4800  # inner steps per island: 30 outer steps at H = 160, 480 at H = 10; every H on the curve divides it
WARMUP = 100  # inner steps of linear lr warm-up, shared by both methods
FINAL_LR_FRACTION = 0.1  # the cosine decay ends at this fraction of the peak lr
FINAL_EVAL_BATCHES = 16  # batches of 16 held-out sequences for the final loss (262,144 tokens)
CURVE_POINTS = 24  # evaluations on the way (at the outer step nearest to each 1/24 of the run)

SYNC_DP_LRS = (1e-3, 2e-3, 4e-3, 8e-3)  # inner (AdamW) peak lr grid, shared: DiLoCo uses sync DP's best
DILOCO_POINTS = ((10, "int8"), (40, "int8"), (120, "int8"), (160, "int4"))  # (H, codec): 39x, 158x, 473x, 1138x
OUTER_GRID = ((1.0, 0.0), (0.7, 0.9), (0.35, 0.9), (0.8, 0.6))  # (outer lr, Nesterov momentum)
SEEDS = (0, 1, 2)
INNER_LR_FACTORS = (0.5, 2.0)  # DiLoCo's inner lr tried at these multiples of sync DP's, at every H
INNER_LR_LIMIT = 8.0  # the grid grows past its edge (halving or doubling) while the best is there, up to this factor
SCHEDULES = ("fixed", "grow")
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
D_MODEL = ModelConfig().d_model
CLIP = InnerConfig().grad_clip_norm  # the peer's gradient clipping: the global norm clipped to this
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


@dataclass(frozen=True)
class Run:
    """One training run of the study: sync DP, or DiLoCo at one H, codec and outer optimizer."""

    method: str  # "syncdp" or "diloco"
    inner_lr: float
    seed: int = 0
    inner_steps: int = 1  # H (sync DP: 1, it communicates every step)
    compression: str = "none"  # sync DP: fp32 gradients
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    steps: int = STEPS
    peers: int = PEERS
    batch_size: int = BATCH
    eval_batches: int = FINAL_EVAL_BATCHES
    schedule: str = "fixed"  # "grow": the same number of rounds, H rising from H/2 to 3H/2 (round_ends)
    reducer_feedback: bool = False  # the reducer's re-encode keeps its error for the next round (a stable group)
    data: str = "shards"  # "shards": each island a contiguous quarter of the corpus (as peers); "iid": all of it
    d_model: int = D_MODEL  # the built-in model's width (its layers, heads and context stay the default's)
    optimizer: str = "adamw"  # the inner optimizer (sync DP's only one): "adamw", or "muon" for the block matrices
    outer_warmup: int = 0  # outer updates over which the outer lr rises linearly (OuterConfig.warmup_steps)
    clip: float = CLIP  # the inner steps' gradient norm clip (InnerConfig.grad_clip_norm; 0: none)
    overlap: int = 0  # inner steps each island trains while its round's average is on the wire (OVERLAP_POINTS)
    eager: bool = False  # with overlap: those steps start from the outer step's preview with an estimated average

    def __post_init__(self) -> None:
        if self.optimizer not in INNER_OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(INNER_OPTIMIZERS)}, got {self.optimizer!r}")
        if self.data not in ("shards", "iid"):
            raise ValueError(f"data must be shards or iid, got {self.data!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.method not in ("syncdp", "diloco"):
            raise ValueError(f"method must be syncdp or diloco, got {self.method!r}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.clip < 0:
            raise ValueError(f"clip must be >= 0, got {self.clip}")
        if self.steps % self.inner_steps:
            raise ValueError(f"H = {self.inner_steps} does not divide the {self.steps} inner steps")
        if not 0 <= self.overlap <= (self.inner_steps if self.method == "diloco" else 0):
            raise ValueError(f"overlap must be between 0 and H (DiLoCo; 0 for sync DP), got {self.overlap}")
        if self.eager and not self.overlap:
            raise ValueError("eager needs an overlap: it changes where the steps taken meanwhile start")

    @property
    def key(self) -> str:
        size = "" if (self.peers, self.batch_size, self.steps) == (PEERS, BATCH, STEPS) else (
            f" peers={self.peers} batch={self.batch_size} steps={self.steps}")
        size += " data=iid" if self.data == "iid" else ""
        size += f" d={self.d_model}" if self.d_model != D_MODEL else ""
        size += f" {self.optimizer}" if self.optimizer != "adamw" else ""
        size += f" clip={self.clip:g}" if self.clip != CLIP else ""
        if self.method == "syncdp":
            return f"syncdp lr={self.inner_lr:g} seed={self.seed}{size}"
        schedule = "" if self.schedule == "fixed" else f" {self.schedule}"
        schedule += " reducer-feedback" if self.reducer_feedback else ""
        size += f" outer-warmup={self.outer_warmup}" if self.outer_warmup else ""
        size += f" overlap={self.overlap}" if self.overlap else ""
        size += " eager" if self.eager else ""
        return (f"diloco H={self.inner_steps}{schedule} {self.compression} lr={self.inner_lr:g} "
                f"outer={self.outer_lr:g}/{self.outer_momentum:g} seed={self.seed}{size}")

    def round_ends(self) -> list[int]:
        """The inner step at which each round ends. ``fixed``: every H steps. ``grow``: as many rounds (the same
        bytes), H rising linearly from about H/2 to 3H/2, so that more of the bytes go to the early rounds, where
        the islands drift apart fastest: round r of R ends at steps x x (1 + x) / 2, x = r / R."""
        rounds = self.steps // self.inner_steps
        if self.schedule == "fixed":
            return [self.inner_steps * (r + 1) for r in range(rounds)]
        return [round(self.steps * (r / rounds) * (1 + r / rounds) / 2) for r in range(1, rounds + 1)]

    @property
    def bytes_per_value(self) -> float:
        return 4.0 if self.method == "syncdp" else make_codec(self.compression).bytes_per_value()

    def wire_bytes_per_token(self, params: int, seq_len: int) -> float:
        """What one peer sends per token it trained (module docstring)."""
        sent_per_round = 2 * (self.peers - 1) / self.peers * params * self.bytes_per_value
        return sent_per_round / (self.inner_steps * self.batch_size * seq_len)

    @property
    def fewer_bytes_than_syncdp(self) -> float:
        return 4.0 * self.inner_steps / self.bytes_per_value


def lr_factor(step: int, steps: int, warmup: int = WARMUP, final: float = FINAL_LR_FRACTION) -> float:
    """The inner lr at ``step`` (0-based) as a fraction of the peak: the peer's schedule (core/schedule.py) with a
    linear warm-up over ``warmup`` steps and a cosine decay to ``final`` at the run's last step."""
    return schedule_factor(step, warmup, steps, final)


def _shards(run: Run) -> tuple[ModelConfig, list[Dataset], list]:
    torch.set_num_threads(1)
    config = ModelConfig(d_model=run.d_model)
    if run.data == "iid":  # every island samples windows of the whole training set, each in its own order
        shards = [Dataset(DataConfig(num_shards=1), config.seq_len, run.batch_size, run.seed + 104_729 * i)
                  for i in range(run.peers)]
    else:
        shards = [Dataset(DataConfig(num_shards=run.peers, shard_index=i), config.seq_len, run.batch_size, run.seed)
                  for i in range(run.peers)]
    held_out = Dataset(DataConfig(num_shards=run.peers, shard_index=0), config.seq_len, 16, 0).eval_batches(run.eval_batches)
    return config, shards, held_out


def _evaluate(model: torch.nn.Module, batches: list) -> float:
    model.eval()
    with torch.no_grad():
        return sum(model(x, y).item() for x, y in batches) / len(batches)


def _inner_optimizer(model: torch.nn.Module, run: Run) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The inner optimizer, as a peer builds it (train/inner_optimizer.py: AdamW, or Muon on the blocks' matrices and
    AdamW on the rest), and its lr schedule."""
    optimizer = build_inner_optimizer(run.optimizer, model, run.inner_lr, InnerConfig().weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, run.steps))


def _step(model: torch.nn.Module, optimizer, schedule, inputs, targets, grads: list | None = None, clip: float = CLIP) -> None:
    """One inner step, its gradient's norm clipped to ``clip`` (0: not clipped); ``grads``, when given, gets a copy of
    the step's gradients before clipping (_FloorProbe)."""
    model.train()
    loss = model(inputs, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grads is not None:
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
    if clip:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
    optimizer.step()
    schedule.step()


def _curve_every(run: Run) -> int:
    """Rounds between evaluations on the way: about CURVE_POINTS of them in all."""
    return max(1, run.steps // run.inner_steps // CURVE_POINTS)


class _FloorProbe:
    """What the mean of the islands' steps is against the step sync DP would take from the same params on the same
    batches (phase floor's mechanism, docs/learning.md "The gap's floor"). At H = 1 every island steps from the global
    params, so the mean of their gradients is sync DP's gradient there (the shards' batches are equal in size); a
    shadow copy of the model with its own inner optimizer at sync DP's lr takes that gradient each step, and its step
    is compared with the islands' averaged one. The shadow never touches the run: the trajectory, and so the final
    loss, are the run's own. Per step: the mean step's length against the shadow's, its part along the shadow's step
    and across it (both as fractions of the shadow's length), their cosine, one island's step (RMS) against the
    shadow's, how often the gradient clipping acts on an island and on the shadow; at each quarter's end, AdamW's
    divisor (the square root of its second moment, where the optimizer keeps one) of an island against the shadow's,
    coordinate by coordinate (the median)."""

    def __init__(self, run: Run, config: ModelConfig, shadow_lr: float, optimizers: list[tuple]):
        if (run.method, run.inner_steps, run.compression, run.outer_lr, run.outer_momentum, run.schedule) != (
                "diloco", 1, "none", 1.0, 0.0, "fixed"):
            raise ValueError("the floor's probe needs DiLoCo at H = 1, fp32 (none) and plain averaging (outer 1 / 0)")
        if run.steps < 4:
            raise ValueError(f"the floor's probe reports quarters of the steps: it needs at least 4, got {run.steps}")
        self.shadow = build_model(config, run.seed)
        self.optimizer, self.schedule = _inner_optimizer(self.shadow, replace(run, inner_lr=shadow_lr))
        self.island_optimizers = [optimizer for optimizer, _ in optimizers]
        self.clip = run.clip  # the shadow clipped as the run's islands are (sync DP at the same setting)
        self.quarter_ends = {len(run.round_ends()) * q // 4 for q in range(1, 5)}
        self.grads: list[list[torch.Tensor]] = []  # the islands' gradients of this step, before clipping
        self.rows: list[dict] = []
        self.divisors: list[float] = []

    @torch.no_grad()
    def observe(self, global_params: list[torch.Tensor], average: list[torch.Tensor], sent: list[list[torch.Tensor]]) -> None:
        """After the islands' step (``sent``: each one's outer gradient, params minus island; ``average``: their
        mean, which the plain outer step subtracts from ``global_params``), before the outer step."""
        island_norms = [float(torch.cat([g.reshape(-1) for g in grads]).norm()) for grads in self.grads]
        for param, value, *grads in zip(self.shadow.parameters(), global_params, *self.grads):
            param.copy_(value)
            param.grad = torch.stack(grads).mean(0)
        self.grads.clear()
        shadow_norm = float(torch.nn.utils.get_total_norm([p.grad for p in self.shadow.parameters()]))
        if self.clip:
            torch.nn.utils.clip_grad_norm_(list(self.shadow.parameters()), self.clip)
        self.optimizer.step()
        self.schedule.step()
        shadow = [p - v for p, v in zip(self.shadow.parameters(), global_params)]
        length2 = sum(float(d.pow(2).sum()) for d in shadow)
        mean2 = sum(float(a.pow(2).sum()) for a in average)
        along = -sum(float((a * d).sum()) for a, d in zip(average, shadow))  # the mean step is -average
        islands2 = sum(float(v.pow(2).sum()) for values in sent for v in values) / len(sent)
        across2 = sum(float((a + along / length2 * d).pow(2).sum()) for a, d in zip(average, shadow))  # -a minus its part along
        self.rows.append(dict(length=(mean2 / length2) ** 0.5, along=along / length2, across=(across2 / length2) ** 0.5,
                              cosine=along / (mean2 * length2) ** 0.5, island_length=(islands2 / length2) ** 0.5,
                              island_clipped=sum(0 < self.clip < n for n in island_norms) / len(island_norms),
                              shadow_clipped=float(0 < self.clip < shadow_norm)))
        if len(self.rows) in self.quarter_ends:
            self.divisors.append(self._divisor())

    def _divisor(self) -> float | None:
        """The median over the coordinates (those with a second moment, the AdamW ones) of an island's AdamW divisor
        against the shadow's, sqrt(v_island / v_shadow), averaged over the islands; None without a second moment."""
        def second_moments(optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
            found = [s["exp_avg_sq"].reshape(-1) for s in optimizer.state.values() if "exp_avg_sq" in s]
            return torch.cat(found) if found else None

        shadow = second_moments(self.optimizer)
        if shadow is None:
            return None
        kept = shadow > 0
        ratios = [float((second_moments(o)[kept] / shadow[kept]).sqrt().median()) for o in self.island_optimizers]
        return sum(ratios) / len(ratios)

    def summary(self) -> dict:
        quarters = [self.rows[len(self.rows) * q // 4: len(self.rows) * (q + 1) // 4] for q in range(4)]
        return dict(quarters=[{k: round(sum(r[k] for r in rows) / len(rows), 4) for k in rows[0]}
                              | dict(divisor=None if divisor is None else round(divisor, 4))
                              for rows, divisor in zip(quarters, self.divisors)])


@torch.no_grad()
def preview(outer: OuterOptimizer, outer_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The global params ``outer.step(outer_grads)`` would leave, as new tensors, with its arithmetic (core/outer.py);
    the params, the momentum and the step count stay as they are (phase overlap's eager runs)."""
    lr = fp32(outer.current_lr)
    previews = []
    for param, buffer, grad in zip(outer.params, outer.momentum_buffers, outer_grads, strict=True):
        update = grad.to(param.device, torch.float32)
        if outer.momentum:
            update = buffer.mul(outer._momentum).add_(update).mul_(outer._momentum).add_(update)  # g + mu (mu m + g)
        previews.append(param.sub(update.mul(lr)))
    return previews


def train(run: Run, shadow_lr: float | None = None) -> dict:
    """One run from the seeded init to the end of its budget; its final held-out loss and the curve on the way. With
    ``shadow_lr`` (a floor run only), the same run with _FloorProbe's measurement beside it, sync DP's step at that lr."""
    if shadow_lr is not None and run.method != "diloco":
        raise ValueError("the floor's probe measures DiLoCo runs")
    started = time.monotonic()
    config, shards, held_out = _shards(run)
    probe = None
    tokens_per_step = run.peers * run.batch_size * config.seq_len  # swarm tokens per inner step (all islands)
    global_model = build_model(config, run.seed)
    params = sum(p.numel() for p in global_model.parameters())
    curve = [(0, _evaluate(global_model, held_out[:4]))]
    cosines: list[float] = []
    agreements: list[float] = []
    if run.method == "syncdp":
        optimizer, schedule = _inner_optimizer(global_model, run)
        for step in range(run.steps):
            batches = [shard.train.next_batch() for shard in shards]
            _step(global_model, optimizer, schedule, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]),
                  clip=run.clip)
            if (step + 1) % _curve_every(run) == 0:
                curve.append(((step + 1) * tokens_per_step, _evaluate(global_model, held_out[:4])))
    else:
        islands = [build_model(config, run.seed) for _ in range(run.peers)]
        optimizers = [_inner_optimizer(island, run) for island in islands]
        global_params = [p.data for p in global_model.parameters()]
        outer = OuterOptimizer(global_params, OuterConfig(lr=run.outer_lr, momentum=run.outer_momentum,
                                                              warmup_steps=run.outer_warmup))
        codec = make_codec(run.compression)
        feedback = [ErrorFeedback(codec) for _ in islands] if run.compression in FEEDBACK_CODECS else None
        reducer = ErrorFeedback(codec) if run.reducer_feedback else None
        probe = None if shadow_lr is None else _FloorProbe(run, config, shadow_lr, optimizers)

        ends, previous, last_average = run.round_ends(), None, None
        trained = [0] * run.peers  # inner steps each island has taken (with overlap, some of the next round's too)
        for round_index, end in enumerate(ends):
            sent, snapshots, raw = [], [], []
            for i, (island, (optimizer, schedule), shard) in enumerate(zip(islands, optimizers, shards)):
                for _ in range(end - trained[i]):
                    _step(island, optimizer, schedule, *shard.train.next_batch(), grads=None if probe is None else probe.grads,
                          clip=run.clip)
                trained[i] = end
                if run.overlap:
                    snapshots.append([p.detach().clone() for p in island.parameters()])
                outer_grad = [g - p.detach() for g, p in zip(global_params, island.parameters())]
                raw.append(outer_grad)
                if feedback:
                    values, residual = feedback[i].prepare(outer_grad)
                    feedback[i].commit(residual)
                    sent.append(values)
                else:
                    sent.append(codec_round_trip(codec, outer_grad))
            average = [torch.stack(parts).mean(0) for parts in zip(*sent)]
            # how alike the islands' outer gradients are: |mean|^2 / mean |g_i|^2, 1 when all send the same, 1/n when
            # they are orthogonal (the averaged step's length against one island's)
            agreements.append(sum(float(a.pow(2).sum()) for a in average)
                              / (sum(float(v.pow(2).sum()) for values in sent for v in values) / len(sent)))
            if probe is not None:
                probe.observe(global_params, average, sent)
            if reducer is not None:  # the reducer's re-encode, its error sent in the next round
                average, residual = reducer.prepare(average)
                reducer.commit(residual)
            else:  # the reducer's re-encode, as a peer makes it
                average = codec_round_trip(codec, average)
            flat = torch.cat([a.reshape(-1) for a in average])
            if previous is not None:  # how alike consecutive outer gradients are: momentum's gain depends on it
                cosines.append(float(torch.nn.functional.cosine_similarity(flat, previous, dim=0)))
            previous = flat
            if run.overlap and round_index + 1 < len(ends):  # the next round's first steps, before the average lands
                for i, (island, (optimizer, schedule), shard) in enumerate(zip(islands, optimizers, shards)):
                    if run.eager:  # from where the outer step would go with the island's own outer gradient as 1/n of
                        # the average and the last round's average (the first round: its own again) for the rest
                        others = raw[i] if last_average is None else last_average
                        estimate = [g / run.peers + o * (1 - 1 / run.peers) for g, o in zip(raw[i], others)]
                        snapshots[i] = preview(outer, estimate)
                        with torch.no_grad():
                            for param, value in zip(island.parameters(), snapshots[i]):
                                param.copy_(value)
                    for _ in range(min(run.overlap, ends[round_index + 1] - end)):
                        _step(island, optimizer, schedule, *shard.train.next_batch(), clip=run.clip)
                        trained[i] += 1
            last_average = average
            outer.step(average)
            for i, island in enumerate(islands):
                with torch.no_grad():
                    if run.overlap:  # as a peer: local <- global + (local - where the steps meanwhile started)
                        for param, value, start in zip(island.parameters(), global_params, snapshots[i]):
                            param.copy_(value + (param - start))
                    else:
                        for param, value in zip(island.parameters(), global_params):
                            param.copy_(value)
            if (round_index + 1) % _curve_every(run) == 0:
                curve.append((end * tokens_per_step, _evaluate(global_model, held_out[:4])))
    final = _evaluate(global_model, held_out)
    diagnostics = {}
    if run.method == "diloco" and cosines:
        quarter = max(1, len(cosines) // 4)
        diagnostics = dict(outer_grad_cosine_first_quarter=round(sum(cosines[:quarter]) / quarter, 4),
                           outer_grad_cosine_last_quarter=round(sum(cosines[-quarter:]) / quarter, 4))
        quarter = max(1, len(agreements) // 4)
        diagnostics.update(island_agreement_first_quarter=round(sum(agreements[:quarter]) / quarter, 4),
                           island_agreement_last_quarter=round(sum(agreements[-quarter:]) / quarter, 4))
    if probe is not None:
        diagnostics.update(shadow_lr=shadow_lr, floor_probe=probe.summary())
    return dict(
        asdict(run), **diagnostics, key=run.key, final_loss=round(final, 5), tokens=run.steps * tokens_per_step,
        outer_steps=run.steps // run.inner_steps if run.method == "diloco" else 0,
        wire_bytes_per_token=round(run.wire_bytes_per_token(params, config.seq_len), 3),
        fewer_bytes_than_syncdp=round(run.fewer_bytes_than_syncdp, 1),
        curve=[(t, round(loss, 4)) for t, loss in curve], seconds=round(time.monotonic() - started, 1),
        torch=torch.__version__,
    )


def load(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    results = _read_jsonl(path)
    for result in results:
        result.setdefault("schedule", "fixed")  # rows written before schedules existed
        result.setdefault("reducer_feedback", False)
        result.setdefault("data", "shards")
        result.setdefault("d_model", D_MODEL)
        result.setdefault("optimizer", "adamw")
        result.setdefault("outer_warmup", 0)
        result.setdefault("clip", CLIP)
        result.setdefault("overlap", 0)
        result.setdefault("eager", False)
    return results


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


def run_study(out: Path, phases: list[str], jobs: int) -> None:
    """Run the phases' runs not yet in results.jsonl, ``jobs`` at once, each appended as soon as it ends; after each
    one the plan is made again from the results, so that a phase starts as soon as what it builds on is done."""
    out.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        in_flight: dict = {}
        while True:
            for run in next_runs(phases, load(out), {r.key for r in in_flight.values()})[: jobs - len(in_flight)]:
                print(f"  start {run.key}", flush=True)
                in_flight[pool.submit(train, run)] = run
            if not in_flight:
                waiting = [p for p in phases if _remaining(p, load(out))]
                print("study: done" if not waiting else f"study: {', '.join(waiting)} wait for phases not asked for", flush=True)
                return
            finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in finished:
                del in_flight[future]
                result = future.result()
                _append_jsonl(out / "results.jsonl", result)
                print(f"  {result['key']}: loss {result['final_loss']:.4f} in {result['seconds']:.0f} s", flush=True)


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


def run_probes(out: Path, jobs: int) -> None:
    """The floor's probe (_FloorProbe) on probe_runs not yet in floor_probe.jsonl, ``jobs`` at once, each appended with
    the final loss results.jsonl holds for the same run (the probe leaves the run as it was: the two should agree)."""
    results, path = load(out), out / "floor_probe.jsonl"
    done = {r["key"] for r in _load_probes(out)}
    stored = {r["key"]: r["final_loss"] for r in results}
    todo = [(run, lr) for run, lr in probe_runs(results) if run.key not in done]
    if not todo:
        print("probe: done" if done else f"probe: no floor run's sync DP is tuned in {out / 'results.jsonl'} yet", flush=True)
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(train, run, lr): run for run, lr in todo}
        for run, lr in todo:
            print(f"  queued {run.key} (sync DP's lr {lr:g})", flush=True)
        for future in as_completed(futures):
            result = future.result()
            result["stored_final_loss"] = stored.get(result["key"])
            _append_jsonl(path, result)
            print(f"  {result['key']}: loss {result['final_loss']:.4f} (results.jsonl: {result['stored_final_loss']}) "
                  f"in {result['seconds']:.0f} s", flush=True)


def _load_probes(out: Path) -> list[dict]:
    return _read_jsonl(out / "floor_probe.jsonl")


def _read_jsonl(path: Path) -> list[dict]:
    """One dict per non-empty line; none when the file is not there yet."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _append_jsonl(path: Path, row: dict) -> None:
    """``row`` as one line at the end of ``path``, at once: a run that ends is kept even if the next one fails."""
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None, prog: str = "learning_study.py") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run the phases' runs not yet in results.jsonl, appending each")
    run_parser.add_argument("--out", default="docs/learning", help="folder of results.jsonl (default docs/learning)")
    run_parser.add_argument("--phase", nargs="+", choices=PHASES, default=list(PHASES), help="phases, in order (default: all)")
    run_parser.add_argument("--jobs", type=int, default=2, help="runs at once, one process and one thread each (default 2)")
    probe_parser = commands.add_parser("probe", help="the floor's probe: FLOOR_PROBES' runs with sync DP's step beside, "
                                       "into floor_probe.jsonl")
    probe_parser.add_argument("--out", default="docs/learning", help="folder of results.jsonl (default docs/learning)")
    probe_parser.add_argument("--jobs", type=int, default=2, help="runs at once, one process and one thread each (default 2)")
    report_parser = commands.add_parser("report", help="write study.md and study.png from results.jsonl")
    report_parser.add_argument("--out", default="docs/learning", help="folder of results.jsonl (default docs/learning)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        if args.command in ("run", "probe") and args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        if args.command == "run":
            run_study(out, args.phase, args.jobs)
        elif args.command == "probe":
            run_probes(out, args.jobs)
        else:
            from experiments.learning_report import report  # it imports this module

            print(report(out), end="")
    except (ValueError, OSError, json.JSONDecodeError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0

