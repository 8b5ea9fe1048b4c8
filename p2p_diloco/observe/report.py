"""Run reports: gather the peers' metrics files, check invariant 1, summarise, plot.

Reads JSON-lines metrics (one record per outer step per peer) and writes ``report.json`` and
``report.png``. It never talks to the swarm and never changes the metrics it reads.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

ROUND_STATUSES = ("ok", "partial", "no_group", "error", "stale")  # records of an averaging attempt (not init / catch-up)


def read_metrics(path: str | Path) -> list[dict]:
    """Records of one metrics file; a torn last line (a peer killed mid-write) is skipped."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def check_invariant_1(records_by_peer: dict[str, list[dict]]) -> dict[str, Any]:
    """Every peer that reports outer step r must report the same global_sha256 for it (docs/design.md §3, invariant 1).

    A peer may leave its bytes for a step only by a download: a ``fork_healed`` record at that step (it found
    that the swarm held other bytes for it), or a ``caught_up``/``fork_healed`` record next, which takes the swarm's
    state at another step instead of carrying those bytes on. Such steps count as healed forks. Any other
    disagreement, between peers' bytes that no download left or within one peer, is a fork and fails the check.
    """
    final: dict[int, dict[str, str]] = defaultdict(dict)  # step -> peer -> last sha
    forks: dict[int, set[str]] = defaultdict(set)
    healed: set[int] = set()
    left: set[tuple[str, int, str]] = set()  # (peer, step, sha) a peer left by downloading another state
    for peer, records in records_by_peer.items():
        last: tuple[int, str] | None = None
        for record in records:
            sha, step = record.get("global_sha256"), record.get("outer_step")
            if not sha or step is None:
                continue
            previous = final[step].get(peer)
            if previous is not None and previous != sha:
                if record.get("status") == "fork_healed":
                    healed.add(step)
                else:
                    forks[step].update((previous, sha))
            if record.get("status") in ("caught_up", "fork_healed") and last is not None and last != (step, sha):
                left.add((peer, *last))
            final[step][peer], last = sha, (step, sha)
    for step, by_peer in final.items():
        kept = {sha for peer, sha in by_peer.items() if (peer, step, sha) not in left}
        if len(kept) > 1:
            forks[step].update(by_peer.values())
        elif len(set(by_peer.values())) > 1:
            healed.add(step)
    several = sum(len(by_peer) > 1 for by_peer in final.values())
    return dict(
        # "not checked" when no outer step was reported by two peers: a peer alone agrees with itself
        status="VIOLATED" if forks else "held" if several else "not checked",
        held=not forks,  # no fork found (also when nothing could be compared: see status)
        outer_steps_checked=len(final),
        outer_steps_reported_by_several_peers=several,
        forks={str(step): sorted(found) for step, found in sorted(forks.items())},
        healed_forks=sorted(healed),
    )


def invariant_1_status(report: dict[str, Any]) -> str:
    """One line on invariant 1 for people: held (and over how many steps), VIOLATED, or not checked."""
    invariant = report["invariant_1"]
    status = invariant.get("status", "held" if invariant["held"] else "VIOLATED")
    if status == "not checked":
        return "not checked (no outer step was reported by two or more peers)"
    return f"{status} over {invariant['outer_steps_reported_by_several_peers']} outer steps reported by two or more peers"


def summarise_peer(records: list[dict]) -> dict[str, Any]:
    rounds = [r for r in records if r.get("status") in ROUND_STATUSES]
    evals = [r for r in records if r.get("eval_loss") is not None]
    last = records[-1] if records else {}
    busy = last.get("compute_s", 0.0) + last.get("blocked_s", 0.0)
    ok_rounds = [r for r in rounds if r.get("status") == "ok"]
    # how late each outer step reached the local params: the inner steps trained while its average was on the wire,
    # over the inner steps since the last record (about a round's); what docs/learning.md measures as the overlap
    lags = [r["steps_during_averaging"] / r["inner_steps"] for r in ok_rounds
            if r.get("inner_steps") and r.get("steps_during_averaging") is not None]
    return dict(
        peer_id=last.get("peer_id"),
        final_outer_step=last.get("outer_step"),
        rounds=len(rounds),
        ok_rounds=len(ok_rounds),
        failed_rounds=len(rounds) - len(ok_rounds),
        catch_ups=last.get("catch_ups", 0),
        forks_healed=last.get("forks_healed", 0),
        arithmetic_mismatches=last.get("arithmetic_mismatches", 0),  # own group's steps this peer computed otherwise
        group_sizes=sorted({r["group_size"] for r in ok_rounds}),
        tokens=last.get("tokens", 0),
        time_s=last.get("time_s", 0.0),
        tokens_per_s=last.get("tokens_per_s", 0.0),
        compute_s=last.get("compute_s", 0.0),
        blocked_s=last.get("blocked_s", 0.0),
        blocked_fraction=round(last.get("blocked_s", 0.0) / busy, 4) if busy else None,
        outer_step_lag=round(statistics.median(lags), 4) if lags else None,  # median share of a round
        initial_eval_loss=evals[0]["eval_loss"] if evals else None,
        final_eval_loss=evals[-1]["eval_loss"] if evals else None,
        mean_group_size=round(sum(r["group_size"] for r in ok_rounds) / len(ok_rounds), 2) if ok_rounds else None,
        bytes_sent_per_round=round(sum(r["bytes_sent"] for r in ok_rounds) / len(ok_rounds)) if ok_rounds else None,
        bytes_received_per_round=round(sum(r["bytes_received"] for r in ok_rounds) / len(ok_rounds)) if ok_rounds else None,
        bytes_sent=sum(r.get("bytes_sent", 0) for r in rounds),
        bytes_received=sum(r.get("bytes_received", 0) for r in rounds),
    )


def build_report(metrics_files: dict[str, Path], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    records_by_peer = {name: read_metrics(path) for name, path in metrics_files.items() if Path(path).exists()}
    peers = {name: summarise_peer(records) for name, records in records_by_peer.items() if records}
    finals = [p["final_eval_loss"] for p in peers.values() if p["final_eval_loss"] is not None]
    initials = [p["initial_eval_loss"] for p in peers.values() if p["initial_eval_loss"] is not None]
    return dict(
        **(extra or {}),
        invariant_1=check_invariant_1(records_by_peer),
        initial_eval_loss=min(initials) if initials else None,
        final_eval_loss=min(finals) if finals else None,
        swarm_tokens=sum(p["tokens"] for p in peers.values()),
        swarm_tokens_per_s=round(sum(p["tokens_per_s"] for p in peers.values()), 1),
        peers=peers,
        records={name: records for name, records in records_by_peer.items()},
    )


def plot_report(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_time, by_tokens) = plt.subplots(1, 2, figsize=(13, 4.8))
    for index, (name, records) in enumerate(sorted(report["records"].items())):
        color = f"C{index % 10}"
        trained = [r for r in records if r.get("loss") is not None]
        evaluated = [r for r in records if r.get("eval_loss") is not None]
        for axis, key in ((by_time, "time_s"), (by_tokens, "tokens")):
            axis.plot([r[key] for r in trained], [r["loss"] for r in trained], color=color, alpha=0.45, lw=1)
            axis.plot([r[key] for r in evaluated], [r["eval_loss"] for r in evaluated], color=color, marker=".", lw=1.6,
                      label=f"{name} eval (solid) / train (faint)")
    by_time.set_xlabel("wall time (s)")
    by_tokens.set_xlabel("tokens processed by the peer")
    for axis in (by_time, by_tokens):
        axis.set_ylabel("loss (nats per byte)")
        axis.grid(alpha=0.3)
    by_time.legend(fontsize=8)
    invariant = report["invariant_1"].get("status", "held" if report["invariant_1"]["held"] else "VIOLATED")
    losses = " -> ".join(f"{v:.3f}" for v in (report["initial_eval_loss"], report["final_eval_loss"]) if v is not None)
    figure.suptitle(f"p2p-diloco local swarm: eval loss {losses}; invariant 1 (identical global params) {invariant}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def split_lives(records: list[dict]) -> list[list[dict]]:
    """One list of records per process lifetime: each start writes an ``init`` record first."""
    lives: list[list[dict]] = []
    for record in records:
        if record.get("status") == "init" or not lives:
            lives.append([])
        lives[-1].append(record)
    return lives
