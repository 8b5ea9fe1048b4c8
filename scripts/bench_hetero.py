"""Mixed-speed islands: a local swarm of N peers where one is throttled, against the same swarm without.

    python scripts/bench_hetero.py --out runs/hetero [--peers 4] [--throttle 3] [--duration-s 150] [peer flags]

Both swarms run in this one invocation, one after the other, on the same model, data, seeds and flags.
Writes ``bench_hetero.json`` (per-peer tokens/s in both runs and their ratio, the throttled peer's share
of the averaging weight per round, blocked fractions, invariant 1) and ``bench_hetero.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from p2p_diloco.cli.peer_processes import run_to_end  # noqa: E402


def run_swarm(out_dir: Path, throttles: list[float], duration_s: float, flags: list[str]) -> dict:
    per_peer = [["--throttle", str(throttle), "--max-time-s", str(duration_s)] for throttle in throttles]
    return run_to_end(out_dir, flags, per_peer, timeout_s=duration_s + 180)


def weight_shares(records: list[dict]) -> list[dict]:
    return [
        dict(outer_step=r["outer_step"], time_s=r["time_s"], weight=r["weight"], weight_total=r["weight_total"],
             share=r["weight_share"], group_size=r["group_size"])
        for r in records if r["status"] == "ok" and r["group_size"] > 1
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/hetero")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--throttle", type=float, default=3.0, help="slow-down of the last peer in the mixed run")
    parser.add_argument("--duration-s", type=float, default=150.0, help="wall time of each swarm")
    args, flags = parser.parse_known_args()
    flags = ["--eval-every", "1", *flags]  # a held-out loss at every outer step: the curves compare settings
    out = Path(args.out)
    uniform = run_swarm(out / "uniform", [1.0] * args.peers, args.duration_s, flags)
    mixed = run_swarm(out / "mixed", [1.0] * (args.peers - 1) + [args.throttle], args.duration_s, flags)
    slow = f"peer{args.peers - 1}"
    fast = [f"peer{i}" for i in range(args.peers - 1)]
    result = dict(
        command=" ".join(sys.argv),
        peers=args.peers,
        throttle=args.throttle,
        duration_s=args.duration_s,
        fast_peers={
            name: dict(
                tokens_per_s_uniform=uniform["peers"][name]["tokens_per_s"],
                tokens_per_s_mixed=mixed["peers"][name]["tokens_per_s"],
                ratio=round(mixed["peers"][name]["tokens_per_s"] / uniform["peers"][name]["tokens_per_s"], 3),
                blocked_fraction_mixed=mixed["peers"][name]["blocked_fraction"],
            )
            for name in fast
        },
        throttled_peer=dict(
            tokens_per_s=mixed["peers"][slow]["tokens_per_s"],
            tokens_per_s_unthrottled=uniform["peers"][slow]["tokens_per_s"],
            weight_share_per_round=weight_shares(mixed["records"][slow]),
        ),
        invariant_1=dict(uniform=uniform["invariant_1"], mixed=mixed["invariant_1"]),
        final_eval_loss=dict(uniform=uniform["final_eval_loss"], mixed=mixed["final_eval_loss"]),
        blocked_fraction=dict(
            uniform={n: p["blocked_fraction"] for n, p in uniform["peers"].items()},
            mixed={n: p["blocked_fraction"] for n, p in mixed["peers"].items()},
        ),
    )
    (out / "bench_hetero.json").write_text(json.dumps(result, indent=1))
    plot(result, uniform, mixed, out / "bench_hetero.png")
    print(json.dumps({k: v for k, v in result.items() if k != "throttled_peer"}, indent=1))
    shares = [s["share"] for s in result["throttled_peer"]["weight_share_per_round"]]
    print(f"throttled peer's weight share per round: {shares}")
    return 0


def plot(result: dict, uniform: dict, mixed: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, share) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = sorted(uniform["peers"])
    xs = range(len(names))
    speed.bar([x - 0.2 for x in xs], [uniform["peers"][n]["tokens_per_s"] for n in names], 0.4, label="all at full speed")
    speed.bar([x + 0.2 for x in xs], [mixed["peers"][n]["tokens_per_s"] for n in names], 0.4,
              label=f"last peer throttled {result['throttle']}x")
    speed.set_xticks(list(xs), names)
    speed.set_ylabel("tokens / s")
    speed.legend()
    rounds = result["throttled_peer"]["weight_share_per_round"]
    share.plot([r["outer_step"] for r in rounds], [r["share"] for r in rounds], marker="o")
    share.set_xlabel("outer step")
    share.set_ylabel("throttled peer's share of the round's weight (tokens)")
    share.set_ylim(0, 1)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
