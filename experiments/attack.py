"""Attacks on a local swarm (``scripts/attack.py``): honest peers beside one adversary of each kind, each run
against a calm run of the same honest swarm (docs/design.md §3, invariant 5, and §7).

Every scenario runs the same honest swarm: ``honest0`` and ``honest1`` from the start, ``honest2`` beginning
``LATE_START_S`` later (so it downloads the state, which the wrong-donor attack targets), all stopping at the same
outer step. The adversaries are real peers started by ``experiments/adversary_peer.py --adversary KIND``
(adversary.py); the stranger of ``non_member`` is an honest peer without the swarm key of a closed run, that of
``non_member_allow_list`` an honest peer whose own key is not on a closed run's allow-list (it signs its records
and lists the members' keys too, so it accepts theirs: the strongest stranger).

Every peer runs at the defaults (``DEFAULT_FLAGS`` set only the model's size and the rounds' length), with ``--seed``
per run: each scenario runs once per seed, paired with the calm run of that seed, and ``--peer-flags`` adds a second
column of every run with more flags (e.g. ``--no-cross-check``). A calm run also starts a *bystander*: an honest peer
of another run, training alone on the adversary's shard until the scenario ends, so that every run has four
training processes on the same cores (an adversary trains too, and takes CPU time from the honest peers).

Per scenario, from the peers' own metrics, logs and final checkpoints:

- the honest peers' held-out loss at the last outer step, and at equal honest tokens (both curves interpolated at the
  fewer tokens either run reached), each against its paired calm run, with both runs' outer steps and honest tokens:
  rounds end on a token budget learned from progress records, so how many tokens an outer step holds varies, and
  a run whose honest peers were made to skip training can look fine at equal tokens alone;
- whether any honest global parameter (final checkpoint) or eval loss is non-finite;
- invariant 1 among the honest peers;
- delay: how much later the honest peers finished than in the calm run, and their failed rounds;
- whether the adversary is named in an honest peer's metrics (``rejected_peers``) or, for the stranger, refused
  in an honest peer's log and never in an honest group.

This module starts and stops processes (through p2p_diloco/cli/peer_processes.py) and reads what they wrote; it holds no training logic.
"""

from __future__ import annotations

import json
import math
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from experiments.adversary_peer import PATH as ADVERSARY_PEER
from p2p_diloco.cli.peer_processes import LocalSwarm, wait_for_address
from p2p_diloco.core import checkpoint
from p2p_diloco.observe.report import check_invariant_1, read_metrics

SCENARIOS = ("calm", "nan", "scaled", "weight", "garbage_reducer", "wrong_donor", "non_member", "non_member_allow_list",
             "ahead", "scaled_under", "weight_under", "reducer_under", "colluders", "round_ahead")
COLLUDING = {"colluders": "colluder"}  # scenarios of two adversaries (a swarm of five), and their --adversary kind
STRANGERS = ("non_member", "non_member_allow_list")
HONEST = ("honest0", "honest1", "honest2")
BYSTANDER_OUTER_STEPS = 1_000_000  # it trains until the scenario stops it with the others
LATE_START_S = 8.0  # honest2 begins this much after the others, when the swarm is a few outer steps ahead
DEFAULT_FLAGS = [
    "--eval-every", "1", "--n-layers", "2", "--d-model", "64", "--n-heads", "2", "--seq-len", "64", "--batch-size", "8",
    "--inner-steps", "80", "--matchmaking-time-s", "3", "--averaging-timeout-s", "30", "--chunk-timeout-s", "4",
    "--state-timeout-s", "30", "--compression", "int8", "--progress-period-s", "1", "--progress-idle-period-s", "1", "--checkpoint-every", "100",
]
# Rounds of 80 inner steps last about 7 s here, several progress periods: with 20 inner steps and a 2 s period
# (the flags before) a round was shorter than the averaging and than a period, its end was decided by stale
# records, and the tokens behind one peer's outer step ranged 8k-31k within a run; the loss at a given outer
# step then depended on those timings more than on the attack.


def run_scenario(name: str, out_dir: Path, flags: list[str], outer_steps: int, timeout_s: float,
                 run: str | None = None) -> dict[str, Any]:
    """Run one scenario in ``out_dir/run`` (default: its name) and return its figures (``analyse``)."""
    run = run or name
    folder = out_dir / run
    shutil.rmtree(folder, ignore_errors=True)  # a retried scenario starts clean (its peers must not resume)
    folder.mkdir(parents=True)
    # the first peer starts the swarm, the others join through it; all begin training together (a busy machine
    # takes tens of seconds to start a peer)
    start_at = time.time() + 90
    common = [*flags, "--run-id", f"attack-{run}", "--max-outer-steps", str(outer_steps)]
    closed = {peer: [] for peer in (*HONEST, "adversary")}
    if name == "non_member":
        key_file = folder / "swarm.key"
        key_file.write_text(secrets.token_hex(32))
        closed.update({peer: ["--swarm-key-file", str(key_file)] for peer in HONEST})  # the adversary has none
    elif name == "non_member_allow_list":
        closed = _allow_list_flags(folder)
    swarm = LocalSwarm(folder, common)
    started = time.monotonic()
    try:
        for index, peer in enumerate(HONEST):  # honest2 begins LATE_START_S after the others: it downloads the state
            begin = ["--start-at", f"{start_at + (LATE_START_S if peer == 'honest2' else 0):.1f}"]
            swarm.start(peer, shard=index, num_shards=4, extra=[*closed[peer], *begin, *_own_checkpoints(folder, peer)])
        begin = ["--start-at", f"{start_at:.1f}"]
        if name == "calm":  # the 2 cores shared by as many training processes as in an attack (see the docstring)
            swarm.start("bystander", shard=3, num_shards=4, extra=[
                *begin, "--run-id", f"attack-{run}-bystander", "--max-outer-steps", str(BYSTANDER_OUTER_STEPS)])
        elif name in STRANGERS:
            swarm.start("adversary", shard=3, num_shards=4, extra=[*closed["adversary"], *begin])
        elif name in COLLUDING:  # two of them, on the fourth shard: three honest peers among five
            for peer in ("adversary", "adversary2"):
                swarm.start(peer, shard=3, num_shards=4, extra=begin, entry=[ADVERSARY_PEER, "--adversary", COLLUDING[name]])
        else:
            swarm.start("adversary", shard=3, num_shards=4, extra=begin, entry=[ADVERSARY_PEER, "--adversary", name])
        for peer in swarm.peers.values():
            wait_for_address(peer)
        swarm.wait_until(lambda: not any(swarm.peers[p].alive for p in HONEST), timeout_s, "the honest peers to finish")
    finally:
        swarm.stop_all()
    return analyse(name, folder, swarm.all_records(), time.monotonic() - started)


def _allow_list_flags(folder: Path) -> dict[str, list[str]]:
    """Each peer's identity; the members' list holds the honest peers' keys, the stranger's list theirs and its own."""
    from p2p_diloco.swarm.membership import load_identity

    identities = {peer: load_identity(folder / f"{peer}.key") for peer in (*HONEST, "adversary")}
    members = "".join(f"{identities[peer].public_key}  # {peer}\n" for peer in HONEST)
    (folder / "members.txt").write_text(members)
    (folder / "stranger.txt").write_text(members + f"{identities['adversary'].public_key}  # adversary\n")
    return {
        peer: ["--identity", str(folder / f"{peer}.key"),
               "--allow-list", str(folder / ("stranger.txt" if peer == "adversary" else "members.txt"))]
        for peer in identities
    }


def _own_checkpoints(folder: Path, peer: str) -> list[str]:
    return ["--checkpoint-dir", str(folder / "checkpoints" / peer)]


def analyse(name: str, folder: Path, records: dict[str, list[dict]], wall_s: float) -> dict[str, Any]:
    honest = {peer: records.get(peer, []) for peer in HONEST}
    adversary_ids = [recs[0]["peer_id"] for peer, recs in sorted(records.items()) if peer.startswith("adversary") and recs]
    adversary_id = adversary_ids[0] if adversary_ids else None
    final_step, final_loss = _final_eval(honest)
    named_in = [
        peer for peer, recs in honest.items()
        if any(item.get("peer") in adversary_ids for r in recs for item in r.get("rejected_peers", []))
    ]
    logged = [peer for peer in HONEST if any(_log_names(folder / f"{peer}.log", a) for a in adversary_ids)]
    in_honest_group = any(a in r.get("peers", []) for a in adversary_ids for recs in honest.values() for r in recs
                          if r["status"] == "ok")
    return dict(
        scenario=name,
        wall_s=round(wall_s, 1),
        adversary_id=adversary_id,
        final_outer_step=final_step,
        final_eval_loss=final_loss,
        honest_non_finite=_non_finite(folder, honest),
        invariant_1=check_invariant_1(honest),
        attacker_chosen_states=attacker_chosen_states(honest),
        honest_finish_s=max((recs[-1]["time_s"] for recs in honest.values() if recs), default=None),
        honest_blocked_s=round(sum(recs[-1]["blocked_s"] for recs in honest.values() if recs), 2),
        honest_failed_rounds=sum(r["status"] in ("partial", "error", "no_group") for recs in honest.values() for r in recs),
        # a round abandoned because the swarm moved past it (a peer that caught up chasing the others): its progress
        # flows into a later round, as a failed round's does
        honest_stale_rounds=sum(r["status"] == "stale" for recs in honest.values() for r in recs),
        honest_tokens=sum(recs[-1].get("tokens", 0) for recs in honest.values() if recs),
        eval_curve=eval_curve(honest),
        adversary_named_in_metrics_by=named_in,
        adversary_refused_in_logs_of=logged,
        adversary_in_honest_group=in_honest_group,
    )


def attacker_chosen_states(honest: dict[str, list[dict]]) -> list[str]:
    """The states (sha256) an honest peer held that no honest peer computed: neither an honest start nor the result
    of an honest peer's averaging (a group may hold an adversary: its influence there is the robust averaging's to
    bound). Any such state came by download from a state an adversary chose."""
    computed = {r["global_sha256"] for recs in honest.values() for r in recs if r.get("status") in ("ok", "init")}
    held = {r["global_sha256"] for recs in honest.values() for r in recs if r.get("global_sha256")}
    return sorted(held - computed)


def _final_eval(honest: dict[str, list[dict]]) -> tuple[int | None, float | None]:
    evaluated = [r for recs in honest.values() for r in recs if r.get("eval_loss") is not None]
    if not evaluated:
        return None, None
    last = max(evaluated, key=lambda r: (r["outer_step"], r["time_s"]))
    return last["outer_step"], last["eval_loss"]


def eval_curve(honest: dict[str, list[dict]]) -> list[tuple[int, float, int]]:
    """(outer step, held-out loss, honest tokens so far) for each outer step the honest peers evaluated, in
    order; the tokens are the sum over honest peers of each one's count in its latest record at that moment."""
    timeline = sorted((r["unix_time"], peer, r.get("tokens", 0)) for peer, recs in honest.items() for r in recs)
    evaluations = sorted(
        (r["unix_time"], r["outer_step"], r["eval_loss"]) for recs in honest.values() for r in recs
        if r.get("eval_loss") is not None and r.get("status") == "ok"
    )
    curve, latest, position, seen = [], {}, 0, set()
    for when, step, loss in evaluations:
        while position < len(timeline) and timeline[position][0] <= when:
            latest[timeline[position][1]] = timeline[position][2]
            position += 1
        if step not in seen:  # every honest peer holds the same params at a step (invariant 1): the first says it
            seen.add(step)
            curve.append((step, loss, sum(latest.values())))
    return curve


def loss_interpolated(curve: list[tuple[int, float, int]], tokens: int) -> float | None:
    """The held-out loss at exactly ``tokens`` honest tokens, linear in tokens between the two evaluations around
    them (None outside the curve): the last evaluation at or under them would compare two runs up to an outer step
    apart, a step's progress (2-3% of the loss in mid-run) of noise from the grid alone."""
    points = sorted((seen, loss) for _, loss, seen in curve)
    for (seen_a, loss_a), (seen_b, loss_b) in zip(points, points[1:]):
        if seen_a <= tokens <= seen_b:
            return loss_a if seen_b == seen_a else loss_a + (loss_b - loss_a) * (tokens - seen_a) / (seen_b - seen_a)
    return points[0][1] if len(points) == 1 and points[0][0] == tokens else None


def _non_finite(folder: Path, honest: dict[str, list[dict]]) -> bool:
    """Any non-finite eval loss, or any non-finite global param or momentum in an honest peer's last checkpoint."""
    if any(r.get("eval_loss") is not None and not math.isfinite(r["eval_loss"]) for recs in honest.values() for r in recs):
        return True
    for peer in HONEST:
        files = sorted((folder / "checkpoints" / peer).glob("*.pt"))
        if not files:
            continue
        try:
            state = checkpoint.load(files[-1])
        except ValueError:  # the loader refuses non-finite tensors too
            return True
        if any(not torch.isfinite(t).all() for t in [*state["global_params"], *state["momentum"]]):
            return True
    return False


def _log_names(path: Path, peer_id: str) -> bool:
    """Whether an honest peer's log refuses, ignores or bans ``peer_id`` (its claims, its state, its requests)."""
    words = ("refused", "claimed by", "banning", "donor")
    return path.exists() and any(peer_id in line and any(word in line for word in words)
                                 for line in path.read_text(errors="replace").splitlines())


def compare(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's row of the table, against the calm run of the same seed and peer flags (its pair): the held-out loss
    at the last outer step, and at equal honest tokens (both curves interpolated at the fewer tokens either reached),
    with the outer steps and honest tokens of both, since a run whose honest peers were made to skip training can look
    fine at equal tokens alone. A calm run's own row compares it with the calm run of the next seed: the noise."""
    calms = {(r.get("seed"), r.get("column", "")): r for r in results if r["scenario"] == "calm"}
    seeds = sorted({key[0] for key in calms if key[0] is not None})
    rows = []
    for result in results:
        key = (result.get("seed"), result.get("column", ""))
        pair = calms.get(key)
        if result["scenario"] == "calm" and len(seeds) > 1 and key[0] in seeds:  # against the next seed's calm run
            pair = calms.get((seeds[(seeds.index(key[0]) + 1) % len(seeds)], key[1]))
        rows.append(_row(result, pair))
    return rows


def _row(result: dict[str, Any], pair: dict[str, Any] | None) -> dict[str, Any]:
    loss, base = result["final_eval_loss"], (pair or {}).get("final_eval_loss")
    curve = [tuple(point) for point in result.get("eval_curve", [])]
    pair_curve = [tuple(point) for point in (pair or {}).get("eval_curve", [])]
    equal = min(max(point[2] for point in curve), max(point[2] for point in pair_curve)) if curve and pair_curve else 0
    at_equal, pair_at_equal = loss_interpolated(curve, equal), loss_interpolated(pair_curve, equal)
    named = bool(result["adversary_named_in_metrics_by"] or result["adversary_refused_in_logs_of"]) or (
        result["scenario"] in STRANGERS and not result["adversary_in_honest_group"]
    )
    return dict(
        scenario=result["scenario"],
        run=result.get("run", result["scenario"]),
        seed=result.get("seed"),
        column=result.get("column", ""),
        paired_with=(pair or {}).get("run"),
        final_outer_step=result["final_outer_step"],
        paired_final_outer_step=(pair or {}).get("final_outer_step"),
        eval_loss=loss,
        paired_eval_loss=base,
        vs_paired_at_last_step=round((loss - base) / base, 4) if loss is not None and base else None,
        honest_tokens=result.get("honest_tokens"),
        paired_honest_tokens=(pair or {}).get("honest_tokens"),
        equal_tokens=equal,
        eval_loss_at_equal_tokens=at_equal,
        vs_paired_at_equal_tokens=round((at_equal - pair_at_equal) / pair_at_equal, 4)
        if at_equal is not None and pair_at_equal else None,
        honest_non_finite=result["honest_non_finite"],
        attacker_chosen_states=len(result.get("attacker_chosen_states", [])),
        invariant_1=result["invariant_1"]["held"],
        delay_s=round(result["honest_finish_s"] - pair["honest_finish_s"], 1)
        if pair and result["honest_finish_s"] is not None and pair.get("honest_finish_s") is not None else None,
        honest_failed_rounds=result["honest_failed_rounds"],
        honest_stale_rounds=result.get("honest_stale_rounds"),
        adversary_named=None if result["scenario"] == "calm" else named,
        named_by=result["adversary_named_in_metrics_by"] or result["adversary_refused_in_logs_of"],
    )


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per scenario and peer flags over its seeds: the median and range of each paired change, and the
    counts that must be zero (attacker-chosen states, invariant 1 broken, non-finite) or all (adversary named)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["scenario"], row["column"]), []).append(row)
    summary = []
    for (scenario, column), group in groups.items():
        line: dict[str, Any] = dict(scenario=scenario, column=column, seeds=len(group))
        for field in ("vs_paired_at_last_step", "vs_paired_at_equal_tokens"):
            values = sorted(row[field] for row in group if row[field] is not None)
            line[field] = dict(median=values[len(values) // 2] if len(values) % 2 else
                               (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2,
                               min=values[0], max=values[-1]) if values else None
        line["honest_tokens_vs_paired"] = [round(row["honest_tokens"] / row["paired_honest_tokens"], 3)
                                           for row in group if row["honest_tokens"] and row["paired_honest_tokens"]]
        line["attacker_chosen_states"] = sum(row["attacker_chosen_states"] for row in group)
        line["invariant_1_broken"] = sum(not row["invariant_1"] for row in group)
        line["honest_non_finite"] = sum(bool(row["honest_non_finite"]) for row in group)
        named = sum(bool(row["adversary_named"]) for row in group)
        line["named"] = None if scenario == "calm" else f"{named}/{len(group)}"
        summary.append(line)
    return summary


def _run_with_retries(name: str, run: str, out_dir: Path, flags: list[str], args: Any, prog: str) -> dict[str, Any]:
    """One scenario; on a machine this busy a peer sometimes misses its bootstrap window, so try again."""
    for attempt in range(args.retries + 1):
        print(f"running {run} ...", flush=True)
        try:
            return {**run_scenario(name, out_dir, flags, args.outer_steps, args.timeout_s, run), "run": run}
        except RuntimeError as e:
            print(f"{prog}: {run} failed (attempt {attempt + 1}): {str(e).splitlines()[0][:300]}", flush=True)
            error = str(e)[:2000]
            # the next attempt starts from an empty folder: keep this one's logs and records beside it
            kept = out_dir / f"{run}.attempt{attempt + 1}"
            shutil.rmtree(kept, ignore_errors=True)
            if (out_dir / run).exists():
                (out_dir / run).rename(kept)
                print(f"{prog}: its logs and records are in {kept}", flush=True)
    return dict(scenario=name, run=run, error=error)


def _percent(value: float | None) -> str:
    return f"{100 * value:+.2f}%" if value is not None else "-"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The summary over seeds, then one line per run against its paired calm run."""
    lines = ["| attack | peer flags | seeds | vs paired calm at the last outer step: median (range) | at equal honest "
             "tokens: median (range) | honest tokens / paired calm's | attacker-chosen states held "
             "| invariant 1 broken | adversary named |", "|" + "---|" * 9]
    for line in summarise(rows):
        cells = []
        for field in ("vs_paired_at_last_step", "vs_paired_at_equal_tokens"):
            figure = line[field]
            cells.append(f"{_percent(figure['median'])} ({_percent(figure['min'])} ... {_percent(figure['max'])})"
                         if figure else "-")
        ratios = ", ".join(f"{ratio:.2f}" for ratio in line["honest_tokens_vs_paired"]) or "-"
        lines.append(f"| {line['scenario']} | {line['column'] or 'defaults'} | {line['seeds']} | {cells[0]} "
                     f"| {cells[1]} | {ratios} | {line['attacker_chosen_states']} | {line['invariant_1_broken']} "
                     f"| {line['named'] or '-'} |")
    lines += ["", "| run | paired with | outer steps (paired) | eval loss (paired) | vs paired "
              "| honest tokens (paired) "
              "| vs paired at equal honest tokens | honest non-finite | attacker-chosen states held | invariant 1 "
              "| delay (s) | failed honest rounds | stale honest rounds | adversary named |", "|" + "---|" * 14]
    for row in rows:
        loss = f"{row['eval_loss']:.4f}" if row["eval_loss"] is not None else "-"
        paired = f"{row['paired_eval_loss']:.4f}" if row["paired_eval_loss"] is not None else "-"
        named = "-" if row["adversary_named"] is None else ("yes" if row["adversary_named"] else "NO")
        tokens = (f"{row['honest_tokens']:,} ({row['paired_honest_tokens']:,})"
                  if row.get("honest_tokens") and row.get("paired_honest_tokens") else "-")
        lines.append(
            f"| {row['run']} | {row['paired_with'] or '-'} "
            f"| {row['final_outer_step']} ({row['paired_final_outer_step']}) "
            f"| {loss} ({paired}) | {_percent(row['vs_paired_at_last_step'])} | {tokens} "
            f"| {_percent(row['vs_paired_at_equal_tokens'])} | {row['honest_non_finite']} "
            f"| {row['attacker_chosen_states']} "
            f"| {'held' if row['invariant_1'] else 'VIOLATED'} | {row['delay_s']} | {row['honest_failed_rounds']} "
            f"| {row.get('honest_stale_rounds', '-')} | {named} |"
        )
    return "\n".join(lines) + "\n"


def plan(scenarios: list[str], seeds: list[int],
         columns: list[tuple[str, list[str]]]) -> list[tuple[str, str, int, str, list[str]]]:
    """The runs, in order: per seed and peer flags, the calm run first, then each scenario with that seed (so that
    each pair runs close in time); (scenario, run name, seed, column, column's flags)."""
    runs = []
    for seed in seeds:
        for index, (column, column_flags) in enumerate(columns):
            suffix = f"-s{seed}" + (f"-f{index}" if index else "")
            for name in ["calm", *(name for name in scenarios if name != "calm")]:
                runs.append((name, f"{name}{suffix}", seed, column, column_flags))
    return runs


def main(argv: list[str] | None = None, prog: str = "attack.py") -> int:
    import argparse
    import shlex

    parser = argparse.ArgumentParser(prog=prog, description="Attack a local swarm at the peer's defaults: honest peers "
                                     "plus one adversary of each kind, each paired with a calm run of the same seed; "
                                     "writes OUT/attack.json and OUT/attack.md.")
    parser.add_argument("--out", default="runs/attack", help="output folder (default runs/attack)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), help="which to run (calm always runs)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="seeds (--seed of every peer); each "
                        "scenario runs once per seed, paired with a calm run of that seed (default 0 1)")
    parser.add_argument("--peer-flags", default=None, metavar="FLAGS", help="a second column: every run again with "
                        "these peer flags added, e.g. --peer-flags='--no-cross-check'")
    parser.add_argument("--outer-steps", type=int, default=12, help="outer steps every honest peer trains (default 12)")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="bound on one scenario (default 240)")
    parser.add_argument("--retries", type=int, default=1, help="run a scenario again if a peer failed to start (default 1)")
    parser.add_argument("--reanalyse", action="store_true", help="run nothing: analyse again the runs OUT/attack.json "
                        "lists, from the metrics and logs in their folders, and rewrite the table")
    args, peer_flags = parser.parse_known_args(argv)
    out_dir = Path(args.out)
    if args.reanalyse:
        return _reanalyse(out_dir, prog)
    try:
        extra = shlex.split(args.peer_flags) if args.peer_flags else None
    except ValueError as e:
        parser.error(f"--peer-flags: {e}")
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = [*DEFAULT_FLAGS, *peer_flags]
    columns = [("", []), *([(args.peer_flags, extra)] if extra else [])]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that every scenario's peers are stopped
    results, runs = [], plan(args.scenarios, args.seeds, columns)
    for name, run, seed, column, column_flags in runs:
        result = _run_with_retries(name, run, out_dir, [*flags, "--seed", str(seed), *column_flags], args, prog)
        results.append({**result, "seed": seed, "column": column})
        _write(out_dir, dict(flags=flags, outer_steps=args.outer_steps, runs=len(runs)), results)  # each run, kept
    rows = _write(out_dir, dict(flags=flags, outer_steps=args.outer_steps, runs=len(runs)), results)
    print(markdown_table(rows), flush=True)
    return 0 if all("error" not in r for r in results) else 1


def _write(out_dir: Path, settings: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    complete = [r for r in results if "error" not in r]
    rows = compare(complete)
    saved = dict(settings, rows=rows, summary=summarise(rows), results=results)
    (out_dir / "attack.json").write_text(json.dumps(saved, indent=1))
    (out_dir / "attack.md").write_text(markdown_table(rows))
    return rows


def _reanalyse(out_dir: Path, prog: str) -> int:
    try:
        saved = json.loads((out_dir / "attack.json").read_text())
        runs = [(r["scenario"], r.get("run", r["scenario"]), r["wall_s"], r.get("seed"), r.get("column", ""))
                for r in saved["results"] if "error" not in r]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{prog}: cannot read {out_dir / 'attack.json'}: {e}", file=sys.stderr)
        return 2
    results = []
    for name, run, wall_s, seed, column in runs:
        folder = out_dir / run
        records = {path.stem: read_metrics(path) for path in sorted(folder.glob("*.jsonl"))}
        results.append({**analyse(name, folder, records, wall_s), "run": run, "seed": seed, "column": column})
    settings = {key: value for key, value in saved.items() if key not in ("rows", "summary", "results")}
    rows = _write(out_dir, settings, results)
    print(markdown_table(rows), flush=True)
    return 0
