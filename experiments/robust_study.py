"""The clipping radius against a sender just under the thresholds, and its cost on honest peers, without a network.

    python scripts/robust_study.py --out runs/robust-study [--seeds 0 1] [--outer-steps 20] [--clip-ratios 2 1]
        [--overlap 0.9] [--norm-clip 1]

The attack harness (attack.py) measures a scaled sender in a real swarm, where one run's loss moves several percent
with the timing of its rounds. This runs the synchronous form in one process, so that two settings can be compared
on the same seeds, shards and batches: every round, each island trains its inner steps from the global params on its
own shard; the outer gradients are split into one part per member, as the butterfly all-reduce splits them, and
each part is averaged by the reducers' rule (``robust.robust_average``, a group of all the islands, weights the
tokens each trained); the outer Nesterov step follows. Scenarios:

- ``calm``: three honest islands;
- ``scaled``: three honest islands and a fourth that sends its honest outer gradient times 90 (the attack
  harness's ``scaled_under``: just under the reducers' 100x norm per token, cut to the clipping radius);
- ``fast``: three honest islands, one of which trains 4x the inner steps of the others in each round (a fast
  machine), its weight its tokens: what a smaller radius costs an honest peer that trained more than the median.

Each runs with the plain token-weighted mean (no checks) and with centered clipping at each ``--clip-ratio``. The
model, batch and H are the attack harness's (2 layers, d 64, context 64, batch 8, H = 80). Held-out loss of the
global params after every outer step; the table gives the last step's and the mean of the last five, per seed, and
each against the calm, plain mean of its seed. Writes ``robust_study.json`` and ``robust_study.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from experiments.equal_tokens import train_island
from p2p_diloco.core.config import DataConfig, InnerConfig, ModelConfig, OuterConfig
from p2p_diloco.core.outer import OuterOptimizer
from p2p_diloco.core.robust import RobustPolicy, robust_average
from p2p_diloco.train.data import Dataset
from p2p_diloco.train.model import build_model

SCENARIOS = ("calm", "scaled", "scaled3", "fast")
SCALE = 90.0  # experiments/adversary.py UNDER_SCALE
FAST = 4  # the fast island's inner steps, in multiples of the others'
MODEL = ModelConfig(n_layers=2, d_model=64, n_heads=2, seq_len=64)  # attack.py's DEFAULT_FLAGS
BATCH, INNER_STEPS = 8, 80


def aggregate(outer_grads: list[torch.Tensor], weights: list[float], clip_ratio: float | None,
              norm_clip: float = RobustPolicy.norm_clip_ratio) -> torch.Tensor:
    """One group's average of flat outer gradients: the plain weighted mean (``clip_ratio`` None), or the reducers'
    rule on one contiguous part per member, member i reducing part i (``norm_clip``: RobustPolicy.norm_clip_ratio)."""
    if clip_ratio is None:
        total = sum(weights)
        return sum(g * (w / total) for g, w in zip(outer_grads, weights))
    policy = RobustPolicy(clip_ratio=clip_ratio, norm_clip_ratio=norm_clip)
    parts = [torch.tensor_split(g, len(outer_grads)) for g in outer_grads]
    averaged = []
    for index in range(len(outer_grads)):
        mine = [p[index] for p in parts]
        result, _, _ = robust_average(mine, weights, [None] * len(weights), mine[0].shape, policy, own=index)
        averaged.append(result)
    return torch.cat(averaged)


def run(scenario: str, clip_ratio: float | None, seed: int, outer_steps: int, overlap: float = 0.0,
        norm_clip: float = RobustPolicy.norm_clip_ratio) -> list[float]:
    """Held-out loss of the global params at the start and after each outer step. ``overlap``: the fraction of each
    island's inner steps taken while the round's average is in flight, as a peer does (docs/design.md §2): the outer
    gradient is measured at a snapshot taken that many steps before the round's end, the island trains on, and when
    the average is applied it keeps that work (local <- new global + (local - snapshot)). 0: the synchronous form."""
    torch.set_num_threads(1)
    islands = {"scaled": 4, "scaled3": 3}.get(scenario, 3)
    inner = InnerConfig(batch_size=BATCH, inner_steps=INNER_STEPS)
    shards = [Dataset(DataConfig(num_shards=islands, shard_index=i), MODEL.seq_len, BATCH, seed) for i in range(islands)]
    held_out = shards[0].eval_batches(4)
    global_model = build_model(MODEL, seed)
    models = [build_model(MODEL, seed) for _ in range(islands)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=inner.lr, weight_decay=inner.weight_decay) for m in models]
    global_params = [p.data for p in global_model.parameters()]
    outer = OuterOptimizer(global_params, OuterConfig())
    steps = [INNER_STEPS * (FAST if scenario == "fast" and i == 0 else 1) for i in range(islands)]

    def evaluate() -> float:
        global_model.eval()
        with torch.no_grad():
            return sum(global_model(x, y).item() for x, y in held_out) / len(held_out)

    for model in models:
        with torch.no_grad():
            for param, value in zip(model.parameters(), global_params):
                param.copy_(value)
    losses = [evaluate()]
    for _ in range(outer_steps):
        flat, snapshots = [], []
        for model, optimizer, shard, count in zip(models, optimizers, shards, steps):
            during = round(count * overlap)
            train_island(model, optimizer, shard, count - during, inner)
            snapshots.append([p.detach().clone() for p in model.parameters()])
            flat.append(torch.cat([(g - p).reshape(-1) for g, p in zip(global_params, snapshots[-1])]))
            train_island(model, optimizer, shard, during, inner)  # while the round's average is in flight
        if scenario.startswith("scaled"):
            flat[-1] = flat[-1] * SCALE
        weights = [float(count * BATCH * MODEL.seq_len) for count in steps]
        average = aggregate(flat, weights, clip_ratio, norm_clip)
        shapes, offset, tensors = [p.shape for p in global_params], 0, []
        for shape in shapes:
            size = torch.Size(shape).numel()
            tensors.append(average[offset:offset + size].view(shape))
            offset += size
        outer.step(tensors)
        for model, snapshot in zip(models, snapshots):
            with torch.no_grad():
                for param, value, before in zip(model.parameters(), global_params, snapshot):
                    param.copy_(value + (param - before))  # keep the work done while averaging
        losses.append(evaluate())
    return losses


def _job(job: tuple) -> tuple[tuple, list[float], float]:
    began = time.monotonic()
    return job, run(*job), time.monotonic() - began


def _label(clip_ratio: float | None) -> str:
    return "plain mean" if clip_ratio is None else f"clip {clip_ratio:g}"


def table(results: dict[tuple, list[float]], seeds: list[int], clips: list[float | None]) -> str:
    lines = ["| scenario | aggregation | " + " | ".join(f"seed {s}: last / last 5 (vs calm plain)" for s in seeds) + " |",
             "|---|---|" + "---|" * len(seeds)]
    for scenario in SCENARIOS:
        for clip in clips:
            cells = []
            for seed in seeds:
                losses = results.get((scenario, clip, seed))
                calm = results.get(("calm", None, seed))
                if losses is None or calm is None:
                    cells.append("-")
                    continue
                last, tail = losses[-1], sum(losses[-5:]) / 5
                calm_last, calm_tail = calm[-1], sum(calm[-5:]) / 5
                cells.append(f"{last:.4f} / {tail:.4f} ({(last / calm_last - 1) * 100:+.2f}% / {(tail / calm_tail - 1) * 100:+.2f}%)")
            lines.append(f"| {scenario} | {_label(clip)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, prog: str = "robust_study.py") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--outer-steps", type=int, default=20)
    parser.add_argument("--clip-ratios", type=float, nargs="+", default=[2.0, 1.0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--norm-clip", type=float, default=RobustPolicy().norm_clip_ratio,
                        help="RobustPolicy.norm_clip_ratio of every clipped aggregation (default: the peer's; inf: off)")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="fraction of each round's inner steps taken while its average is in flight (0: synchronous)")
    args = parser.parse_args(argv)
    if (args.outer_steps < 5 or any(c < 1 for c in args.clip_ratios) or args.workers < 1 or not 0 <= args.overlap < 1
            or not args.norm_clip >= 1):
        print(f"{prog}: --outer-steps must be >= 5, --clip-ratios and --norm-clip >= 1, --workers >= 1, --overlap in [0, 1)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clips: list[float | None] = [None, *args.clip_ratios]
    jobs = [(scenario, clip, seed, args.outer_steps, args.overlap, args.norm_clip) for seed in args.seeds for scenario in SCENARIOS for clip in clips
            if (scenario in args.scenarios or (scenario == "calm" and clip is None))  # the reference of every row
            and not (scenario.startswith("scaled") and clip is None)]  # the plain mean has no defence: the scaled sender wins
    results: dict[tuple, list[float]] = {}
    with ProcessPoolExecutor(args.workers) as pool:
        for (scenario, clip, seed, *_), losses, seconds in pool.map(_job, jobs):
            results[(scenario, clip, seed)] = losses
            print(f"{scenario:7s} {_label(clip):10s} seed {seed}: last {losses[-1]:.4f} ({seconds:.0f} s)", flush=True)
    text = f"every clipped aggregation with norm_clip_ratio {args.norm_clip:g}\n\n" + table(results, args.seeds, clips)
    print(text)
    (out / "robust_study.md").write_text(text)
    (out / "robust_study.json").write_text(json.dumps(
        [dict(scenario=s, clip_ratio=c, seed=seed, losses=losses) for (s, c, seed), losses in results.items()], indent=1))
    return 0
