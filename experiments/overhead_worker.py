"""One process of the overhead benchmark's bare phase (experiments/overhead.py): a peer's inner steps with no
swarm, timed step by step. Run as ``python -m experiments.overhead_worker`` by the benchmark."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def worker_main(argv: list[str] | None = None, prog: str = "python -m experiments.overhead_worker") -> int:
    """One process of the bare phase: build the model, data shard and AdamW exactly as a peer's learner does
    (``Learner.__init__``; threads and data through ``open_process_inputs``), write the ready file, wait for the go
    file, run ``--warmup-steps`` then ``--steps`` inner steps as ``Learner.inner_step`` computes them, and write one
    record to ``--metrics-file``. Takes every peer flag; those of the swarm are accepted and ignored."""
    from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, overrides_from
    from p2p_diloco.cli.peer import fail, open_process_inputs
    from p2p_diloco.cli.ready import write_ready_file
    from p2p_diloco.core.config_load import build_config

    parser = OneLineParser(prog=prog, description="One bare training process of scripts/bench_overhead.py.")
    parser.add_argument("--steps", type=int, required=True, help="inner steps timed")
    parser.add_argument("--warmup-steps", type=int, default=2, help="inner steps before the timed ones (default 2)")
    parser.add_argument("--go-file", required=True, help="begin training once this file exists")
    parser.add_argument("--go-timeout-s", type=float, default=600.0, help="give up if no go by then (default 600)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with the peer's config sections; flags override it")
    add_peer_flags(parser)
    args = parser.parse_args(argv)
    try:
        config = build_config(overrides_from(args))
        if args.steps < 1 or args.warmup_steps < 0:
            raise ValueError("--steps must be >= 1 and --warmup-steps >= 0")
        dataset, sink = open_process_inputs(config)  # torch's threads, this shard, the metrics file: as a peer
    except (ValueError, OSError) as e:
        return fail(prog, str(e))
    import torch

    from p2p_diloco.train.island import Island
    from p2p_diloco.train.model import build_model

    island = Island.from_environment({}, 0.0, device=config.run.device, precision=config.inner.precision)
    model = build_model(config.model, config.run.seed)
    train_model = island.wrap(model)
    params = list(model.parameters())
    inner = torch.optim.AdamW(params, lr=config.inner.lr, weight_decay=config.inner.weight_decay)
    clip, throttle = config.inner.grad_clip_norm, config.inner.throttle

    def inner_step() -> tuple[int, float, float]:
        """``Learner.inner_step`` without the swarm: (tokens, loss, seconds)."""
        started = time.monotonic()
        model.train()
        inputs, targets = dataset.train.next_batch()
        with island.autocast():
            loss = train_model(inputs.to(island.device), targets.to(island.device))
        inner.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        inner.step()
        if throttle > 1:
            time.sleep((throttle - 1) * (time.monotonic() - started))
        value = loss.item()
        return inputs.numel(), value, time.monotonic() - started

    if config.run.ready_file:  # the launcher says go once every worker has written its ready file
        write_ready_file(config.run.ready_file, f"bare-{config.data.shard_index}", None, [])
    deadline = time.monotonic() + args.go_timeout_s
    go = Path(args.go_file)
    while not go.exists():
        if time.monotonic() >= deadline:
            sink.close()
            return fail(prog, f"no go file {go} within {args.go_timeout_s:.0f} s", code=1)
        time.sleep(0.005)
    warmup_started = time.monotonic()
    for _ in range(args.warmup_steps):
        inner_step()
    warmup_s = time.monotonic() - warmup_started
    tokens, losses, compute_s = 0, [], 0.0
    step_end_s, step_cpu_s = [], []  # when each step ended and the CPU spent by then: rates in any window
    unix_start, started, cpu_started = time.time(), time.monotonic(), time.process_time()
    for _ in range(args.steps):
        step_tokens, loss, seconds = inner_step()
        tokens += step_tokens
        losses.append(loss)
        compute_s += seconds
        step_end_s.append(round(time.monotonic() - started, 4))
        step_cpu_s.append(round(time.process_time() - cpu_started, 4))
    wall_s, cpu_s = time.monotonic() - started, time.process_time() - cpu_started
    record = dict(
        status="bare", shard_index=config.data.shard_index, steps=args.steps, warmup_steps=args.warmup_steps,
        tokens_per_step=dataset.train.tokens_per_batch, tokens=tokens, wall_s=round(wall_s, 4),
        compute_s=round(compute_s, 4), cpu_s=round(cpu_s, 4), warmup_s=round(warmup_s, 4), unix_start=round(unix_start, 3),
        unix_end=round(unix_start + wall_s, 3), loss=sum(losses) / len(losses), threads=torch.get_num_threads(),
        device=str(island.device), tokens_per_s=round(tokens / wall_s, 1), step_end_s=step_end_s, step_cpu_s=step_cpu_s,
    )
    sink.write(record)
    sink.close()
    print(f"bare shard {config.data.shard_index}: {args.steps} steps, {tokens:,} tokens in {wall_s:.2f} s "
          f"({tokens / wall_s:,.0f} tokens/s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
