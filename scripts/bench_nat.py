"""Peers behind home routers against the same swarm with every peer public (root: network namespaces).

    sudo .venv/bin/python scripts/bench_nat.py --out runs/nat --nat 2 3 --duration-s 240

Runs ``scripts/wan.py`` twice with the same peers, caps, model and seeds: once with the ``--nat`` peers each
behind its own router, once with all peers public; then writes ``nat.json`` and ``nat.md`` and prints the table:
group sizes of the averaged rounds, time per averaging, bytes on the wire per peer, tokens/s, held-out loss
and invariant 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from experiments.wan import wan_main  # noqa: E402


def summarise(report: dict, nat: list[int]) -> dict:
    rounds = [r for records in report["records"].values() for r in records if r.get("status") == "ok"]
    wire = {f"peer{link['peer']}": link for link in report.get("wan", [])}
    by_kind: dict[str, list[int]] = {"public": [], "behind NAT": []}
    for link in wire.values():
        by_kind["behind NAT" if link["peer"] in nat else "public"].append(link["wire_bytes_sent"] + link["wire_bytes_received"])
    steps = max((p["final_outer_step"] for p in report["peers"].values()), default=0)
    averaged = {r["outer_step"] for r in rounds if r["group_size"] >= 2}  # outer steps the swarm averaged together
    return dict(
        outer_steps=steps,
        group_sizes=sorted({r["group_size"] for r in rounds}),
        rounds_in_full_groups=sum(r["group_size"] == len(wire) for r in rounds),
        rounds=len(rounds),
        mean_averaging_s=round(statistics.mean(r["averaging_s"] for r in rounds), 2) if rounds else None,
        wire_mb_per_peer={kind: [round(b / 1e6, 1) for b in values] for kind, values in by_kind.items() if values},
        wire_mb_per_averaged_step=round(sum(sum(v) for v in by_kind.values()) / 1e6 / max(len(averaged), 1), 2),
        swarm_tokens_per_s=report["swarm_tokens_per_s"],
        final_eval_loss=report["final_eval_loss"],
        invariant_1=report["invariant_1"]["held"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/nat")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--nat", type=int, nargs="+", default=[2, 3], metavar="PEER")
    parser.add_argument("--duration-s", type=float, default=240.0)
    parser.add_argument("--bandwidth-mbit", type=float, default=20.0)
    parser.add_argument("--inner-steps", type=int, default=60)
    parser.add_argument("--only", choices=("nat", "public"),
                        help="run only this half; the other is read from the report an earlier run left in --out")
    args = parser.parse_args(argv)
    out = Path(args.out)
    results = {}
    for label, nat in (("behind NAT", args.nat), ("all public", [])):
        folder = out / ("nat" if nat else "public")
        if args.only and args.only != folder.name:
            results[label] = summarise(json.loads((folder / "report.json").read_text()), nat)
            continue
        start_at = time.time() + 40  # every peer starts training together, the NATed ones after finding their way
        flags = ["--peers", str(args.peers), "--bandwidth-mbit", str(args.bandwidth_mbit), "--out", str(folder),
                 "--prefix", "p2pnatb", "--max-time-s", str(args.duration_s), "--inner-steps", str(args.inner_steps),
                 "--start-at", str(start_at), *(["--nat", *map(str, nat)] if nat else [])]
        code = wan_main(flags, prog="bench_nat.py")
        if code != 0:
            return code
        results[label] = summarise(json.loads((folder / "report.json").read_text()), nat)
    rows = ["| | " + " | ".join(results) + " |", "| --- |" + " --- |" * len(results)]
    for key in next(iter(results.values())):
        rows.append(f"| {key} | " + " | ".join(str(r[key]) for r in results.values()) + " |")
    table = "\n".join(rows)
    (out / "nat.json").write_text(json.dumps(dict(settings=vars(args), results=results), indent=1))
    (out / "nat.md").write_text(table + "\n")
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
