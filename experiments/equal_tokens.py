"""Loss at equal tokens, without a network: DiLoCo at several H against synchronous data parallel, in one process each.

    python scripts/equal_tokens.py --out runs/equal-tokens [--tokens 1700000] [--inner-steps 10 25 100] [--peers 4]

The benchmark (bench.py) compares methods at equal tokens only as far as its slowest method got: sync DP at
20 Mbit/s reaches about 1.35M tokens in 10 minutes, where p2p-diloco at H = 100 has taken one or two outer steps.
Neither method's loss per token depends on the links (sync DP's all-reduce is exact; p2p-diloco's outer steps
are the same arithmetic whatever the network), so this computes both in one process, far faster than a swarm:

- ``syncdp``: every step, each of ``peers`` shards gives a batch, their gradients are averaged (equal tokens,
  so the token-weighted mean is the plain one), clipped, and AdamW steps: ``SyncDataParallel``'s arithmetic;
- ``diloco-H``: ``peers`` islands, each with its own model and AdamW, train H steps on their shards; their outer
  gradients (global - local, through the codec) are averaged and the outer Nesterov step is applied; the islands
  restart from the new global params (the synchronous form: no overlap, no failure).

Same model, shards, batches, seeds and held-out batches as a bench peer. Held-out loss: sync DP's every
``--eval-every`` steps, p2p-diloco's global params at each outer step. Each DiLoCo point is compared with sync
DP's loss at the same tokens, interpolated linearly between its two nearest evaluations. Writes
``equal_tokens.json`` and ``equal_tokens.md``.

``--warm-start-tokens W`` starts both methods from one model that sync DP trained for W swarm tokens from the
seeded init (its params and AdamW state; every island gets a copy of both, the outer momentum starts at zero,
every shard reads on from where the warm start left it). That is the original DiLoCo's setting (its workers
start from a model pretrained for 24k steps); tokens in the table count the warm start's too.

It does not model the swarm's overlap (averaging in the background), failures, or unequal speeds.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from p2p_diloco.core.compression import make_codec
from p2p_diloco.core.config import COMPRESSIONS, DataConfig, InnerConfig, ModelConfig, OuterConfig
from p2p_diloco.core.link import codec_round_trip
from p2p_diloco.core.outer import OuterOptimizer
from p2p_diloco.train.data import Dataset
from p2p_diloco.train.model import build_model

Curve = list[tuple[int, float]]  # (swarm tokens, held-out loss)


def _setup(peers: int, batch_size: int, seed: int) -> tuple[ModelConfig, list[Dataset], list]:
    torch.set_num_threads(1)
    model = ModelConfig()
    shards = [Dataset(DataConfig(num_shards=peers, shard_index=i), model.seq_len, batch_size, seed) for i in range(peers)]
    return model, shards, shards[0].eval_batches(4)  # a bench peer evaluates on 4 held-out batches


def _evaluate(model: torch.nn.Module, batches: list) -> float:
    model.eval()
    with torch.no_grad():
        return sum(model(x, y).item() for x, y in batches) / len(batches)


def _adamw(model: torch.nn.Module, inner: InnerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=inner.lr, weight_decay=inner.weight_decay)


@dataclass(frozen=True)
class WarmStart:
    """Where both methods begin: the model and AdamW state after sync DP trained ``tokens`` swarm tokens."""

    tokens: int  # swarm tokens already trained (steps x peers x batch tokens)
    steps: int  # sync DP steps taken: every shard gave this many batches
    model_state: dict
    optimizer_state: dict


def _sync_dp_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, shards: list, inner: InnerConfig) -> None:
    """One step of synchronous data parallel: every shard's gradient, averaged (equal tokens), clipped, AdamW."""
    model.train()
    params = list(model.parameters())
    grads = [torch.zeros_like(p) for p in params]
    for shard in shards:
        inputs, targets = shard.train.next_batch()
        for total, grad in zip(grads, torch.autograd.grad(model(inputs, targets), params)):
            total.add_(grad, alpha=1.0 / len(shards))
    for param, grad in zip(params, grads):
        param.grad = grad
    if inner.grad_clip_norm:
        torch.nn.utils.clip_grad_norm_(params, inner.grad_clip_norm)
    optimizer.step()


def train_island(island: torch.nn.Module, optimizer: torch.optim.Optimizer, shard: Dataset, steps: int,
                 inner: InnerConfig) -> None:
    """``steps`` inner AdamW steps of one island on its shard (gradients clipped as a peer clips them)."""
    island.train()
    for _ in range(steps):
        inputs, targets = shard.train.next_batch()
        loss = island(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if inner.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(list(island.parameters()), inner.grad_clip_norm)
        optimizer.step()


def _begin(start: WarmStart | None, shards: list, models: list, optimizers: list) -> int:
    """Put the warm start into the shards (read on from it), models and optimizers (private copies); its tokens."""
    if start is None:
        return 0
    for shard in shards:
        shard.train.position = start.steps
    for model in models:
        model.load_state_dict(start.model_state)
    for optimizer in optimizers:
        optimizer.load_state_dict(copy.deepcopy(start.optimizer_state))  # load_state_dict may keep the given tensors
    return start.tokens


def warm_start(peers: int, tokens: int, inner: InnerConfig, seed: int = 0) -> WarmStart:
    """Sync DP from the seeded init until ``tokens`` swarm tokens (rounded up to whole steps)."""
    config, shards, _ = _setup(peers, inner.batch_size, seed)
    model = build_model(config, seed)
    optimizer = _adamw(model, inner)
    step_tokens = peers * shards[0].train.tokens_per_batch
    steps = -(-tokens // step_tokens)
    for _ in range(steps):
        _sync_dp_step(model, optimizer, shards, inner)
    return WarmStart(steps * step_tokens, steps, copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))


def sync_dp_curve(peers: int, tokens: int, eval_every: int, inner: InnerConfig, seed: int = 0,
                  start: WarmStart | None = None) -> Curve:
    """Sync DP's held-out loss every ``eval_every`` steps (and at the start) until ``tokens`` swarm tokens more."""
    config, shards, held_out = _setup(peers, inner.batch_size, seed)
    model = build_model(config, seed)
    optimizer = _adamw(model, inner)
    first = _begin(start, shards, [model], [optimizer])
    step_tokens = peers * shards[0].train.tokens_per_batch
    curve, step = [(first, _evaluate(model, held_out))], 0
    while step * step_tokens < tokens:
        _sync_dp_step(model, optimizer, shards, inner)
        step += 1
        if step % eval_every == 0 or step * step_tokens >= tokens:
            curve.append((first + step * step_tokens, _evaluate(model, held_out)))
    return curve


def diloco_curve(
    peers: int, tokens: int, inner_steps: int, inner: InnerConfig, outer: OuterConfig, compression: str, seed: int = 0,
    start: WarmStart | None = None,
) -> Curve:
    """The global params' held-out loss at each outer step (and at the start) until ``tokens`` swarm tokens more."""
    config, shards, held_out = _setup(peers, inner.batch_size, seed)
    global_model = build_model(config, seed)
    islands = [build_model(config, seed) for _ in range(peers)]
    optimizers = [_adamw(island, inner) for island in islands]
    first = _begin(start, shards, [global_model, *islands], optimizers)  # the outer momentum starts at zero
    global_params = [p.data for p in global_model.parameters()]
    outer_optimizer, codec = OuterOptimizer(global_params, outer), make_codec(compression)
    round_tokens = inner_steps * peers * shards[0].train.tokens_per_batch
    curve, done = [(first, _evaluate(global_model, held_out))], 0
    while done < tokens:
        outer_grads = []
        for island, optimizer, shard in zip(islands, optimizers, shards):
            train_island(island, optimizer, shard, inner_steps, inner)
            local = [p.detach() for p in island.parameters()]
            outer_grads.append(codec_round_trip(codec, [g - p for g, p in zip(global_params, local)]))
        outer_optimizer.step([torch.stack(parts).mean(0) for parts in zip(*outer_grads)])
        for island in islands:
            with torch.no_grad():
                for param, value in zip(island.parameters(), global_params):
                    param.copy_(value)
        done += round_tokens
        curve.append((first + done, _evaluate(global_model, held_out)))
    return curve


def loss_at(curve: Curve, tokens: int) -> float | None:
    """The loss at ``tokens``, linear between the two nearest points; None outside the curve."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return None


def compare(dp: Curve, diloco: Curve) -> list[dict]:
    """Each outer step's loss beside sync DP's at the same tokens (the start left out: both are the same model)."""
    rows = []
    for tokens, loss in diloco[1:]:
        reference = loss_at(dp, tokens)
        if reference is not None:
            rows.append(dict(tokens=tokens, diloco=round(loss, 4), syncdp=round(reference, 4), gap=round(loss / reference - 1, 4)))
    return rows


def _run(job: tuple) -> tuple[str, Curve, float]:
    name, kind, kwargs = job
    started = time.monotonic()
    curve = sync_dp_curve(**kwargs) if kind == "syncdp" else diloco_curve(**kwargs)
    return name, curve, time.monotonic() - started


def _table(results: dict) -> str:
    warm = results["warm_start_tokens"]
    lines = [f"From a warm start: sync DP's model after {warm:,} swarm tokens (counted below).", ""] if warm else []
    lines += [
        "| method | outer steps | swarm tokens | loss | sync DP at those tokens | gap |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results["diloco"].items():
        for index, row in enumerate(result["vs_syncdp"], start=1):
            lines.append(
                f"| {name} | {index} | {row['tokens']:,} | {row['diloco']:.3f} | {row['syncdp']:.3f} | {100 * row['gap']:+.1f}% |"
            )
    return "\n".join(lines) + "\n"


def _positive(kind: type, name: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value

    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--warm-start-tokens must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"--warm-start-tokens must be >= 0, got {text}")
    return value


def main(argv: list[str] | None = None, prog: str = "equal_tokens.py") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/equal-tokens", help="folder for equal_tokens.json and equal_tokens.md")
    parser.add_argument("--tokens", type=_positive(int, "--tokens"), default=1_700_000, help="swarm tokens per method (default 1,700,000)")
    parser.add_argument("--inner-steps", type=_positive(int, "--inner-steps"), nargs="+", default=[10, 25, 100], metavar="H", help="DiLoCo's H, one run each (default 10 25 100)")
    parser.add_argument("--peers", type=_positive(int, "--peers"), default=4, help="islands / data-parallel workers (default 4)")
    parser.add_argument("--batch-size", type=_positive(int, "--batch-size"), default=16, help="sequences per step per peer (default 16)")
    parser.add_argument("--outer-lr", type=_positive(float, "--outer-lr"), default=OuterConfig().lr, help=f"outer learning rate (default {OuterConfig().lr})")
    parser.add_argument("--outer-momentum", type=float, default=OuterConfig().momentum, help=f"outer Nesterov momentum (default {OuterConfig().momentum})")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="int8", help="outer-gradient codec (default int8; int4 here without error feedback)")
    parser.add_argument("--eval-every", type=_positive(int, "--eval-every"), default=25, help="sync DP steps between evaluations (default 25)")
    parser.add_argument("--warm-start-tokens", type=_non_negative_int, default=0, metavar="TOKENS",
                        help="start both methods from sync DP's model after this many swarm tokens (default 0: from the init)")
    parser.add_argument("--jobs", type=_positive(int, "--jobs"), default=2, help="methods computed at once, one process and one thread each (default 2)")
    args = parser.parse_args(argv)
    try:
        inner, outer = InnerConfig(batch_size=args.batch_size), OuterConfig(lr=args.outer_lr, momentum=args.outer_momentum)
    except ValueError as e:
        parser.error(str(e))
    # DiLoCo stops at its last outer step within --tokens (one at least); sync DP runs as far as the furthest
    round_tokens = {h: h * args.peers * args.batch_size * ModelConfig().seq_len for h in dict.fromkeys(args.inner_steps)}
    diloco_tokens = {h: max(1, args.tokens // tokens) * tokens for h, tokens in round_tokens.items()}
    start = None
    if args.warm_start_tokens:
        started = time.monotonic()
        start = warm_start(args.peers, args.warm_start_tokens, inner)
        print(f"warm start: sync DP to {start.tokens:,} tokens in {time.monotonic() - started:.0f} s", flush=True)
    common = dict(peers=args.peers, inner=inner, start=start)
    jobs = [("syncdp", "syncdp", dict(common, tokens=max(args.tokens, *diloco_tokens.values()), eval_every=args.eval_every))]
    jobs += [
        (f"diloco-H{h}", "diloco", dict(common, tokens=diloco_tokens[h], inner_steps=h, outer=outer, compression=args.compression))
        for h in round_tokens
    ]
    curves, seconds = {}, {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for name, curve, elapsed in pool.map(_run, jobs):
            curves[name], seconds[name] = curve, round(elapsed, 1)
            print(f"{name}: {len(curve) - 1} evaluations in {elapsed:.0f} s, last loss {curve[-1][1]:.3f} at {curve[-1][0]:,} tokens", flush=True)
    results = dict(
        command=" ".join([prog, *(argv if argv is not None else sys.argv[1:])]),
        peers=args.peers, batch_size=args.batch_size, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        compression=args.compression, warm_start_tokens=start.tokens if start else 0, seconds=seconds,
        syncdp=curves["syncdp"],
        diloco={
            name: dict(curve=curve, vs_syncdp=compare(curves["syncdp"], curve))
            for name, curve in curves.items() if name != "syncdp"
        },
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "equal_tokens.json").write_text(json.dumps(results, indent=1))
    table = _table(results)
    (out / "equal_tokens.md").write_text(table)
    print(table, end="")
    return 0
