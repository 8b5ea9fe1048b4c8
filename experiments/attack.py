"""Attacks on a local swarm (``scripts/attack.py``): honest peers beside one adversary of each kind, each run
against a calm run of the same honest swarm (docs/design.md §3, invariant 5, and §7).

Every scenario runs the same honest swarm: ``honest0`` and ``honest1`` from the start, ``honest2`` beginning
``LATE_START_S`` later (so it downloads the state, which the wrong-donor attack targets), all stopping at the same
outer step. The adversaries are real peers started by ``experiments/adversary_peer.py --adversary KIND``
(adversary.py); the stranger of ``non_member`` is an honest peer without the swarm key of a closed run, that of
``non_member_allow_list`` an honest peer whose own key is not on a closed run's allow-list (it signs its records
and lists the members' keys too, so it accepts theirs: the strongest stranger).

The calm run is repeated (``--calm-runs``): the spread between calm runs is the noise of the measure, and each
attack is compared with their mean. A calm run also starts a *bystander*: an honest peer of another run, training
alone on the adversary's shard until the scenario ends, so that every run has four training processes on the
same cores: an adversary trains too (all of them do) and takes CPU time from the honest peers, which a calm run
of three processes would not share. (It did not close the gap in honest tokens per outer step seen with the
earlier rounds of 20 inner steps, 4-13% fewer beside a NaN or x1e4 sender; with the rounds of DEFAULT_FLAGS
the NaN and x1e4 runs trained +3% and -3% against the calm runs' mean.)

Per scenario, from the peers' own metrics, logs and final checkpoints:

- final eval loss of the honest peers' global params, and its change vs the calm run; and the change at equal
  honest tokens (the tokens the honest peers trained together, up to the shortest run's total): rounds end on
  a token budget learned from progress records a period old, so how many tokens an outer step holds varies
  from run to run;
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


def loss_at_tokens(curve: list[tuple[int, float, int]], tokens: int) -> tuple[int, float] | None:
    """The outer step and loss of the last evaluation made when the honest peers had trained at most ``tokens``."""
    within = [(step, loss) for step, loss, seen in curve if seen <= tokens]
    return max(within) if within else None


def loss_interpolated(curve: list[tuple[int, float, int]], tokens: int) -> float | None:
    """The held-out loss at exactly ``tokens`` honest tokens, linear in tokens between the two evaluations around
    them (None outside the curve). ``loss_at_tokens`` takes the last evaluation at or under them, so two runs compare
    up to an outer step apart, a step's progress (2-3% of the loss in mid-run) of noise from the grid alone."""
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
    """Each scenario's row of the table, against the mean of the calm runs (a calm run's own row shows how far
    it lies from that mean: the noise of the measure)."""
    calms = [r for r in results if r["scenario"] == "calm"]
    losses = [r["final_eval_loss"] for r in calms if r["final_eval_loss"] is not None]
    finishes = [r["honest_finish_s"] for r in calms if r["honest_finish_s"] is not None]
    base = sum(losses) / len(losses) if losses else None
    base_finish = sum(finishes) / len(finishes) if finishes else None
    # equal honest tokens: every run at the shortest run's total, against the calm runs' mean there
    totals = [r["honest_tokens"] for r in results if r.get("honest_tokens")]
    equal = min(totals) if totals else 0
    at_equal = {id(r): loss_at_tokens([tuple(point) for point in r.get("eval_curve", [])], equal) for r in results}
    calm_at_equal = [at_equal[id(r)][1] for r in calms if at_equal[id(r)] is not None]
    base_equal = sum(calm_at_equal) / len(calm_at_equal) if calm_at_equal else None
    # interpolated: at the fewest honest tokens any run had evaluated at (a run's last records come after its last
    # evaluation, so its total can lie past its curve)
    reached = [max(point[2] for point in r["eval_curve"]) for r in results if r.get("eval_curve")]
    equal_between = min(reached) if reached else 0
    between = {id(r): loss_interpolated([tuple(point) for point in r.get("eval_curve", [])], equal_between)
               for r in results}
    calm_between = [between[id(r)] for r in calms if between[id(r)] is not None]
    base_between = sum(calm_between) / len(calm_between) if calm_between else None
    rows = []
    for result in results:
        loss = result["final_eval_loss"]
        change = (loss - base) / base if loss is not None and base else None
        named = bool(result["adversary_named_in_metrics_by"] or result["adversary_refused_in_logs_of"]) or (
            result["scenario"] in STRANGERS and not result["adversary_in_honest_group"]
        )
        point = at_equal[id(result)]
        rows.append(dict(
            scenario=result["scenario"],
            run=result.get("run", result["scenario"]),
            final_outer_step=result["final_outer_step"],
            eval_loss=loss,
            eval_loss_vs_calm=round(change, 4) if change is not None else None,
            honest_tokens=result.get("honest_tokens"),
            equal_tokens=equal,
            outer_step_at_equal_tokens=point[0] if point else None,
            eval_loss_at_equal_tokens=point[1] if point else None,
            vs_calm_at_equal_tokens=round((point[1] - base_equal) / base_equal, 4) if point and base_equal else None,
            interpolated_tokens=equal_between,
            eval_loss_interpolated=between[id(result)],
            vs_calm_interpolated=round((between[id(result)] - base_between) / base_between, 4)
            if between[id(result)] is not None and base_between else None,
            honest_non_finite=result["honest_non_finite"],
            attacker_chosen_states=len(result.get("attacker_chosen_states", [])),
            invariant_1=result["invariant_1"]["held"],
            delay_s=round(result["honest_finish_s"] - base_finish, 1)
            if result["honest_finish_s"] is not None and base_finish is not None else None,
            honest_failed_rounds=result["honest_failed_rounds"],
            honest_stale_rounds=result.get("honest_stale_rounds"),
            adversary_named=None if result["scenario"] == "calm" else named,
            named_by=result["adversary_named_in_metrics_by"] or result["adversary_refused_in_logs_of"],
        ))
    return rows


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


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ("| attack | outer steps | eval loss | vs calm | honest tokens | vs calm at equal honest tokens (step) "
            "| the same, interpolated | honest non-finite | states an attacker chose, held by honest peers | invariant 1 | delay (s) "
            "| failed honest rounds | stale honest rounds | adversary named |")
    lines = [head, "|" + "---|" * 14]
    for row in rows:
        change = f"{100 * row['eval_loss_vs_calm']:+.2f}%" if row["eval_loss_vs_calm"] is not None else "-"
        loss = f"{row['eval_loss']:.4f}" if row["eval_loss"] is not None else "-"
        named = "-" if row["adversary_named"] is None else ("yes" if row["adversary_named"] else "NO")
        tokens = f"{row['honest_tokens']:,}" if row.get("honest_tokens") else "-"
        equal = row.get("vs_calm_at_equal_tokens")
        equal = f"{100 * equal:+.2f}% ({row['outer_step_at_equal_tokens']})" if equal is not None else "-"
        between = row.get("vs_calm_interpolated")
        between = f"{100 * between:+.2f}%" if between is not None else "-"
        lines.append(
            f"| {row['run']} | {row['final_outer_step']} | {loss} | {change} | {tokens} | {equal} | {between} | {row['honest_non_finite']} | "
            f"{row.get('attacker_chosen_states', '-')} | {'held' if row['invariant_1'] else 'VIOLATED'} | {row['delay_s']} | {row['honest_failed_rounds']} | "
            f"{row.get('honest_stale_rounds', '-')} | {named} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, prog: str = "attack.py") -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description="Attack a local swarm: honest peers plus one adversary "
                                     "of each kind, each against a calm run; writes OUT/attack.json and OUT/attack.md.")
    parser.add_argument("--out", default="runs/attack", help="output folder (default runs/attack)")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), help="which to run (calm always runs)")
    parser.add_argument("--outer-steps", type=int, default=12, help="outer steps every honest peer trains (default 12)")
    parser.add_argument("--timeout-s", type=float, default=240.0, help="bound on one scenario (default 240)")
    parser.add_argument("--retries", type=int, default=1, help="run a scenario again if a peer failed to start (default 1)")
    parser.add_argument("--calm-runs", type=int, default=2, help="calm runs, compared with each other for the noise (default 2)")
    parser.add_argument("--reanalyse", action="store_true", help="run nothing: analyse again the runs OUT/attack.json "
                        "lists, from the metrics and logs in their folders, and rewrite the table")
    args, peer_flags = parser.parse_known_args(argv)
    out_dir = Path(args.out)
    if args.reanalyse:
        return _reanalyse(out_dir, prog)
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = [*DEFAULT_FLAGS, *peer_flags]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that every scenario's peers are stopped
    if args.calm_runs < 1:
        parser.error("--calm-runs must be at least 1")
    calms = [("calm", "calm" if i == 0 else f"calm{i + 1}") for i in range(args.calm_runs)]
    # one calm run first, the others last: their spread also shows how the machine's load moved meanwhile
    runs = [calms[0], *[(name, name) for name in args.scenarios if name != "calm"], *calms[1:]]
    results = [_run_with_retries(name, run, out_dir, flags, args, prog) for name, run in runs]
    complete = [r for r in results if "error" not in r]
    rows = compare(complete) if any(r["scenario"] == "calm" for r in complete) else []
    (out_dir / "attack.json").write_text(json.dumps(dict(flags=flags, outer_steps=args.outer_steps, rows=rows, results=results), indent=1))
    table = markdown_table(rows)
    (out_dir / "attack.md").write_text(table)
    print(table, flush=True)
    return 0 if len(complete) == len(results) else 1


def _reanalyse(out_dir: Path, prog: str) -> int:
    try:
        saved = json.loads((out_dir / "attack.json").read_text())
        runs = [(r["scenario"], r.get("run", r["scenario"]), r["wall_s"]) for r in saved["results"] if "error" not in r]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{prog}: cannot read {out_dir / 'attack.json'}: {e}", file=sys.stderr)
        return 2
    results = []
    for name, run, wall_s in runs:
        folder = out_dir / run
        records = {path.stem: read_metrics(path) for path in sorted(folder.glob("*.jsonl"))}
        results.append({**analyse(name, folder, records, wall_s), "run": run})
    rows = compare(results) if any(r["scenario"] == "calm" for r in results) else []
    (out_dir / "attack.json").write_text(json.dumps({**saved, "rows": rows, "results": results}, indent=1))
    table = markdown_table(rows)
    (out_dir / "attack.md").write_text(table)
    print(table, flush=True)
    return 0
