"""Outer-gradient codecs side by side: the same local swarm with none, fp16, int8, and int4, int2 and topk (+ error feedback).

    python scripts/bench_compression.py --out runs/compression [--peers 3] [--outer-steps 12] [peer flags]

Every codec trains the same model on the same data with the same seeds for the same number of outer steps
of a fixed swarm-wide token budget, so the runs see (nearly) the same tokens. Writes
``bench_compression.json`` (final held-out loss of the global params, bytes sent per peer per round,
invariant 1) and ``bench_compression.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from p2p_diloco.cli.peer_processes import run_to_end  # noqa: E402

CODECS = ("none", "fp16", "int8", "int4", "int2", "topk")


def run_codec(out_dir: Path, codec: str, peers: int, outer_steps: int, flags: list[str]) -> dict:
    codec_flags = [*flags, "--compression", codec, "--max-outer-steps", str(outer_steps)]
    report = run_to_end(out_dir, codec_flags, [[] for _ in range(peers)], timeout_s=3600)
    evaluated = [r for rs in report["records"].values() for r in rs if r.get("eval_loss") is not None]
    last_step = max(r["outer_step"] for r in evaluated)
    return dict(
        final_outer_step=last_step,
        final_eval_loss=min(r["eval_loss"] for r in evaluated if r["outer_step"] == last_step),
        eval_loss_by_step={str(r["outer_step"]): r["eval_loss"] for r in sorted(evaluated, key=lambda r: r["time_s"])},
        swarm_tokens=report["swarm_tokens"],
        bytes_sent_per_peer_round=round(
            sum(p["bytes_sent_per_round"] or 0 for p in report["peers"].values()) / max(1, len(report["peers"]))
        ),
        invariant_1=report["invariant_1"]["held"],
        forks=report["invariant_1"]["forks"],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/compression")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--outer-steps", type=int, default=12)
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    args, flags = parser.parse_known_args()
    flags = ["--eval-every", "1", *flags]  # a held-out loss at every outer step: the curves compare codecs
    if not any(f.startswith("--tokens-per-round") for f in flags):
        flags += ["--tokens-per-round", str(args.peers * 20 * 16 * 128)]  # H=20 per peer at the default batch
    out = Path(args.out)
    results = {codec: run_codec(out / codec, codec, args.peers, args.outer_steps, flags) for codec in args.codecs}
    summary = dict(command=" ".join(sys.argv), peers=args.peers, outer_steps=args.outer_steps, flags=flags, codecs=results)
    if "int8" in results:
        base = results["int8"]
        for result in results.values():
            result["eval_loss_vs_int8"] = round(result["final_eval_loss"] / base["final_eval_loss"] - 1, 4)
            result["bytes_vs_int8"] = round(result["bytes_sent_per_peer_round"] / base["bytes_sent_per_peer_round"], 3)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_compression.json").write_text(json.dumps(summary, indent=1))
    plot(results, out / "bench_compression.png")
    for codec, result in results.items():
        print(f"{codec:>5}: eval loss {result['final_eval_loss']:.4f} ({result.get('eval_loss_vs_int8', 0):+.2%} vs int8), "
              f"{result['bytes_sent_per_peer_round']:,} B sent/peer/round ({result.get('bytes_vs_int8', 1):.2f}x int8), "
              f"{result['swarm_tokens']:,} tokens, invariant 1 {'held' if result['invariant_1'] else 'VIOLATED'}")
    return 0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss, size) = plt.subplots(1, 2, figsize=(12, 4.5))
    for codec, result in results.items():
        steps = sorted(result["eval_loss_by_step"], key=int)
        loss.plot([int(s) for s in steps], [result["eval_loss_by_step"][s] for s in steps], marker=".", label=codec)
    loss.set_xlabel("outer step")
    loss.set_ylabel("held-out loss of the global params")
    loss.legend()
    size.bar(list(results), [r["bytes_sent_per_peer_round"] / 1e6 for r in results.values()])
    size.set_ylabel("MB sent per peer per round")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
