"""What cross-checked averaging costs (``scripts/bench_cross_check.py``): the same local swarm run with the default
``--cross-check`` and with ``--no-cross-check``, phases alternated (on, off, on, off, ...) with the same seed, each
phase a fresh ``scripts/swarm.py`` run of a fixed number of outer steps.

Per phase, from the swarm's own report (observe/report.py): the averaging bytes each peer sent per successful
round, the averaging's wall time per round (median over the peers' ok rounds), how late each outer step landed
(``outer_step_lag``, a share of a round), the share of time blocked, the swarm's tokens/s, and the held-out loss
at the last outer step. It measures and writes; it holds no averaging logic.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SWARM = Path(__file__).resolve().parent.parent / "scripts" / "swarm.py"
FLAGS = ["--peers", "3", "--inner-steps", "50", "--batch-size", "16", "--seq-len", "128", "--threads", "1",
         "--wait-for-peers", "3", "--eval-every", "1", "--max-time-s", "600"]
SIDES = {"cross-check": [], "no-cross-check": ["--no-cross-check"]}


def phase_figures(report: dict[str, Any]) -> dict[str, Any]:
    """One phase's figures from its report.json."""
    peers = report["peers"].values()
    ok = [r for records in report["records"].values() for r in records if r.get("status") == "ok"]
    return dict(
        bytes_sent_per_round=statistics.median(p["bytes_sent_per_round"] for p in peers if p["bytes_sent_per_round"]),
        averaging_s_per_round=round(statistics.median(r["averaging_s"] for r in ok), 3) if ok else None,
        outer_step_lag=statistics.median(p["outer_step_lag"] for p in peers if p["outer_step_lag"] is not None),
        blocked_fraction=max(p["blocked_fraction"] or 0.0 for p in peers),
        failed_rounds=sum(p["failed_rounds"] for p in peers),
        swarm_tokens_per_s=report["swarm_tokens_per_s"],
        final_eval_loss=report["final_eval_loss"],
        invariant_1=report["invariant_1"]["held"],
    )


def summary(phases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per side, each figure's median and range over its phases."""
    found: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        mine = [phase["figures"] for phase in phases if phase["side"] == side and "figures" in phase]
        found[side] = {
            key: dict(median=statistics.median(values), min=min(values), max=max(values))
            for key in (mine[0] if mine else {}) if key != "invariant_1"
            for values in [[figures[key] for figures in mine if figures[key] is not None]] if values
        }
        found[side]["phases"] = len(mine)
        found[side]["invariant_1_held"] = all(figures["invariant_1"] for figures in mine)
    return found


def main(argv: list[str], prog: str = "bench_cross_check.py") -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description="Cross-checked averaging against --no-cross-check: "
                                     "a local swarm of 3 peers, phases alternated; writes OUT/cross_check_cost.json")
    parser.add_argument("--out", default="runs/cross-check-cost", help="output folder")
    parser.add_argument("--pairs", type=int, default=2, help="phases of each side, alternated (default 2)")
    parser.add_argument("--outer-steps", type=int, default=6, help="outer steps of each phase (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="--seed of every phase (default 0)")
    args, extra = parser.parse_known_args(argv)
    if args.pairs < 1 or args.outer_steps < 1:
        parser.error("--pairs and --outer-steps must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases: list[dict[str, Any]] = []
    for index in range(args.pairs):
        for side, side_flags in SIDES.items():
            folder = out / f"{side}-{index}"
            command = [sys.executable, str(SWARM), *FLAGS, "--max-outer-steps", str(args.outer_steps), "--seed",
                       str(args.seed), "--out", str(folder), *side_flags, *extra]
            print(f"{prog}: phase {len(phases) + 1}: {side}", flush=True)
            started = time.monotonic()
            done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=900)
            phase: dict[str, Any] = dict(side=side, folder=str(folder), wall_s=round(time.monotonic() - started, 1))
            if done.returncode != 0:
                phase["error"] = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            else:
                phase["figures"] = phase_figures(json.loads((folder / "report.json").read_text()))
            phases.append(phase)
            print(json.dumps(phase), flush=True)
    result = dict(flags=[*FLAGS, "--max-outer-steps", str(args.outer_steps), "--seed", str(args.seed), *extra],
                  phases=phases, summary=summary(phases))
    (out / "cross_check_cost.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1), flush=True)
    return 0 if all("figures" in phase for phase in phases) else 1
