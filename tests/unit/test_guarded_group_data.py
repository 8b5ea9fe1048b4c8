"""What GuardedAverager reads from a group's gathered data (guarded.py), driven without a DHT or averager process:
the outer step and base a joiner declares (a leader refuses another step or other global params), the weight ratio the result check allows for,
the reducer shares once banned peers are demoted, and whom a peer refuses (its banned peers, and those most of the swarm banned)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from p2p_diloco.core.robust import RobustPolicy
from p2p_diloco.swarm.guarded import GuardedAverager, RoundGuard

PEERS = [PeerID(bytes([18, 32, *([k] * 32)])) for k in (1, 2, 3)]  # identity multihashes: valid, distinct ids


def _request_data(user: object) -> bytes:
    """What a peer puts in its group request: hivemind's [bandwidth, mode, user data] around ours."""
    return MSGPackSerializer.dumps([100.0, 0, MSGPackSerializer.dumps(user)])


def _averager(own: PeerID = PEERS[0], averaging: object = None) -> SimpleNamespace:
    """An object with just what the methods under test read, and those methods bound to it."""
    control = None if averaging is None else SimpleNamespace(data_for_gather=_request_data(averaging))
    fake = SimpleNamespace(
        serializer=MSGPackSerializer, peer_id=own, _matchmaking=SimpleNamespace(step_control=control),
        _demoted_before=set(),
    )
    for name in ("_declared", "_same_outer_step", "_gathered", "_weight_ratio", "_demote_banned"):
        setattr(fake, name, getattr(GuardedAverager, name).__get__(fake))
    return fake


def test_a_leader_refuses_a_joiner_that_declares_another_outer_step():
    leader = _averager(averaging={"outer_step": 24, "weight": 512})
    assert leader._same_outer_step(_request_data({"outer_step": 24, "weight": 9.0}))
    assert not leader._same_outer_step(_request_data({"outer_step": 23, "weight": 9.0}))
    assert not leader._same_outer_step(_request_data("not a dict"))
    assert not leader._same_outer_step(b"\xff not msgpack")
    # while the leader averages nothing it has no step to compare: hivemind's own checks decide
    assert _averager(averaging=None)._same_outer_step(_request_data({"outer_step": 23}))


def test_a_leader_refuses_a_joiner_at_its_step_on_other_global_params():
    """A peer on a fork (another sha256 for the same outer step: another group averaged that step to other bytes)
    would mix an outer gradient measured from other params into the group's."""
    leader = _averager(averaging={"outer_step": 24, "weight": 512, "base": "aa"})
    assert leader._same_outer_step(_request_data({"outer_step": 24, "weight": 9.0, "base": "aa"}))
    assert not leader._same_outer_step(_request_data({"outer_step": 24, "weight": 9.0, "base": "bb"}))
    assert not leader._same_outer_step(_request_data({"outer_step": 24, "weight": 9.0}))  # declares none
    # a leader that declares no base (a bare averager, as in a test) compares the step only
    assert _averager(averaging={"outer_step": 24})._same_outer_step(_request_data({"outer_step": 24, "base": "bb"}))


def test_a_leader_refuses_a_joiner_that_cross_checks_differently():
    """A cross-checking group runs two all-reduces: a member that runs one would fail everyone's second."""
    leader = _averager(averaging={"outer_step": 24, "weight": 512, "cross_check": True})
    assert leader._same_outer_step(_request_data({"outer_step": 24, "cross_check": True}))
    assert not leader._same_outer_step(_request_data({"outer_step": 24, "cross_check": False}))
    assert not leader._same_outer_step(_request_data({"outer_step": 24}))  # an earlier version declares none
    plain = _averager(averaging={"outer_step": 24, "weight": 512, "cross_check": False})
    assert plain._same_outer_step(_request_data({"outer_step": 24}))
    assert not plain._same_outer_step(_request_data({"outer_step": 24, "cross_check": True}))


def test_the_group_data_gives_the_weight_ratio_bounded_by_published_progress():
    group = SimpleNamespace(peer_ids=PEERS, gathered=[
        _request_data({"outer_step": 7, "weight": 500.0}),
        _request_data({"outer_step": 7, "weight": 20_000.0}),
        _request_data({"outer_step": 7, "weight": 1e9}),  # inflated, but its progress supports 10,000 tokens
    ])
    averager = _averager(own=PEERS[0])
    guard = RoundGuard(RobustPolicy(), {PEERS[2].to_base58(): 10_000.0})
    assert averager._weight_ratio(group, averager._gathered(group), guard) == pytest.approx(40.0)
    # a group entry that is unreadable or carries no usable weight counts as 0; our own weight 0 gives 1
    group.gathered = [_request_data({"weight": 0}), b"\xff", _request_data({"weight": float("nan")})]
    assert averager._gathered(group)[1] == {}
    assert averager._weight_ratio(group, averager._gathered(group), guard) == 1.0


def test_a_peer_banned_in_one_request_reduces_nothing_whoever_reads_the_group():
    a, b, g = (peer.to_base58() for peer in PEERS)
    group = SimpleNamespace(peer_ids=PEERS, gathered=[
        _request_data({"outer_step": 7, "weight": 1.0, "banned": [g]}),
        _request_data({"outer_step": 7, "weight": 1.0, "banned": []}),  # b has not banned g
        _request_data({"outer_step": 7, "weight": 1.0, "banned": [a, b]}),  # g names both back: not believed
    ])
    for own in PEERS:  # every member, g included, computes the same shares from the same bytes
        averager = _averager(own=own)
        assert averager._demote_banned(group, averager._gathered(group), (0.25, 0.25, 0.5)) == (0.5, 0.5, 0.0)
        assert averager._demoted_before == {g}


def test_our_banned_peers_and_those_most_of_the_swarm_banned_are_neither_followed_nor_let_in():
    asked: list[PeerID] = []

    async def request_join_group(leader: PeerID) -> str:
        asked.append(leader)
        return "group"

    ours, theirs, honest = PEERS
    fake = SimpleNamespace(
        _banned={ours.to_base58()}, _shunned=frozenset({theirs.to_base58()}), membership=None,
        _matchmaking=SimpleNamespace(_request_join_group=request_join_group),
    )
    for name in ("_refused", "_skip_banned_leaders"):
        setattr(fake, name, getattr(GuardedAverager, name).__get__(fake))
    fake._skip_banned_leaders()
    results = [asyncio.run(fake._matchmaking._request_join_group(leader)) for leader in PEERS]
    assert results == [None, None, "group"] and asked == [honest]
    refused = [asyncio.run(fake._refused(peer, "join an averaging group")) for peer in PEERS]
    assert refused == [True, True, False]
    # their parts are still taken when a groupmate let them in (checked like anyone's)
    assert not asyncio.run(fake._refused(theirs, "send parts", banned_too=False))
    # and the state is served to a peer only the others banned: if they were wrong, it can still catch up
    assert [asyncio.run(fake._refused(peer, "download the state", shunned_too=False)) for peer in PEERS] == [True, False, False]
