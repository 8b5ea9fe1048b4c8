"""A real local swarm: identical global params per outer step, falling loss, a late joiner, a SIGKILLed peer."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest

from p2p_diloco.observe.report import ROUND_STATUSES, check_invariant_1

from .harness import local_swarm, wait_for_log

pytestmark = pytest.mark.integration


def _shas_by_step(records_by_peer: dict[str, list[dict]]) -> dict[int, set[str]]:
    found: dict[int, set[str]] = {}
    for records in records_by_peer.values():
        for r in records:
            found.setdefault(r["outer_step"], set()).add(r["global_sha256"])
    return found


def _grouped(records: list[dict], size: int) -> bool:
    return any(r["status"] == "ok" and r["group_size"] >= size for r in records)


def _three_founders_then_a_late_joiner(swarm, enough: Callable[[dict[str, list[dict]]], bool], what: str) -> dict[str, list[dict]]:
    """Three peers train until they averaged as a group of 3, then a fourth joins; once the late peer averaged and
    ``enough`` holds for the records, every peer is stopped (SIGTERM) and must exit cleanly. Returns the records by
    peer. The peers' own time limits only bound a run that goes wrong: the test waits for events, not for a clock."""
    for index in range(3):
        swarm.start(f"peer{index}", shard=index, num_shards=4, extra=["--max-time-s", "330", "--wait-for-peers", "3"])
    swarm.wait_until(lambda: all(_grouped(swarm.records(f"peer{i}"), 3) for i in range(3)), 100, "a group of 3")
    swarm.start("late", shard=3, num_shards=4, extra=["--max-time-s", "300"])
    swarm.wait_until(lambda: _grouped(swarm.records("late"), 2) and enough(swarm.all_records()), 240, what)
    codes = swarm.stop_all()
    assert all(code == 0 for code in codes.values()), (codes, swarm.log_tails())
    return swarm.all_records()


def _founders_averaged_with_the_late_peer(records: dict[str, list[dict]], size: int) -> bool:
    late_id = records["late"][0]["peer_id"] if records["late"] else None
    return any(late_id in r["peers"] and r["group_size"] >= size for i in range(3) for r in records[f"peer{i}"]
               if r["status"] == "ok")


def _learned(records: dict[str, list[dict]]) -> bool:
    """Enough for the first test: 8 outer steps, held-out loss down by 1.6, a founder averaged with the late peer,
    and no fork pending. A late peer's arrival can split a round into two groups of two (a partial all-reduce, then
    two retries): the two halves hold other bytes for that step until the tie heals it (docs/design.md §4, rule 5);
    stopped in between, they would be a fork in the records. A fork that never heals still fails the test: the
    wait for this runs out."""
    evals = [r["eval_loss"] for r in records["peer0"] if r.get("eval_loss") is not None]
    invariant = check_invariant_1(records)
    return (invariant["outer_steps_reported_by_several_peers"] >= 8 and invariant["held"] and len(evals) >= 2
            and evals[-1] < evals[0] - 1.6 and _founders_averaged_with_the_late_peer(records, 2))


@pytest.mark.timeout(420)
def test_three_peers_agree_learn_and_admit_a_late_joiner(tmp_path, reaper):
    swarm = local_swarm(tmp_path, reaper)
    records = _three_founders_then_a_late_joiner(swarm, _learned, "8 outer steps, loss down 1.6, the late peer in")
    # invariant 1: every outer step reported by several peers has exactly one sha256
    invariant = check_invariant_1(records)
    assert invariant["held"], invariant["forks"]
    assert invariant["outer_steps_reported_by_several_peers"] >= 8
    # the three founders averaged as a group of 3 at least once, and nothing was silently partial
    founder_rounds = [r for i in range(3) for r in records[f"peer{i}"] if r["status"] == "ok"]
    assert any(r["group_size"] == 3 for r in founder_rounds)
    assert all(r["bytes_sent"] > 0 for r in founder_rounds if r["group_size"] > 1)
    # what the background costs is counted: its processes' CPU grows from the first record on; and the steps' CPU
    # is in seconds, near their wall time (one torch thread each, 4 peers on the cores: about half of it; the
    # process's other threads can add a little)
    for i in range(3):
        first, last = records[f"peer{i}"][0], records[f"peer{i}"][-1]
        assert 0 < first["background_cpu_s"] < last["background_cpu_s"], (first, last)
        assert 0.1 * last["compute_s"] < last["compute_cpu_s"] <= 1.5 * last["compute_s"] + 0.5, last
    # loss falls clearly on held-out data
    initial = records["peer0"][0]["eval_loss"]
    # the newest evaluated record: a peer's last round can fail as the others stop (a failed round has no eval)
    final = [r["eval_loss"] for r in records["peer0"] if r.get("eval_loss") is not None][-1]
    assert final < initial - 1.5, (initial, final)

    # the late joiner downloaded the state, reached the swarm's sha256, then contributed
    late_records = records["late"]
    assert late_records[-1]["catch_ups"] >= 1
    shas = _shas_by_step({k: v for k, v in records.items() if k != "late"})
    caught_up = [r for r in late_records if r["catch_ups"] >= 1 and r["outer_step"] in shas]
    assert caught_up and all(r["global_sha256"] in shas[r["outer_step"]] for r in caught_up)
    late_id = late_records[0]["peer_id"]
    joined_steps = [r["outer_step"] for i in range(3) for r in records[f"peer{i}"] if late_id in r["peers"]]
    assert joined_steps, "no founder ever averaged with the late peer"
    late_ok = [r for r in late_records if r["status"] == "ok"]
    assert late_ok and late_ok[0]["group_size"] >= 2 and late_ok[0]["weight"] > 0


# a period of 0.5 s near a round's end and 2 s in between; rounds long enough for the idle pace to engage
# rounds of ~8 s here: the idle pace needs the round's end over 3 idle periods away. With a 2 s idle period and
# rounds of 300 steps (~6 s) a peer went idle only now and then, and the test waited 190-225 s for all four to
IDLE_PACE_FLAGS = ["--progress-period-s", "0.5", "--progress-idle-period-s", "1", "--inner-steps", "400"]


@pytest.mark.timeout(420)
def test_the_idle_pace_keeps_rounds_whole_and_admits_a_late_joiner(tmp_path, reaper):
    # Progress records go every 1 s while a round's end is far and every 0.5 s near it: a joiner arriving while the
    # others are on the idle pace must still be seen by all alike (a constant, slow period split groups and forked)
    swarm = local_swarm(tmp_path, reaper, IDLE_PACE_FLAGS)

    def idle_and_whole(records: dict[str, list[dict]]) -> bool:
        went_idle = all("(while a round's end is far)" in p.log_file.read_text(errors="replace") for p in swarm.peers.values())
        return went_idle and _founders_averaged_with_the_late_peer(records, 4) and check_invariant_1(records)["held"]

    records = _three_founders_then_a_late_joiner(swarm, idle_and_whole, "every peer idle once, a round of 4")
    invariant = check_invariant_1(records)
    assert invariant["held"], invariant["forks"]
    for name, peer in swarm.peers.items():  # every peer went idle at least once: the pace was exercised
        assert "(while a round's end is far)" in peer.log_file.read_text(errors="replace"), name
    late_id = records["late"][0]["peer_id"]
    founders_ok = [r for i in range(3) for r in records[f"peer{i}"] if r["status"] == "ok"]
    assert any(late_id in r["peers"] and r["group_size"] == 4 for r in founders_ok), "no whole round with the joiner"
    # rounds stayed whole: the founders' rounds after the first (peers start seconds apart, and whoever is there
    # first averages step 0 without the last one) until the first founder began to stop, all ok
    # on the common clock: each record's time_s counts from its own peer's start, and the peers start seconds apart
    first_stop = min(max(r["unix_time"] for r in records[f"peer{i}"]) for i in range(3)) - 5
    rounds = [
        r for i in range(3) for r in records[f"peer{i}"]
        if r["status"] in ROUND_STATUSES and r["outer_step"] >= 1 and r["unix_time"] < first_stop
    ]
    # at most one outer step may miss: a part lost in transit on a loaded machine makes that round partial for
    # some (they catch up, invariant 1 above); groups never split, nobody goes stale
    missed = [(r["outer_step"], r["status"], r["reason"]) for r in rounds if r["status"] != "ok"]
    assert rounds and len({step for step, _, _ in missed}) <= 1 and all(status == "partial" for _, status, _ in missed), missed


def test_sigkilled_peer_costs_one_timeout_and_survivors_go_on(tmp_path, reaper):
    timeout_s = 12  # the averaging timeout the kill costs (30 s in the other tests; rounds here take about 1 s)
    swarm = local_swarm(tmp_path, reaper, ["--averaging-timeout-s", str(timeout_s)])
    for index in range(3):
        swarm.start(f"peer{index}", shard=index, num_shards=4, extra=["--max-time-s", "150", "--wait-for-peers", "3"])
    swarm.wait_until(lambda: all(_grouped(swarm.records(f"peer{i}"), 3) for i in range(3)), 100, "a group of 3")

    victim = swarm.peers["peer2"]
    victim.signal_group(signal.SIGKILL)  # the whole machine dies: trainer, averager, DHT, p2pd
    killed_at = {name: swarm.outer_step(name) for name in ("peer0", "peer1")}
    kill_time = time.monotonic()
    swarm.wait_until(
        lambda: all(swarm.outer_step(n) >= killed_at[n] + 3 for n in killed_at), 150, "survivors to make 3 more steps"
    )
    recovery_s = time.monotonic() - kill_time
    swarm.stop_all()

    records = swarm.all_records()
    invariant = check_invariant_1(records)
    assert invariant["held"], invariant["forks"]
    for name in killed_at:
        after = [r for r in records[name] if r["outer_step"] > killed_at[name] and r["status"] in ROUND_STATUSES]
        # one bounded timeout at most: no round blocks longer than the averaging timeout (+ margin)
        assert max(r["interval_blocked_s"] for r in after) < timeout_s + 10, after
        assert max(r["averaging_s"] or 0 for r in after) < timeout_s + 10, after
    # the survivors went on together as a group of two
    pairs = [r for r in records["peer0"] if r["outer_step"] > killed_at["peer0"] and r["group_size"] == 2]
    assert pairs and records["peer1"][0]["peer_id"] in pairs[-1]["peers"], pairs
    assert recovery_s < 150


def test_overlap_token_weights_and_a_peer_that_misses_rounds(tmp_path, reaper):
    """Training goes on while averaging; weights are tokens; a peer frozen for a while rejoins without a fork."""
    swarm = local_swarm(tmp_path, reaper)
    for index in range(3):
        # stopped by the test once it has seen what it needs; they begin together: a peer that starts seconds before
        # the others trains alone, and two fresh peers at the start outvote it (history.py), which is not this test's
        swarm.start(f"peer{index}", shard=index, num_shards=3, extra=["--max-time-s", "180", "--wait-for-peers", "3"])
    swarm.wait_until(lambda: all(_grouped(swarm.records(f"peer{i}"), 3) for i in range(3)), 100, "a group of 3")

    frozen = swarm.peers["peer2"]
    wait_for_log(frozen.log_file, r"averaging started", frozen.log_file.stat().st_size, 60)
    frozen.signal_group(signal.SIGSTOP)  # hung mid-averaging, sockets open: the others must go on without it
    step_before = swarm.outer_step("peer0")
    swarm.wait_until(lambda: swarm.outer_step("peer0") >= step_before + 2, 90, "two rounds without the frozen peer")
    frozen.signal_group(signal.SIGCONT)
    thawed_at = len(swarm.records("peer2"))
    swarm.wait_until(
        lambda: _grouped(swarm.records("peer2")[thawed_at:], 2), 90, "the thawed peer to average again"
    )
    swarm.stop_all()

    records = swarm.all_records()
    invariant = check_invariant_1(records)
    assert invariant["held"], invariant["forks"]
    ok = [r for name in records for r in records[name] if r["status"] == "ok" and r["group_size"] > 1]
    # overlap: inner steps ran while averagings were in flight
    assert sum(r["steps_during_averaging"] for r in ok) > 0
    # token weighting: each peer's weight is the tokens behind its outer gradient; the group's total adds up
    for peer_records in records.values():
        peer_ok = [r for r in peer_records if r["status"] == "ok"]
        assert all(0 < r["weight"] <= r["tokens"] for r in peer_ok)
        assert sum(r["weight"] for r in peer_ok) <= peer_records[-1]["tokens"]
    by_step: dict[int, list[dict]] = {}
    for r in ok:
        by_step.setdefault(r["outer_step"], []).append(r)
    for step, group in by_step.items():
        if len(group) == group[0]["group_size"]:  # every member's record is here: weights must add up
            assert sum(r["weight"] for r in group) == pytest.approx(group[0]["weight_total"]), step
    # the frozen peer came back: it caught up (or kept its work) and contributed again without forking
    after_thaw = records["peer2"][thawed_at:]
    assert any(r["status"] == "ok" and r["group_size"] >= 2 for r in after_thaw)


def test_streaming_fragments_average_one_fragment_per_outer_step(tmp_path, reaper):
    swarm = local_swarm(tmp_path, reaper, ["--fragments", "2", "--max-time-s", "150"])
    for index in range(2):
        swarm.start(f"peer{index}", shard=index, num_shards=2)

    def paired_rounds() -> int:
        return sum(r["status"] == "ok" and r["group_size"] == 2 for r in swarm.records("peer0"))

    swarm.wait_until(lambda: paired_rounds() >= 4, 140, "four averaged fragments")
    assert all(code == 0 for code in swarm.stop_all().values()), swarm.log_tails()
    records = swarm.all_records()
    invariant = check_invariant_1(records)
    assert invariant["held"], invariant["forks"]
    paired = [r for r in records["peer0"] if r["status"] == "ok" and r["group_size"] == 2]
    assert len(paired) >= 3, records["peer0"]
    # outer step r averages fragment r % 2: the fragment of a record is that of the step it completed
    assert all(r["fragment"] == (r["outer_step"] - 1) % 2 for r in paired)
    assert {r["fragment"] for r in paired} == {0, 1}
