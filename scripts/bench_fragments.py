"""Streaming fragments: the same local swarm averaging the whole model at once, and in P staggered fragments.

    python scripts/bench_fragments.py --out runs/fragments [--peers 3] [--fragments 4] [--rounds 8] [peer flags]

Both runs process the same tokens (the same rounds of the same swarm-wide budget; with P fragments a
round is P outer steps, each averaging one fragment). Writes ``bench_fragments.json``: per peer the
largest send burst (bytes/s over ~1 s windows), the total bytes sent, the final held-out loss of the
global params, invariant 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from p2p_diloco.launcher import run_to_end  # noqa: E402


def run(out_dir: Path, peers: int, fragments: int, rounds: int, flags: list[str]) -> dict:
    run_flags = [*flags, "--fragments", str(fragments), "--max-outer-steps", str(rounds * fragments)]
    report = run_to_end(out_dir, run_flags, [[] for _ in range(peers)], timeout_s=3600)
    records = report["records"]
    evaluated = [r for rs in records.values() for r in rs if r.get("eval_loss") is not None]
    last = max(r["outer_step"] for r in evaluated)
    return dict(
        fragments=fragments,
        peak_send_bytes_per_s={n: max(r.get("peak_send_bytes_per_s", 0) for r in rs) for n, rs in records.items()},
        bytes_sent={n: p["bytes_sent"] for n, p in report["peers"].items()},
        bytes_sent_per_averaging={n: p["bytes_sent_per_round"] for n, p in report["peers"].items()},
        swarm_tokens=report["swarm_tokens"],
        final_eval_loss=min(r["eval_loss"] for r in evaluated if r["outer_step"] == last),
        invariant_1=report["invariant_1"],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fragments")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    args, flags = parser.parse_known_args()
    if not any(f.startswith("--tokens-per-round") for f in flags):
        flags += ["--tokens-per-round", str(args.peers * 30 * 16 * 128)]
    out = Path(args.out)
    whole = run(out / "whole", args.peers, 1, args.rounds, flags)
    streamed = run(out / "streamed", args.peers, args.fragments, args.rounds, flags)
    peak_whole = max(whole["peak_send_bytes_per_s"].values())
    peak_streamed = max(streamed["peak_send_bytes_per_s"].values())
    result = dict(
        command=" ".join(sys.argv),
        whole=whole,
        streamed=streamed,
        peak_reduction=round(peak_whole / peak_streamed, 2) if peak_streamed else None,
        total_bytes_ratio=round(sum(streamed["bytes_sent"].values()) / sum(whole["bytes_sent"].values()), 3),
        eval_loss_vs_whole=round(streamed["final_eval_loss"] / whole["final_eval_loss"] - 1, 4),
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_fragments.json").write_text(json.dumps(result, indent=1))
    print(f"largest send burst: {peak_whole:,.0f} B/s whole vs {peak_streamed:,.0f} B/s in {args.fragments} fragments "
          f"({result['peak_reduction']}x lower); total bytes ratio {result['total_bytes_ratio']}; "
          f"eval loss {whole['final_eval_loss']:.4f} vs {streamed['final_eval_loss']:.4f} "
          f"({result['eval_loss_vs_whole']:+.2%}); invariant 1 {whole['invariant_1']['held']} / {streamed['invariant_1']['held']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
