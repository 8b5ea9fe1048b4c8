"""What the swarm costs in throughput: N peers' tokens/s against the same N processes trained bare, in one run.

    python scripts/bench_overhead.py --out runs/overhead [--peers 3] [--inner-steps 50] [--outer-steps 6]
        [--threads 1] [--batch-size 16] [--seq-len 128] [--repeats 1] [-- extra peer flags]

Phases one after the other, on the same machine, model, data shards, batch and threads: bare, swarm, bare (and with
``--repeats R``, R swarm phases, each between two bare phases). Each swarm phase is compared with the mean of the
bare phases around it, so that a machine whose speed drifts over the run (a shared one does, by several percent in
minutes) moves both sides alike; the headline is the median of the swarm phases' ratios.

1. **bare**: N worker processes (``python -m experiments.overhead_worker``), each the plain PyTorch loop of a peer's
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
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from experiments.overhead_figures import (
    bare_figures,
    bare_sum,
    bracket,
    cell,
    markdown_table,
    summarise,
    swarm_figures,
    together_window,
)
from p2p_diloco.cli.peer_processes import LocalSwarm, PeerProcess, last_log_line, start_peer, wait_for_ready
from p2p_diloco.observe.report import read_metrics

WORKER_ENTRY = ["-m", "experiments.overhead_worker"]  # the bare worker, run as a program
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
                  f"{f['tokens_per_s']:,.0f} tokens/s (core share {cell(f['cpu_share'], '.3f')})", flush=True)

    bare_phase(1)
    for index in range(1, args.repeats + 1):
        swarms.append(run_swarm(out / f"swarm-{index}", peer_flags, args.peers, args.timeout_s))
        for name, f in sorted(swarms[-1][0].items()):
            print(f"  swarm {index}, {name}: {f['tokens']:,} tokens in {f['wall_s']:.2f} s = {f['tokens_per_s']:,.0f} "
                  f"tokens/s ({f['outer_steps']} outer steps, blocked {f['blocked_fraction']:.1%}, "
                  f"eval {f['eval_fraction']:.1%}, core share {cell(f['cpu_share'], '.3f')})", flush=True)
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
                      f"({cell(r['bare_before'], ',.0f')} and {cell(r['bare_after'], ',.0f')} tokens/s):\n\n"
                      f"{markdown_table(r['summary'])}")
    table = "\n".join(tables)
    each = ", ".join(cell(x, ".3f") for x in ratios)
    headline = (f"swarm / bare tokens/s = {cell(ratio, '.3f')}{f' (median of {each})' if len(ratios) > 1 else ''} "
                f"({args.peers} processes, {args.threads} thread(s) each, batch {args.batch_size} x {args.seq_len}, "
                f"H = {args.inner_steps}, {args.outer_steps} outer steps)")
    if args.peers > 1:
        own_each = ", ".join(cell(x, ".3f") for x in own)
        headline += (f"\n(bare rates while all {args.peers} ran; over each bare process's own window instead: "
                     f"{cell(own_ratio, '.3f')}{f' (median of {own_each})' if len(own) > 1 else ''})")
    net_each = ", ".join(cell(x, ".3f") for x in net)
    headline += (f"\n(at the bare loops' CPU per token, the core share and the steps' share alone: "
                 f"{cell(net_ratio, '.3f')}{f' (median of {net_each})' if len(net) > 1 else ''})")
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
