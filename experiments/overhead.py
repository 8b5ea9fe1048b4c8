"""What the swarm costs in throughput: N peers' tokens/s against the same N processes trained bare, in one run.

    python scripts/bench_overhead.py --out runs/overhead [--peers 3] [--inner-steps 50] [--outer-steps 6]
        [--threads 1] [--batch-size 16] [--seq-len 128] [--repeats 1] [-- extra peer flags]

Phases one after the other, on the same machine, model, data shards, batch and threads: bare, swarm, bare (and with
``--repeats R``, R swarm phases, each between two bare phases). Each swarm phase is compared with the mean of the
bare phases around it, so that a machine whose speed drifts over the run (a shared one does, by several percent in
minutes) moves both sides alike; the headline is the median of the swarm phases' ratios.

1. **bare**: N worker processes (``python -m experiments.overhead``, below), each the plain PyTorch loop of a peer's
   inner step (forward, backward, clip, AdamW, ``loss.item()``: ``Learner.inner_step`` without the swarm) on shard i
   of N, with no communication at all. Each builds its model, data and AdamW as a peer does, says it is ready, and
   waits for the launcher's go (a file), so that all N train concurrently from the same moment. Each runs
   ``--warmup-steps`` untimed steps, then times H x S steps, noting when each ended and the CPU spent by then.
   **Bare tokens/s = tokens of the timed steps in the window in which all N workers were in their timed steps /
   that window** (data loading included, as the learner counts it in ``compute_s``). The workers do not end
   together (their core shares differ by 5-10%), and one that ends first leaves its core to the others: over each
   worker's own window the rates count that core twice (their core shares once summed to 2.05 on 2 cores), while
   the swarm's peers all run until their last round ends. The own-window rates are reported beside
   (``ratio_own_windows``).
2. **swarm**: the same N processes as a local swarm of p2p-diloco peers (``LocalSwarm``, ``--wait-for-peers N``,
   ``--inner-steps H``, ``--max-outer-steps S``). **Swarm tokens/s = the last metrics record's ``tokens`` / its
   ``time_s``**: every token the peer trained, over the wall time from the moment it began training (after
   ``--wait-for-peers``: the learner restarts the clock there) to its last record (written when its last
   averaging landed; a peer trains on while that averaging is in flight, so it trains a little more than H x S
   steps). That is the record's own ``tokens_per_s`` field, unrounded. It includes everything a peer does around
   its inner steps: waits for the network (``blocked_s``), the held-out evaluation after each outer step
   (``eval_s``), the outer step, progress records, and the CPU its DHT, averager and ``p2pd`` processes take from
   the training. Its warm-up steps are in it too (a peer cannot leave them out); the bare phase reports its rate
   with the warm-up as well (``tokens_per_s_with_warmup``).

The ratio is sum of swarm tokens/s over sum of bare tokens/s. Beside it: per peer, the fractions of its wall time
that went to inner steps, waiting and evaluation (the init evaluation, before the clock starts, left out), and its
tokens per second of inner-step compute alone (how much the background processes slowed the steps themselves).
Each process's ratio is also factored exactly, from the CPU seconds its process spent during the steps (``cpu_s``
of a bare worker, ``compute_cpu_s`` of a peer's records): tokens/wall = tokens per CPU second (what a token costs:
the peer's own threads, its cache disturbed) x CPU/compute (the share of a core its steps got: what the other
processes on the machine took) x compute/wall (the steps' share of the wall time: evaluation, outer steps, waits).
The tokens per CPU second moved by +-4% between phases of one run, with nothing changed in a peer (the machine is
shared), and with them the ratio; so the ratio is also printed at the bare loops' CPU per token
(``ratio_at_equal_cpu_cost``: the swarm's tokens/s over the sum of each bare rate times its process's tokens-per-CPU
factor), the core share and the steps' share alone, a steadier figure for comparing two versions of a peer. It
counts a peer's own threads' CPU per token (its beacon's and averaging thread's, in the trainer's process) as the
machine's: the headline ratio does not.
Writes ``overhead.json`` and ``overhead.md`` under ``--out``, each phase's logs and metrics in ``bare-i/`` and
``swarm-i/``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from p2p_diloco.cli.peer_processes import LocalSwarm, PeerProcess, last_log_line, start_peer, wait_for_ready
from p2p_diloco.observe.report import read_metrics

WORKER_ENTRY = ["-m", "experiments.overhead"]  # the bare worker: this module run as a program
GO_FILE = "go"  # in the bare phase's folder: written once every worker is ready; its content is the start time
# flags this benchmark sets on every process itself: taking them after `--` too would break the pairing
RESERVED_FLAGS = ("--inner-steps", "--max-outer-steps", "--threads", "--batch-size", "--seq-len", "--wait-for-peers",
                  "--shard-index", "--num-shards", "--metrics-file", "--ready-file", "--host-maddrs", "--initial-peers",
                  "--max-time-s")


# the two phases' flags ---------------------------------------------------------------------------------------


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this benchmark's own flags, the peer flags after ``--``). Raises ValueError for a reserved peer flag."""
    if "--" in argv:
        at = argv.index("--")
        own, extra = argv[:at], argv[at + 1:]
    else:
        own, extra = list(argv), []
    for token in extra:
        name = token.split("=", 1)[0]
        if name in RESERVED_FLAGS:
            raise ValueError(f"{name} is set by this benchmark (use its own flag, if it has one), not after --")
    return own, extra


def common_flags(args: argparse.Namespace) -> list[str]:
    return ["--threads", str(args.threads), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--inner-steps", str(args.inner_steps)]


def bare_flags(args: argparse.Namespace, extra: list[str], go_file: Path) -> list[str]:
    """What each bare worker gets: the peers' flags, H x S timed steps, and the file that says go."""
    steps = args.inner_steps * args.outer_steps
    return [*common_flags(args), *extra, "--steps", str(steps), "--warmup-steps", str(args.warmup_steps),
            "--go-file", str(go_file)]


def swarm_flags(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """What each peer gets (``--run-id`` first, so that one after ``--`` replaces it)."""
    return ["--run-id", "overhead", *common_flags(args), "--wait-for-peers", str(args.peers),
            "--max-outer-steps", str(args.outer_steps), *extra]


# figures from what the processes wrote (pure) ------------------------------------------------------------------


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _at(ends: list[float], values: list[float], moment: float) -> float:
    """A cumulative count at ``moment`` (seconds since the timed steps began), ``values[k]`` reached at ``ends[k]``,
    0 at 0, linear in between (steps are back to back: a step's tokens and CPU accrue over its own time)."""
    if moment <= 0 or not ends:
        return 0.0
    index = bisect.bisect_left(ends, moment)
    if index >= len(ends):
        return values[-1]
    start, before = (ends[index - 1], values[index - 1]) if index else (0.0, 0.0)
    span = ends[index] - start
    return before + (values[index] - before) * (moment - start) / span if span > 0 else values[index]


def bare_figures(record: dict, together: tuple[float, float] | None = None) -> dict[str, Any]:
    """One bare worker's figures from its result record (``worker_main`` writes it).

    ``together``: the wall-clock window in which every worker of the phase was in its timed steps. The rates are
    taken in it (from the record's per-step trace) when given: a worker that finishes first leaves its CPU to the
    others, and a rate over each one's own window counts that CPU twice (the three rates' core shares once summed
    to 2.05 of the 2 cores). The rates over the worker's own window stay beside them (``own_window_*``)."""
    tokens, wall = record["tokens"], record["wall_s"]
    warmup_tokens = record["warmup_steps"] * record["tokens_per_step"]
    compute_fraction = record["compute_s"] / wall if wall > 0 else 1.0  # the loop's own overhead: ~0.1%
    figures = dict(
        steps=record["steps"],
        tokens=tokens,
        wall_s=wall,
        tokens_per_s=_rate(tokens, wall),
        compute_tokens_per_s=_rate(tokens, record["compute_s"]),
        cpu_tokens_per_s=_rate(tokens, record.get("cpu_s", 0.0)),
        cpu_share=_rate(record["cpu_s"], record["compute_s"]) if record.get("cpu_s") else None,
        tokens_per_s_with_warmup=_rate(tokens + warmup_tokens, wall + record["warmup_s"]),
        warmup_s=record["warmup_s"],
        unix_start=record["unix_start"],
        unix_end=record["unix_end"],
        window="own",
        window_s=wall,
    )
    figures["own_window_tokens_per_s"] = figures["tokens_per_s"]
    ends, cpu = record.get("step_end_s"), record.get("step_cpu_s")
    if together is None or not ends or not cpu or together[1] <= together[0]:
        return figures
    first, last = (moment - record["unix_start"] for moment in together)
    done = [record["tokens_per_step"] * (k + 1) for k in range(len(ends))]  # tokens by the end of each step
    counted = _at(ends, done, last) - _at(ends, done, first)
    spent = _at(ends, cpu, last) - _at(ends, cpu, first)
    seconds = last - first
    figures.update(
        window="together",
        window_s=seconds,
        tokens_in_window=counted,
        tokens_per_s=_rate(counted, seconds),
        compute_tokens_per_s=_rate(counted, seconds * compute_fraction),
        cpu_tokens_per_s=_rate(counted, spent),
        cpu_share=_rate(spent, seconds * compute_fraction),
    )
    return figures


def together_window(records: list[dict]) -> tuple[float, float] | None:
    """The wall-clock window in which every record's worker was in its timed steps, or None if there is none."""
    if not records:
        return None
    window = (max(r["unix_start"] for r in records), min(r["unix_end"] for r in records))
    return window if window[1] > window[0] else None


def swarm_figures(records: list[dict]) -> dict[str, Any]:
    """One peer's figures from its metrics records: tokens over the wall time from the start of its training to its
    last record, and where that time went. Cumulative counters are taken net of the ``init`` record's (its
    evaluation ran before the clock of ``time_s`` started). Raises ValueError if it recorded no training."""
    init = next((r for r in records if r.get("status") == "init"), None)
    trained = [r for r in records if r.get("status") != "init"]
    if not trained or trained[-1]["time_s"] <= 0:
        raise ValueError("no record after the init record: the peer trained nothing it recorded")
    last = trained[-1]
    base = {key: (init or {}).get(key) or 0.0 for key in ("compute_s", "compute_cpu_s", "blocked_s", "eval_s")}
    wall = last["time_s"]
    compute, blocked, evaluating = (last[key] - base[key] for key in ("compute_s", "blocked_s", "eval_s"))
    cpu = last.get("compute_cpu_s", 0.0) - base["compute_cpu_s"]  # 0 from a peer that predates the field
    # the peer's DHT, averager and p2pd processes: their CPU over the same window, per minute
    # (from the init record's moment to the last one's: the init record's wait for peers is in the window too)
    background = [None if r is None else r.get("background_cpu_s") for r in (init, last)]
    window = last["unix_time"] - init["unix_time"] if init is not None else 0.0
    return dict(
        outer_steps=last["outer_step"],
        rounds_ok=sum(r.get("status") == "ok" for r in trained),
        steps=sum(r.get("inner_steps", 0) for r in trained),
        tokens=last["tokens"],
        wall_s=wall,
        tokens_per_s=_rate(last["tokens"], wall),
        compute_tokens_per_s=_rate(last["tokens"], compute),
        cpu_tokens_per_s=_rate(last["tokens"], cpu),
        cpu_share=_rate(cpu, compute) if cpu > 0 else None,
        background_cpu_s_per_min=(60 * (background[1] - background[0]) / window
                                  if None not in background and window > 0 else None),
        compute_fraction=compute / wall,
        blocked_fraction=blocked / wall,
        eval_fraction=evaluating / wall,
        other_fraction=1.0 - (compute + blocked + evaluating) / wall,
        blocked_s=blocked,
        eval_s=evaluating,
        unix_start=last["unix_time"] - wall,
        unix_end=last["unix_time"],
    )


def concurrency(windows: list[tuple[float, float]]) -> float | None:
    """The time all processes ran at once, as a fraction of the mean window: 1.0 = all began and ended together."""
    if not windows:
        return None
    together = min(end for _, end in windows) - max(start for start, _ in windows)
    mean = sum(end - start for start, end in windows) / len(windows)
    return max(together, 0.0) / mean if mean > 0 else None


RATES = ("tokens_per_s", "compute_tokens_per_s", "cpu_tokens_per_s", "cpu_share", "own_window_tokens_per_s")


def bracket(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Each bare process's rates as the mean of the bare phases before and after a swarm phase (figures by name), so
    that a machine that drifts in speed over the run (a shared machine does) moves both sides alike. A process that
    one side lacks takes the other's; a rate that either side lacks is left out (None)."""
    merged = {}
    for name in sorted({*before, *after}):
        sides = [f for f in (before.get(name), after.get(name)) if f is not None]
        figures = dict(sides[0])
        for key in RATES:
            values = [f.get(key) for f in sides]
            figures[key] = sum(values) / len(values) if all(v is not None for v in values) else None
        merged[name] = figures
    return merged


def bare_sum(figures: dict[str, dict], key: str = "tokens_per_s") -> float | None:
    """The bare processes' tokens/s in all (None if one has none); ``key``: which of their rates."""
    values = [f.get(key) for f in figures.values()]
    return sum(values) if values and all(v is not None for v in values) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarise(bare: dict[str, dict], swarm: dict[str, dict], peers: int) -> dict[str, Any]:
    """Process i of each phase side by side (both on shard i of N), the sums and the ratio swarm / bare, from the
    figures of ``bare_figures`` and ``swarm_figures`` (by name: ``bare{i}`` and ``peer{i}``)."""
    rows = []
    for index in range(peers):
        b, s = bare.get(f"bare{index}"), swarm.get(f"peer{index}")
        rows.append(dict(
            process=index,
            bare_tokens_per_s=b and b["tokens_per_s"],
            swarm_tokens_per_s=s and s["tokens_per_s"],
            ratio=_ratio(s and s["tokens_per_s"], b and b["tokens_per_s"]),
            bare_compute_tokens_per_s=b and b["compute_tokens_per_s"],
            swarm_compute_tokens_per_s=s and s["compute_tokens_per_s"],
            compute_ratio=_ratio(s and s["compute_tokens_per_s"], b and b["compute_tokens_per_s"]),
            # the ratio, factored exactly (tokens/wall = tokens/CPU x CPU/compute x compute/wall): what a token
            # costs in CPU, the share of a core the steps got, the steps' share of the wall time (bare: ~1)
            cpu_cost_factor=_ratio(s and s["cpu_tokens_per_s"], b and b["cpu_tokens_per_s"]),
            cpu_share_factor=_ratio(s and s["cpu_share"], b and b["cpu_share"]),
            steps_share_factor=_ratio(s and _ratio(s["tokens_per_s"], s["compute_tokens_per_s"]),
                                      b and _ratio(b["tokens_per_s"], b["compute_tokens_per_s"])),
            swarm_background_cpu_s_per_min=s and s["background_cpu_s_per_min"],
            bare_cpu_share=b and b["cpu_share"],
            swarm_cpu_share=s and s["cpu_share"],
            swarm_blocked_fraction=s and s["blocked_fraction"],
            swarm_eval_fraction=s and s["eval_fraction"],
            swarm_other_fraction=s and s["other_fraction"],
        ))
    complete = all(r["bare_tokens_per_s"] and r["swarm_tokens_per_s"] for r in rows)

    def total(key: str) -> float | None:
        values = [r[key] for r in rows]
        return sum(values) if all(v is not None for v in values) else None

    bare_total, swarm_total = total("bare_tokens_per_s"), total("swarm_tokens_per_s")
    # each bare process's rate had its tokens cost its CPU what the swarm's did: what is left of the ratio is the
    # core share and the steps' share, what a peer takes from its trainer (tokens per CPU s move with the machine)
    at_cost = [r["bare_tokens_per_s"] * r["cpu_cost_factor"] if r["bare_tokens_per_s"] and r["cpu_cost_factor"]
               else None for r in rows]
    bare_at_cost = sum(at_cost) if at_cost and None not in at_cost else None
    own_total = bare_sum(bare, "own_window_tokens_per_s") if len(bare) == peers else None
    return dict(
        complete=complete,
        per_process=rows,
        bare_tokens_per_s_sum=bare_total,
        swarm_tokens_per_s_sum=swarm_total,
        ratio=_ratio(swarm_total, bare_total),
        # each bare worker over its own window instead (how this benchmark counted before the common window)
        bare_own_windows_tokens_per_s_sum=own_total,
        ratio_own_windows=_ratio(swarm_total, own_total),
        ratio_at_equal_cpu_cost=_ratio(swarm_total, bare_at_cost),
        compute_ratio=_ratio(total("swarm_compute_tokens_per_s"), total("bare_compute_tokens_per_s")),
        bare_concurrency=concurrency([(f["unix_start"], f["unix_end"]) for f in bare.values()]),
        swarm_concurrency=concurrency([(f["unix_start"], f["unix_end"]) for f in swarm.values()]),
    )


def _cell(value: float | None, form: str) -> str:
    return "—" if value is None else format(value, form)


def markdown_table(summary: dict[str, Any]) -> str:
    lines = [
        "| process | bare tok/s | swarm tok/s | swarm / bare | compute tok/s bare | compute tok/s swarm | "
        "swarm blocked | swarm eval | swarm other | = tokens per CPU s | x core share (bare -> swarm) | x steps' share of wall "
        "| background CPU s/min |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary["per_process"]:
        lines.append(
            f"| {r['process']} | {_cell(r['bare_tokens_per_s'], ',.0f')} | {_cell(r['swarm_tokens_per_s'], ',.0f')} | "
            f"{_cell(r['ratio'], '.3f')} | {_cell(r['bare_compute_tokens_per_s'], ',.0f')} | "
            f"{_cell(r['swarm_compute_tokens_per_s'], ',.0f')} | {_cell(r['swarm_blocked_fraction'], '.1%')} | "
            f"{_cell(r['swarm_eval_fraction'], '.1%')} | {_cell(r['swarm_other_fraction'], '.1%')} | "
            f"{_cell(r['cpu_cost_factor'], '.3f')} | {_cell(r['cpu_share_factor'], '.3f')} "
            f"({_cell(r['bare_cpu_share'], '.3f')} -> {_cell(r['swarm_cpu_share'], '.3f')}) | "
            f"{_cell(r['steps_share_factor'], '.3f')} | {_cell(r['swarm_background_cpu_s_per_min'], '.2f')} |"
        )
    s = summary
    lines.append(f"| **sum** | {_cell(s['bare_tokens_per_s_sum'], ',.0f')} | {_cell(s['swarm_tokens_per_s_sum'], ',.0f')} | "
                 f"**{_cell(s['ratio'], '.3f')}** | | | | | | | | | |")
    return "\n".join(lines) + "\n"


# the bare worker (a process of the bare phase) --------------------------------------------------------------


def worker_main(argv: list[str] | None = None, prog: str = "python -m experiments.overhead") -> int:
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


# the phases -----------------------------------------------------------------------------------------------


def _groups_left(processes: list[PeerProcess]) -> list[str]:
    """Names of the processes whose process group still has a member (none should, once a phase is over)."""
    left = []
    for peer in processes:
        try:
            os.killpg(peer.process.pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        left.append(peer.name)
    return left


def run_bare(out_dir: Path, flags: list[str], peers: int, timeout_s: float) -> tuple[dict[str, dict], dict[str, Any]]:
    """The bare phase: start the N workers, say go once all are ready, wait for them; (figures by name, phase info)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    go = out_dir / GO_FILE
    go.unlink(missing_ok=True)
    processes: list[PeerProcess] = []
    info: dict[str, Any] = dict(load_average_before=os.getloadavg())
    try:
        for index in range(peers):
            shard = ["--shard-index", str(index), "--num-shards", str(peers)]
            processes.append(start_peer(f"bare{index}", out_dir, [*flags, *shard], None, entry=WORKER_ENTRY))
        wait_for_ready(processes, timeout_s=300)
        go.write_text(f"{time.time():.3f}\n")
        deadline = time.monotonic() + timeout_s
        while any(p.alive for p in processes) and time.monotonic() < deadline:
            time.sleep(0.2)
    except RuntimeError as e:  # a worker died before it was ready, or not all were ready in time
        info.setdefault("errors", {})["bare"] = str(e).splitlines()[0]
    finally:
        for peer in processes:
            peer.terminate()
        info["pids"] = {peer.name: peer.process.pid for peer in processes}
        info["exit_codes"] = {peer.name: peer.stop(grace_s=10) for peer in processes}
        info["process_groups_left"] = _groups_left(processes)
    results = {}
    for peer in processes:
        records = [r for r in read_metrics(peer.metrics_file) if r.get("status") == "bare"] if peer.metrics_file.exists() else []
        if records:
            results[peer.name] = records[-1]
        else:
            info.setdefault("errors", {})[peer.name] = last_log_line(peer)
    # every rate in the window all N workers ran (bare_figures), as the swarm's peers all do (a round ends them)
    together = together_window(list(results.values())) if len(results) == peers else None
    info["together_window_s"] = together and together[1] - together[0]
    return {name: bare_figures(record, together) for name, record in results.items()}, info


def run_swarm(out_dir: Path, flags: list[str], peers: int, timeout_s: float) -> tuple[dict[str, dict], dict[str, Any]]:
    """The swarm phase: N peers of a local swarm, run until each stops by itself (``--max-outer-steps``)."""
    swarm = LocalSwarm(out_dir, flags)
    info: dict[str, Any] = dict(load_average_before=os.getloadavg())
    try:
        for index in range(peers):
            swarm.start(f"peer{index}", shard=index, num_shards=peers)
        swarm.wait_all_exited(timeout_s)
    except RuntimeError as e:
        info.setdefault("errors", {})["swarm"] = str(e).splitlines()[0]
    finally:
        info["pids"] = {name: peer.process.pid for name, peer in swarm.peers.items()}
        info["exit_codes"] = swarm.stop_all()
        info["process_groups_left"] = _groups_left(list(swarm.peers.values()))
    figures = {}
    for name in swarm.peers:
        try:
            figures[name] = swarm_figures(swarm.records(name))
        except ValueError as e:
            info.setdefault("errors", {})[name] = f"{e}; {swarm.log_tail(name, 1)}"
    return figures, info


# command line ---------------------------------------------------------------------------------------------


def _parser(prog: str) -> argparse.ArgumentParser:
    from p2p_diloco.cli.flags import OneLineParser

    parser = OneLineParser(prog=prog, description="The ratio of a local swarm's tokens/s to the same N processes "
                           "trained bare (no communication), in one run. Peer flags go after --.")
    parser.add_argument("--out", required=True, help="folder for overhead.json, overhead.md and each phase's logs")
    parser.add_argument("--peers", type=int, default=3, help="processes in each phase (default 3)")
    parser.add_argument("--inner-steps", type=int, default=50, help="H of the swarm (default 50)")
    parser.add_argument("--outer-steps", type=int, default=6, help="S: the swarm's --max-outer-steps; the bare "
                        "processes time H x S steps (default 6)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per inner step (default 16)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps of each bare process first (default 2)")
    parser.add_argument("--repeats", type=int, default=1, help="swarm phases, each between two bare phases (bare, "
                        "swarm, bare, swarm, ..., bare); the ratio is the median of theirs (default 1)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit of each phase once started (default 1800)")
    return parser


def _check_peer_flags(args: argparse.Namespace, flags: list[str]) -> None:
    """Raises ValueError with a one-line reason for flags a peer would refuse (without starting anything)."""
    from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, overrides_from
    from p2p_diloco.core.config_load import build_config

    if min(args.peers, args.inner_steps, args.outer_steps, args.repeats) < 1 or args.warmup_steps < 0:
        raise ValueError("--peers, --inner-steps, --outer-steps and --repeats must be >= 1, --warmup-steps >= 0")
    parser = OneLineParser(prog="peer flags")
    parser.add_argument("--config")
    add_peer_flags(parser)
    build_config(overrides_from(parser.parse_args(flags)))


def main(argv: list[str] | None = None, prog: str = "bench_overhead.py") -> int:
    from p2p_diloco.cli.peer import fail

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        own, extra = split_argv(argv)
    except ValueError as e:
        return fail(prog, str(e))
    args = _parser(prog).parse_args(own)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    peer_flags = swarm_flags(args, extra)
    try:
        _check_peer_flags(args, peer_flags)
    except ValueError as e:
        return fail(prog, str(e))
    settings = dict(
        command=f"{prog} {' '.join(argv)}", peers=args.peers, inner_steps=args.inner_steps, outer_steps=args.outer_steps,
        bare_steps=args.inner_steps * args.outer_steps, warmup_steps=args.warmup_steps, threads=args.threads,
        batch_size=args.batch_size, seq_len=args.seq_len, extra_peer_flags=extra, peer_flags=peer_flags,
        cpu_count=os.cpu_count(),
    )
    print(f"{args.repeats} swarm phase(s), each between two bare phases: bare {args.peers} processes x "
          f"{settings['bare_steps']} steps (after {args.warmup_steps} warm-up steps); swarm {args.peers} peers, "
          f"H = {args.inner_steps}, {args.outer_steps} outer steps", flush=True)
    bares: list[tuple[dict, dict]] = []
    swarms: list[tuple[dict, dict]] = []

    def bare_phase(index: int) -> None:
        folder = out / f"bare-{index}"
        bares.append(run_bare(folder, bare_flags(args, extra, folder / GO_FILE), args.peers, args.timeout_s))
        for name, f in sorted(bares[-1][0].items()):
            together = (f"{f['own_window_tokens_per_s']:,.0f} tokens/s; while all ran ({f['window_s']:.2f} s): "
                        if f["window"] == "together" else "")
            print(f"  bare {index}, {name}: {f['tokens']:,} tokens in {f['wall_s']:.2f} s = {together}"
                  f"{f['tokens_per_s']:,.0f} tokens/s (core share {_cell(f['cpu_share'], '.3f')})", flush=True)

    bare_phase(1)
    for index in range(1, args.repeats + 1):
        swarms.append(run_swarm(out / f"swarm-{index}", peer_flags, args.peers, args.timeout_s))
        for name, f in sorted(swarms[-1][0].items()):
            print(f"  swarm {index}, {name}: {f['tokens']:,} tokens in {f['wall_s']:.2f} s = {f['tokens_per_s']:,.0f} "
                  f"tokens/s ({f['outer_steps']} outer steps, blocked {f['blocked_fraction']:.1%}, "
                  f"eval {f['eval_fraction']:.1%}, core share {_cell(f['cpu_share'], '.3f')})", flush=True)
        bare_phase(index + 1)
    repeats = []
    for index, (swarm, _) in enumerate(swarms):
        bare = bracket(bares[index][0], bares[index + 1][0])
        repeats.append(dict(summary=summarise(bare, swarm, args.peers), bare_before=bare_sum(bares[index][0]),
                            bare_after=bare_sum(bares[index + 1][0])))
    ratios = [r["summary"]["ratio"] for r in repeats]
    ratio = statistics.median(ratios) if all(x is not None for x in ratios) else None
    own = [r["summary"]["ratio_own_windows"] for r in repeats]
    own_ratio = statistics.median(own) if own and all(x is not None for x in own) else None
    net = [r["summary"]["ratio_at_equal_cpu_cost"] for r in repeats]
    net_ratio = statistics.median(net) if net and all(x is not None for x in net) else None
    summary = dict(repeats=repeats, ratio=ratio, ratios=ratios, ratio_own_windows=own_ratio,
                   ratio_at_equal_cpu_cost=net_ratio,
                   complete=all(r["summary"]["complete"] for r in repeats))
    result = dict(settings=settings, summary=summary,
                  bare=[dict(processes=figures, **info) for figures, info in bares],
                  swarm=[dict(processes=figures, **info) for figures, info in swarms])
    tables = []
    for index, r in enumerate(repeats, start=1):
        tables.append(f"swarm {index} against the mean of the bare phases before and after it "
                      f"({_cell(r['bare_before'], ',.0f')} and {_cell(r['bare_after'], ',.0f')} tokens/s):\n\n"
                      f"{markdown_table(r['summary'])}")
    table = "\n".join(tables)
    each = ", ".join(_cell(x, ".3f") for x in ratios)
    headline = (f"swarm / bare tokens/s = {_cell(ratio, '.3f')}{f' (median of {each})' if len(ratios) > 1 else ''} "
                f"({args.peers} processes, {args.threads} thread(s) each, batch {args.batch_size} x {args.seq_len}, "
                f"H = {args.inner_steps}, {args.outer_steps} outer steps)")
    if args.peers > 1:
        own_each = ", ".join(_cell(x, ".3f") for x in own)
        headline += (f"\n(bare rates while all {args.peers} ran; over each bare process's own window instead: "
                     f"{_cell(own_ratio, '.3f')}{f' (median of {own_each})' if len(own) > 1 else ''})")
    net_each = ", ".join(_cell(x, ".3f") for x in net)
    headline += (f"\n(at the bare loops' CPU per token, the core share and the steps' share alone: "
                 f"{_cell(net_ratio, '.3f')}{f' (median of {net_each})' if len(net) > 1 else ''})")
    (out / "overhead.json").write_text(json.dumps(result, indent=1))
    (out / "overhead.md").write_text(f"{headline}\n\n{table}")
    print(f"\n{table}\n{headline}", flush=True)
    left = [name for _, info in [*bares, *swarms] for name in info["process_groups_left"]]
    errors = {f"{phase} {index}, {name}": error for phase, phases in (("bare", bares), ("swarm", swarms))
              for index, (_, info) in enumerate(phases, start=1) for name, error in info.get("errors", {}).items()}
    for name, error in errors.items():
        print(f"{prog}: {name}: {error}", file=sys.stderr, flush=True)
    if left:
        print(f"{prog}: processes still running after the run: {', '.join(left)}", file=sys.stderr, flush=True)
    print(f"results: {out / 'overhead.json'}  {out / 'overhead.md'}", flush=True)
    return 0 if summary["complete"] and not left and not errors else 1


if __name__ == "__main__":
    sys.exit(worker_main())
