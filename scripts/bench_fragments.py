"""Streaming fragments: the same local swarm averaging the whole model at once, and in P staggered fragments.

    python scripts/bench_fragments.py --out runs/fragments [--peers 3] [--fragments 4] [--rounds 8] [peer flags]

Both runs have the same rounds of the same swarm-wide token budget (with P fragments a round is P outer
steps, each averaging one fragment). Writes ``bench_fragments.json``: per peer the largest send burst
(bytes/s over a sliding ~1 s window), the bytes of one round, the held-out loss of the global params at
equal swarm tokens (the streamed curve interpolated at the whole-model run's final tokens), invariant 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from p2p_diloco.cli.peer_processes import run_to_end  # noqa: E402


def loss_by_swarm_tokens(records: dict[str, list[dict]]) -> list[tuple[int, float]]:
    """(tokens processed by the whole swarm, held-out loss of the global params) at each outer step that every
    peer reported (the global params of a step are the same bytes on every peer: invariant 1)."""
    steps: dict[int, dict[str, dict]] = {}
    for name, peer_records in records.items():
        for r in peer_records:
            if r.get("eval_loss") is not None:
                steps.setdefault(r["outer_step"], {}).setdefault(name, r)
    return [
        (sum(r["tokens"] for r in by_peer.values()), min(r["eval_loss"] for r in by_peer.values()))
        for step, by_peer in sorted(steps.items())
        if len(by_peer) == len(records)
    ]


def loss_at(curve: list[tuple[int, float]], tokens: int) -> float | None:
    """The loss of ``curve`` at ``tokens``, interpolated linearly; None if the curve does not reach that far."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / max(1, t1 - t0)
    return None


def run(out_dir: Path, peers: int, fragments: int, rounds: int, flags: list[str]) -> dict:
    run_flags = [*flags, "--fragments", str(fragments), "--max-outer-steps", str(rounds * fragments)]
    report = run_to_end(out_dir, run_flags, [[] for _ in range(peers)], timeout_s=3600)
    records = report["records"]
    evaluated = [r for rs in records.values() for r in rs if r.get("eval_loss") is not None]
    last = max(r["outer_step"] for r in evaluated)
    ok = [r for rs in records.values() for r in rs if r["status"] == "ok" and r["group_size"] > 1]
    return dict(
        fragments=fragments,
        loss_by_swarm_tokens=loss_by_swarm_tokens(records),
        averagings_in_groups=len(ok),
        failed_averagings=sum(r["status"] in ("partial", "no_group", "error", "stale") for rs in records.values() for r in rs),
        bytes_sent_per_group_averaging=round(sum(r["bytes_sent"] for r in ok) / max(1, len(ok))),
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
    flags = ["--eval-every", "1", *flags]  # a held-out loss at every outer step: the curves compare settings
    if not any(f.startswith("--tokens-per-round") for f in flags):
        flags += ["--tokens-per-round", str(args.peers * 30 * 16 * 128)]
    out = Path(args.out)
    whole = run(out / "whole", args.peers, 1, args.rounds, flags)
    streamed = run(out / "streamed", args.peers, args.fragments, args.rounds, flags)
    peak_whole = max(whole["peak_send_bytes_per_s"].values())
    peak_streamed = max(streamed["peak_send_bytes_per_s"].values())
    # equal tokens: the streamed run's loss where its swarm had processed what the whole-model run had in all
    tokens = whole["loss_by_swarm_tokens"][-1][0]
    streamed_loss = loss_at(streamed["loss_by_swarm_tokens"], tokens)
    result = dict(
        command=" ".join(sys.argv),
        whole=whole,
        streamed=streamed,
        peak_reduction=round(peak_whole / peak_streamed, 2) if peak_streamed else None,
        total_bytes_ratio=round(sum(streamed["bytes_sent"].values()) / sum(whole["bytes_sent"].values()), 3),
        # bytes of one whole round: P fragment averagings against one whole-model averaging
        bytes_per_round_ratio=round(args.fragments * streamed["bytes_sent_per_group_averaging"] / whole["bytes_sent_per_group_averaging"], 3),
        equal_tokens=tokens,
        eval_loss_at_equal_tokens=dict(whole=whole["loss_by_swarm_tokens"][-1][1], streamed=streamed_loss),
        eval_loss_vs_whole=round(streamed_loss / whole["loss_by_swarm_tokens"][-1][1] - 1, 4) if streamed_loss else None,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_fragments.json").write_text(json.dumps(result, indent=1))
    losses = result["eval_loss_at_equal_tokens"]
    versus = f"{losses['streamed']:.4f} ({result['eval_loss_vs_whole']:+.2%})" if losses["streamed"] else "n/a (the streamed run fell short)"
    print(f"largest send burst: {peak_whole:,.0f} B/s whole vs {peak_streamed:,.0f} B/s in {args.fragments} fragments "
          f"({result['peak_reduction']}x lower); bytes per round ratio {result['bytes_per_round_ratio']}; "
          f"eval loss at {tokens:,} swarm tokens: whole {losses['whole']:.4f} vs streamed {versus}; "
          f"failed averagings {whole['failed_averagings']} / {streamed['failed_averagings']}; "
          f"invariant 1 {whole['invariant_1']['held']} / {streamed['invariant_1']['held']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
