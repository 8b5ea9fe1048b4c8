"""Side-by-side benchmark: p2p-diloco against the methods its users would otherwise pick, on one emulated WAN.

One invocation runs, one after the other, on the same model, data shards, seeds and link caps (each swarm in
a fresh emulated network, so the kernel's byte counters start at zero):

    diloco-int8    p2p-diloco, 8-bit outer gradients
    diloco-int4    p2p-diloco, 4-bit outer gradients with error feedback
    syncdp         synchronous data parallel: gradients all-reduced uncompressed through hivemind every step
    hivemind-opt   hivemind.Optimizer(use_local_updates=True), averaging as often as p2p-diloco's rounds
    bare           one process, the plain PyTorch loop, no network: the compute limit
    alone          one p2p-diloco peer alone, no swarm: the learner's overhead against ``bare``

and reports per method tokens/s, goodput (compute time / training wall time; evaluation time excluded
for every method alike), bytes on the wire per token (kernel counters of each peer's link) and held-out
loss at equal swarm tokens and at equal wall time; ``bench.json``, ``bench.png`` and ``bench.md`` in the
output folder. Synchronous data parallel is slow on a capped link: it runs until it has processed as
many tokens per peer as ``diloco-int8`` did (or ``--syncdp-max-time-s``), so that the loss at equal
tokens compares like with like. This module holds no training logic; the workers are ``peers/peer.py``
and ``experiments.baselines``.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.wan import Wan, WanError
from p2p_diloco.cli.peer_processes import PeerProcess, start_peer, wait_for_address
from p2p_diloco.observe.report import read_metrics

METHODS = ("diloco-int8", "diloco-int4", "syncdp", "hivemind-opt", "bare", "alone")
SWARM_METHODS = ("diloco-int8", "diloco-int4", "syncdp", "hivemind-opt")
BASELINE_ENTRY = ["-m", "experiments.baselines", "--method"]


@dataclass
class MethodRun:
    """What one method's processes wrote, and what the kernel counted on their links."""

    method: str
    records: dict[str, list[dict]]
    wire_sent: dict[str, int] = field(default_factory=dict)
    wire_received: dict[str, int] = field(default_factory=dict)
    wire_timeline: list[tuple[float, int]] = field(default_factory=list)  # (unix time, bytes sent by all peers)
    exit_codes: dict[str, int | None] = field(default_factory=dict)


def method_flags(method: str, flags: list[str], peers: int) -> tuple[list[str] | None, list[str]]:
    """(entry, flags) for one process of ``method``: the program to run and what it gets."""
    if method.startswith("diloco-"):
        return None, [*flags, "--compression", method.removeprefix("diloco-")]
    if method == "alone":
        return None, [*flags, "--compression", "int8"]
    return [*BASELINE_ENTRY, method], [*flags, "--expected-peers", str(peers)]


def run_method(
    method: str, out_dir: Path, flags: list[str], peers: int, caps: list[float | None], prefix: str,
    timeout_s: float, progress: bool = True,
) -> MethodRun:
    """Start the method's processes (in an emulated network unless it runs alone), wait until they stop by
    themselves (their flags bound them) or ``timeout_s``, stop what is left, tear the network down."""
    count = peers if method in SWARM_METHODS else 1
    out_dir.mkdir(parents=True, exist_ok=True)
    wan = Wan(count, caps[:count], prefix=prefix) if method in SWARM_METHODS else None
    entry, method_args = method_flags(method, flags, count)
    processes: list[PeerProcess] = []
    run = MethodRun(method, {})
    with wan if wan is not None else nullcontext():
        try:
            address = None
            for index in range(count):
                place = dict(command_prefix=wan.command_prefix(index), host=wan.host(index)) if wan else {}
                shard = ["--shard-index", str(index), "--num-shards", str(count)]
                peer = start_peer(f"peer{index}", out_dir, [*method_args, *shard], address, entry=entry, **place)
                processes.append(peer)
                if index == 0 and count > 1:
                    address = wait_for_address(peer, timeout_s=120)
            _watch(run, processes, wan, timeout_s, progress)
        finally:
            for peer in processes:
                peer.terminate()
            run.exit_codes = {peer.name: peer.stop(grace_s=30) for peer in processes}
            if wan is not None:
                for index, peer in enumerate(processes):
                    run.wire_sent[peer.name], run.wire_received[peer.name] = wan.wire_bytes(index)
    run.records = {p.name: read_metrics(p.metrics_file) for p in processes if p.metrics_file.exists()}
    return run


def _watch(run: MethodRun, processes: list[PeerProcess], wan: Wan | None, timeout_s: float, progress: bool) -> None:
    started = last_print = time.monotonic()
    while any(p.alive for p in processes) and time.monotonic() - started < timeout_s:
        if wan is not None:
            run.wire_timeline.append((time.time(), sum(wan.wire_bytes(i)[0] for i in range(len(processes)))))
        if progress and time.monotonic() - last_print >= 15:
            last_print = time.monotonic()
            records = [read_metrics(p.metrics_file)[-1:] for p in processes if p.metrics_file.exists()]
            tokens = sum(r[0]["tokens"] for r in records if r)
            sent = run.wire_timeline[-1][1] if run.wire_timeline else 0
            print(f"  {run.method:<13} {time.monotonic() - started:6.0f} s  {tokens:>10,} tokens  "
                  f"{sent / 1e6:8.1f} MB on the wire", flush=True)
        time.sleep(1.0)
    if wan is not None:
        run.wire_timeline.append((time.time(), sum(wan.wire_bytes(i)[0] for i in range(len(processes)))))


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through sorted points; flat outside them."""
    if not points:
        return 0.0
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def summarise(run: MethodRun) -> dict:
    """Per-method figures: throughput, goodput, bytes per token, and the held-out loss curve against wall
    time, swarm tokens and bytes sent (time from when the first process began training)."""
    finals = {name: records[-1] for name, records in run.records.items() if records}
    if not finals:
        return dict(method=run.method, error="no metrics were written", exit_codes=run.exit_codes)
    t0 = min(records[0]["unix_time"] - records[0]["time_s"] for records in run.records.values() if records)
    token_curves = {name: [(r["unix_time"], r["tokens"]) for r in records] for name, records in run.records.items()}

    def swarm_tokens(at_unix: float) -> float:
        return sum(_interpolate(curve, at_unix) if at_unix >= curve[0][0] else 0.0 for curve in token_curves.values())

    curve, seen = [], set()
    for name, records in sorted(run.records.items()):
        if run.method in ("syncdp", "hivemind-opt") and name != "peer0":
            continue  # syncdp: identical params everywhere; hivemind-opt: peer 0's own params
        for r in records:
            key = r.get("outer_step", r["unix_time"]) if run.method.startswith(("diloco", "alone")) else r["unix_time"]
            if r.get("eval_loss") is None or key in seen:
                continue
            seen.add(key)
            curve.append(dict(wall_s=round(r["unix_time"] - t0, 2), swarm_tokens=round(swarm_tokens(r["unix_time"])),
                              bytes_sent=round(_interpolate(run.wire_timeline, r["unix_time"]) - _interpolate(run.wire_timeline, t0)) if run.wire_timeline else 0,
                              eval_loss=r["eval_loss"]))
    curve.sort(key=lambda point: point["wall_s"])
    peers = {}
    for name, last in finals.items():
        train_s = max(1e-9, last["time_s"] - last.get("eval_s", 0.0))
        peers[name] = dict(tokens=last["tokens"], tokens_per_s=round(last["tokens"] / train_s, 1),
                           goodput=round(last["compute_s"] / train_s, 4), wall_s=last["time_s"])
    tokens = sum(p["tokens"] for p in peers.values())
    wire = sum(run.wire_sent.values())
    # bytes per token counts the training period only: the processes' start-up and the synchronised start
    # are a benchmark's artefact; the traffic of an idle swarm (DHT records, keep-alives) over the last 10 s
    # before training began is reported on its own, as it does not grow with the model
    # ... and ends at the last record: the tokens are those the records report, so the bytes are those sent by
    # then (a p2p-diloco peer records at outer steps; the traffic of a round it did not finish has no tokens)
    t_end = max(last["unix_time"] for last in finals.values())
    trained_wire = _interpolate(run.wire_timeline, t_end) - _interpolate(run.wire_timeline, t0) if run.wire_timeline else 0
    idle_rate = (_interpolate(run.wire_timeline, t0) - _interpolate(run.wire_timeline, t0 - 10)) / 10 if run.wire_timeline else 0
    return dict(
        method=run.method,
        peers=len(peers),
        exit_codes=run.exit_codes,
        swarm_tokens=tokens,
        swarm_tokens_per_s=round(sum(p["tokens_per_s"] for p in peers.values()), 1),
        tokens_per_s_per_peer=round(sum(p["tokens_per_s"] for p in peers.values()) / len(peers), 1),
        goodput=round(min(p["goodput"] for p in peers.values()), 4),
        goodput_mean=round(sum(p["goodput"] for p in peers.values()) / len(peers), 4),
        wire_bytes_sent=wire,
        wire_bytes_sent_training=round(trained_wire),
        wire_bytes_per_token=round(trained_wire / tokens, 3) if tokens and run.wire_sent else None,
        idle_swarm_bytes_per_s=round(idle_rate),
        wall_s=round(max(p["wall_s"] for p in peers.values()), 1),
        final_eval_loss=curve[-1]["eval_loss"] if curve else None,
        eval_curve=curve,
        per_peer=peers,
        wire_timeline=[(round(at, 2), sent) for at, sent in run.wire_timeline],  # for re-analysis of a saved run
    )


def loss_at(curve: list[dict], axis: str, value: float) -> float | None:
    """The held-out loss of the last evaluation at or before ``value`` on ``axis`` (what the model was then)."""
    before = [point for point in curve if point[axis] <= value * (1 + 1e-9)]
    return before[-1]["eval_loss"] if before else None


def compare(summaries: dict[str, dict]) -> dict:
    """The cross-method figures the issue asks for."""
    swarm = {m: s for m, s in summaries.items() if m in SWARM_METHODS and s.get("eval_curve")}
    result: dict = {}
    if swarm:
        equal_tokens = min(s["eval_curve"][-1]["swarm_tokens"] for s in swarm.values())
        equal_wall = min(s["eval_curve"][-1]["wall_s"] for s in swarm.values())
        result["equal_tokens"] = equal_tokens
        result["equal_wall_s"] = equal_wall
        for s in swarm.values():
            s["eval_loss_at_equal_tokens"] = loss_at(s["eval_curve"], "swarm_tokens", equal_tokens)
            s["eval_loss_at_equal_wall_s"] = loss_at(s["eval_curve"], "wall_s", equal_wall)
    sync = summaries.get("syncdp", {}).get("wire_bytes_per_token")
    for method in ("diloco-int8", "diloco-int4", "hivemind-opt"):
        own = summaries.get(method, {}).get("wire_bytes_per_token")
        if sync and own:
            result[f"{method}_fewer_bytes_per_token_than_syncdp"] = round(sync / own, 1)
        loss, sync_loss = (summaries.get(m, {}).get("eval_loss_at_equal_tokens") for m in (method, "syncdp"))
        if loss is not None and sync_loss:
            result[f"{method}_eval_loss_vs_syncdp_at_equal_tokens"] = round(loss / sync_loss - 1, 4)
    result["pairs"] = pairwise(swarm)
    bare, alone = summaries.get("bare", {}), summaries.get("alone", {})
    if bare.get("swarm_tokens_per_s") and alone.get("swarm_tokens_per_s"):
        result["alone_tokens_per_s_vs_bare"] = round(alone["swarm_tokens_per_s"] / bare["swarm_tokens_per_s"], 4)
    return result


def pairwise(swarm: dict[str, dict]) -> list[dict]:
    """Each p2p-diloco variant against each baseline, at the equal tokens and equal wall time of *that pair*
    (the shorter of the two runs), so that one short run elsewhere does not set every comparison's point."""
    pairs = []
    for method in ("diloco-int8", "diloco-int4"):
        for baseline in ("syncdp", "hivemind-opt"):
            if method not in swarm or baseline not in swarm:
                continue
            curves = {m: swarm[m]["eval_curve"] for m in (method, baseline)}
            pair: dict = dict(method=method, baseline=baseline)
            for axis in ("swarm_tokens", "wall_s"):
                point = min(curve[-1][axis] for curve in curves.values())
                losses = {m: loss_at(curve, axis, point) for m, curve in curves.items()}
                pair[f"equal_{axis}"] = point
                pair[f"loss_at_equal_{axis}"] = losses
                if losses[method] is not None and losses[baseline]:
                    pair[f"vs_baseline_at_equal_{axis}"] = round(losses[method] / losses[baseline] - 1, 4)
            pairs.append(pair)
    return pairs


def markdown_table(summaries: dict[str, dict], comparison: dict) -> str:
    tokens, wall = comparison.get("equal_tokens"), comparison.get("equal_wall_s")
    lines = [
        f"| method | peers | swarm tok/s | tok/s per peer | goodput (min peer) | wire B/token | idle swarm kB/s "
        f"| loss @ {tokens or 0:,} tokens | loss @ {wall or 0:.0f} s | final loss (tokens) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value: float | None, spec: str) -> str:
        return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    for method in METHODS:
        s = summaries.get(method)
        if not s or "error" in s:
            continue
        final = f"{fmt(s['final_eval_loss'], '.3f')} ({s['eval_curve'][-1]['swarm_tokens']:,})" if s["eval_curve"] else "–"
        lines.append(
            f"| {method} | {s['peers']} | {s['swarm_tokens_per_s']:,.0f} | {s['tokens_per_s_per_peer']:,.0f} "
            f"| {100 * s['goodput']:.1f}% | {fmt(s['wire_bytes_per_token'], ',.1f')} "
            f"| {fmt(s['idle_swarm_bytes_per_s'] / 1e3 if s['wire_bytes_per_token'] is not None else None, '.1f')} "
            f"| {fmt(s.get('eval_loss_at_equal_tokens'), '.3f')} | {fmt(s.get('eval_loss_at_equal_wall_s'), '.3f')} | {final} |"
        )
    if comparison.get("pairs"):
        lines += ["", "| p2p-diloco | against | equal swarm tokens: loss (vs) | equal wall time: loss (vs) |", "|---|---|---|---|"]
        for pair in comparison["pairs"]:
            cells = []
            for axis, unit in (("swarm_tokens", "{:,} tokens"), ("wall_s", "{:.0f} s")):
                losses = pair[f"loss_at_equal_{axis}"]
                versus = pair.get(f"vs_baseline_at_equal_{axis}")
                cells.append(
                    f"{unit.format(pair[f'equal_{axis}'])}: {fmt(losses[pair['method']], '.3f')} vs "
                    f"{fmt(losses[pair['baseline']], '.3f')} ({fmt(None if versus is None else 100 * versus, '+.1f')}%)"
                )
            lines.append(f"| {pair['method']} | {pair['baseline']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def plot(summaries: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, s in summaries.items():
        curve = s.get("eval_curve") or []
        if not curve:
            continue
        by_time.plot([p["wall_s"] for p in curve], [p["eval_loss"] for p in curve], marker=".", label=method)
        sent = [(p["bytes_sent"] / 1e6, p["eval_loss"]) for p in curve if p["bytes_sent"] > 0]
        if sent:
            by_bytes.plot(*zip(*sent), marker=".", label=method)
    by_time.set(xlabel="wall time (s)", ylabel="held-out loss", title="loss vs wall time")
    by_bytes.set(xlabel="MB sent on the wire, all peers (log)", ylabel="held-out loss", title="loss vs bytes sent",
                 xscale="log")
    for axes in (by_time, by_bytes):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_outputs(out_dir: Path, summaries: dict[str, dict], comparison: dict, settings: dict) -> str:
    table = markdown_table(summaries, comparison)
    (out_dir / "bench.json").write_text(json.dumps(dict(settings=settings, comparison=comparison, methods=summaries), indent=1))
    (out_dir / "bench.md").write_text(table)
    plot(summaries, out_dir / "bench.png")
    return table


BENCH_PEER_DEFAULTS = ["--eval-every", "1", "--inner-steps", "100", "--matchmaking-time-s", "5", "--run-id", "bench"]
_OWN_FLAGS = {"--out", "--quick", "--peers", "--bandwidth-mbit", "--methods", "--duration-s", "--syncdp-max-time-s", "--prefix",
              "--startup-s"}


def main(argv: list[str] | None = None, prog: str = "bench.py") -> int:
    from experiments.wan import unavailable_reason
    from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, resolve_config
    from p2p_diloco.cli.launch import peer_args_without
    from p2p_diloco.cli.peer import fail

    parser = OneLineParser(prog=prog, description="p2p-diloco against synchronous data parallel, hivemind.Optimizer "
                            "and a bare PyTorch loop, on the same model, data, seeds and emulated links (needs root).")
    parser.add_argument("--out", default="runs/bench", help="folder for bench.json, bench.md, bench.png and each method's logs")
    parser.add_argument("--quick", action="store_true", help="short runs (the whole benchmark in under 5 minutes), for a smoke check")
    parser.add_argument("--peers", type=int, default=4, help="peers per swarm (default 4)")
    parser.add_argument("--bandwidth-mbit", type=float, nargs="+", default=[20.0], metavar="MBIT",
                        help="each peer's link cap, each way: one value or one per peer (default 20)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="which methods to run (default all)")
    parser.add_argument("--duration-s", type=float, help="wall time of each method's run (default 360, quick 20)")
    parser.add_argument("--syncdp-max-time-s", type=float,
                        help="synchronous data parallel runs until it has as many tokens per peer as diloco-int8, or this long (default 600, quick 40)")
    parser.add_argument("--startup-s", type=float,
                        help="seconds the processes of a swarm get to start and join before all begin training together (default 35, quick 25)")
    parser.add_argument("--prefix", default="p2pbench", help="name prefix of the emulated network (default p2pbench)")
    add_peer_flags(parser)
    args = parser.parse_args(argv)
    caps = args.bandwidth_mbit * args.peers if len(args.bandwidth_mbit) == 1 else args.bandwidth_mbit
    if args.peers < 2 or len(caps) != args.peers:
        return fail(prog, "--peers must be >= 2 and --bandwidth-mbit one value or one per peer")
    try:
        resolve_config(args)
    except ValueError as e:
        return fail(prog, str(e))
    reason = unavailable_reason()
    if reason:
        return fail(prog, f"the benchmark runs its swarms in an emulated network: {reason}")
    duration = args.duration_s or (20.0 if args.quick else 360.0)
    sync_cap = args.syncdp_max_time_s or (40.0 if args.quick else 600.0)
    defaults = BENCH_PEER_DEFAULTS + (["--inner-steps", "25", "--batch-size", "8"] if args.quick else [])
    if args.quick and args.startup_s is None:
        args.startup_s = 25.0
    args.startup_s = 35.0 if args.startup_s is None else args.startup_s
    flags = [*defaults, *peer_args_without(argv or [], _OWN_FLAGS)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(command=f"{prog} {' '.join(argv or [])}", peers=args.peers, bandwidth_mbit=caps, duration_s=duration,
                    syncdp_max_time_s=sync_cap, peer_flags=flags)
    summaries: dict[str, dict] = {}
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM too tears the emulated network down
    try:
        _run_methods(args, flags, caps, duration, sync_cap, out, summaries)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; the methods finished so far are reported", file=sys.stderr, flush=True)
        code = 130
    except WanError as e:
        return fail(prog, str(e))
    else:
        code = 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    comparison = compare(summaries)
    table = write_outputs(out, summaries, comparison, settings)
    print(table + json.dumps(comparison, indent=1), flush=True)
    print(f"results: {out / 'bench.json'}  {out / 'bench.md'}  {out / 'bench.png'}", flush=True)
    return code


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _run_methods(args: Any, flags: list[str], caps: list[float | None], duration: float, sync_cap: float, out: Path,
                 summaries: dict[str, dict]) -> None:
    for method in args.methods:
        extra = ["--max-time-s", str(duration)]
        if method in ("syncdp", "hivemind-opt", "bare"):
            extra += ["--eval-every-s", str(max(5.0, duration / 12))]
        if method == "syncdp":
            extra = ["--max-time-s", str(sync_cap), "--eval-every-s", str(max(5.0, duration / 12))]
            tokens = summaries.get("diloco-int8", {}).get("per_peer")
            if tokens:
                extra += ["--max-tokens", str(max(p["tokens"] for p in tokens.values()))]
        if method in SWARM_METHODS:  # every process joins first; training starts at the same moment for all
            extra += ["--start-at", f"{time.time() + args.startup_s:.1f}"]
        print(f"{method}: starting ({' '.join(extra)})", flush=True)
        run = run_method(method, out / method, [*flags, *extra], args.peers, caps, args.prefix,
                         timeout_s=float(extra[1]) + args.startup_s + 180)
        summaries[method] = summarise(run)
        s = summaries[method]
        if "error" in s:
            print(f"{method}: {s['error']} (exit codes {s['exit_codes']})", flush=True)
            continue
        print(f"{method}: {s['swarm_tokens']:,} tokens, {s['swarm_tokens_per_s']:,.0f} tok/s, goodput "
              f"{100 * s['goodput']:.1f}%, {s['wire_bytes_sent']:,} B on the wire, final loss {s['final_eval_loss']}", flush=True)
