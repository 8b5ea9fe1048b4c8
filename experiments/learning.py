"""The learning study: DiLoCo's loss gap to tuned synchronous data parallel, against bytes on the wire per token.

    python scripts/learning_study.py run --out docs/learning [--jobs 2] [--phase tune-syncdp outer-grid seeds]
    python scripts/learning_study.py probe --out docs/learning [--jobs 2]
    python scripts/learning_study.py report --out docs/learning

Both methods are computed in one process each, without a network, on the default model and the built-in corpus
(experiments/learning_runs.py: the budget, the schedule, the codec on both hops, the held-out set, the bytes on
the wire); each phase's runs are planned from the results so far (experiments/learning_plan.py, from the grids of
experiments/learning_grids.py).

Each finished run is appended to ``results.jsonl`` under ``--out`` at once; ``run`` skips the runs already there,
so the study resumes where it stopped (and can grow across sessions). ``probe`` runs some of phase floor's runs again
with sync DP's step measured beside each of theirs (``_FloorProbe``, experiments/learning_runs.py), into
``floor_probe.jsonl``. ``report`` writes ``study.md`` (the tables) and ``study.png`` (the gap against bytes per token,
seeds as a band) from those files alone (experiments/learning_report.py, learning_plot.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, as_completed, wait
from pathlib import Path

from experiments.learning_floor import probe_runs
from experiments.learning_plan import PHASES, _remaining, next_runs
from experiments.learning_runs import CLIP, D_MODEL, train


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



def run_probes(out: Path, jobs: int) -> None:
    """The floor's probe (learning_runs._FloorProbe) on probe_runs not yet in floor_probe.jsonl, ``jobs`` at once, each
    appended with the final loss results.jsonl holds for the same run (the probe leaves the run as it was: the two should
    agree)."""
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

