"""The rule by which every peer picks the swarm's history (history.py, docs/design.md §4): the highest outer step,
then the bytes most peers report, then the smallest sha256; two sides of a partition pick the same winner."""

from __future__ import annotations

from p2p_diloco.history import agreed_sha, canonical_sha, reported_sha256, swarm_outer_step

A, B, C = "a" * 64, "b" * 64, "c" * 64


def _view(records: dict[str, tuple[int, str]], me: str) -> dict[str, dict]:
    """What peer ``me`` reads: every other peer's record."""
    return {peer: dict(outer_step=step, global_sha256=sha) for peer, (step, sha) in records.items() if peer != me}


def _decision(records: dict[str, tuple[int, str]], me: str) -> tuple[int, str]:
    """(outer step, sha256) peer ``me`` ends on: the swarm's step if it is behind, else the canonical bytes."""
    view, (step, sha) = _view(records, me), records[me]
    ahead = swarm_outer_step(view)
    if ahead > step:
        return ahead, canonical_sha(view, ahead)
    return step, canonical_sha(view, step, sha)


def test_two_sides_of_a_partition_merge_onto_the_same_history():
    # more peers on one side, further ahead on the other: the highest step wins, seen from either side
    swarm = {"p1": (10, A), "p2": (10, A), "p3": (12, B)}
    assert {_decision(swarm, peer) for peer in swarm} == {(12, B)}
    # the same step on other bytes: the bytes most peers hold win
    swarm = {"p1": (10, A), "p2": (10, A), "p3": (10, B)}
    assert {_decision(swarm, peer) for peer in swarm} == {(10, A)}
    # a tie goes to the smallest sha256, whichever side decides
    swarm = {"p1": (7, C), "p2": (7, B)}
    assert {_decision(swarm, peer) for peer in swarm} == {(7, B)}


def test_agreed_sha_needs_half_of_the_peers_reporting_the_step():
    records = {"p1": dict(outer_step=5, global_sha256=A), "p2": dict(outer_step=5, global_sha256=A),
               "p3": dict(outer_step=5, global_sha256=B), "p4": dict(outer_step=4, global_sha256=C)}
    assert agreed_sha(records, 5) == A and agreed_sha(records, 4) == C and agreed_sha(records, 6) is None
    assert agreed_sha({"p1": dict(outer_step=5, global_sha256=A), "p2": dict(outer_step=5, global_sha256=B),
                       "p3": dict(outer_step=5, global_sha256=C)}, 5) is None  # no bytes with half the votes
    assert reported_sha256(records, 5) == {"p1": A, "p2": A, "p3": B}
    assert swarm_outer_step({}) == -1 and canonical_sha({}, 3) is None
