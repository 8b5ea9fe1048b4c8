"""Which history a peer takes (history.py, docs/design.md §4), decided on progress records alone: catching up to
what a majority vouches for, never to a lone claim; the cases that must keep working (a late joiner, a peer
resumed from an old checkpoint, a swarm of two, a partition); same-step forks; unbacked claims."""

from __future__ import annotations

import hashlib

from p2p_diloco.core.history import (
    CHAIN,
    MADE,
    Target,
    chain_of,
    choose_target,
    donor_ranks,
    made_sha256,
    moved_past,
    unbacked_claims,
)
from p2p_diloco.core.swarm_view import SwarmView


def sha(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def history(tag: str, last: int, first: int = 0) -> list[tuple[int, str]]:
    """A chain of heads ``first..last`` of the history named ``tag``."""
    return [(step, sha(f"{tag}{step}")) for step in range(first, last + 1)]


def record(chain: list[tuple[int, str]]) -> dict:
    step, digest = chain[-1]
    return dict(outer_step=step, global_sha256=digest, recent=[list(node) for node in chain[:-1]])


def view(peers: dict[str, list[tuple[int, str]]]) -> dict[str, dict]:
    return {peer: record(chain) for peer, chain in peers.items()}


def test_a_record_lists_a_bounded_well_formed_chain_with_its_head_last():
    chain = chain_of(record(history("a", 20)))
    assert len(chain) == CHAIN and chain[-1] == (20, sha("a20")) and [step for step, _ in chain] == list(range(13, 21))
    hostile = dict(outer_step=5, global_sha256=sha("a5"), recent=[[6, sha("x")], [3, "zz"], ["4", sha("y")], [2, sha("a2")]])
    assert chain_of(hostile) == ((2, sha("a2")), (5, sha("a5")))  # later steps, bad hashes and bad steps dropped
    assert chain_of(dict(outer_step=float("nan"), global_sha256=sha("a"))) == ()


def test_a_peer_behind_catches_up_to_what_most_peers_vouch_for_never_to_a_lone_claim():
    honest = history("h", 11)
    liar = [*history("h", 10), *history("x", 16, first=11)]  # vouches for our history, then claims 6 steps more
    records = view({"b": honest, "c": honest, "x": liar})
    own = history("h", 10)  # our round at step 10 failed
    # two of four are no majority (we vouch for nothing past our head): the honest next step, checked by recomputing it
    assert choose_target(records, own, fresh=False, own_id="a") == Target(11, sha("h11"), "next")
    assert choose_target({**records, "d": record(honest)}, own, fresh=False, own_id="a") == Target(11, sha("h11"), "majority")
    assert unbacked_claims(records, own, own_id="a") == {"x": (16, sha("x16"))}
    # all honest peers on step 11: the claim moves nobody and makes no search stale
    records = view({"b": honest, "c": honest, "x": [*history("h", 11), *history("x", 16, first=12)]})
    assert choose_target(records, honest, fresh=False, own_id="a") is None
    assert not moved_past(records, honest, own_id="a")


def test_two_colluders_of_five_move_nobody():
    honest = history("h", 9)
    for fork in (3, 9):  # colluders that left our history long ago, or that vouch for all of it and claim more
        fake = [*history("h", fork - 1), *history("x", 14, first=fork)]
        records = view({"b": honest, "c": honest, "x": fake, "y": fake})
        assert choose_target(records, honest, fresh=False, own_id="a") is None
        assert set(unbacked_claims(records, honest, own_id="a")) == {"x", "y"}
        # behind by a failed round: two of five vouch for the next step, which two colluders could do as well. The
        # peer waits for the colluders' own chains to pass it (an adversary in honest groups reports their steps)
        # or for a third voucher; with one of them vouching, the honest next step is checked by recomputing it
        assert choose_target(records, history("h", 8), fresh=False, own_id="a") is None
        assert choose_target({**records, "x": record(honest)}, history("h", 8), fresh=False, own_id="a").node == (9, sha("h9"))
        # a late joiner, two honest peers against two colluders: only the peer it joined through breaks the tie
        assert choose_target(records, [(0, sha("init"))], fresh=True, own_id="a") is None
        assert choose_target(records, [(0, sha("init"))], fresh=True, own_id="a", anchors={"b"}) == Target(9, sha("h9"), "fresh")
    # two colluders that start with us and claim a history through our start: beside the one honest peer at our
    # start, theirs is no majority, fresh or not (it was: the honest peers took a made-up step 5 of theirs)
    made_up = [(0, sha("init")), *history("x", 5, first=1)]
    start = view({"b": [(0, sha("init"))], "x": made_up, "y": made_up})
    for fresh in (True, False):
        assert choose_target(start, [(0, sha("init"))], fresh=fresh, own_id="a") is None
    early = view({"b": history("h", 5), "c": history("h", 5), "x": history("h", 5)})
    assert choose_target(early, history("h", 0), fresh=True, own_id="a") == Target(5, sha("h5"), "majority")


def test_a_late_joiner_and_a_resumed_peer_take_the_swarms_history():
    swarm = view({"b": history("h", 20), "c": history("h", 20), "x": history("x", 27)})
    assert choose_target(swarm, history("h", 0), fresh=True, own_id="a") == Target(20, sha("h20"), "fresh")
    assert choose_target(swarm, history("h", 5), fresh=True, own_id="a") == Target(20, sha("h20"), "fresh")
    # a second peer joining a swarm of one has nobody else to believe
    assert choose_target(view({"b": history("h", 20)}), history("h", 0), fresh=True, own_id="a") == Target(20, sha("h20"), "fresh")
    # ... also while the one's chain still holds the start we are at: it passed through our head, it is not at it
    assert choose_target(view({"b": history("h", 5)}), history("h", 0), fresh=True, own_id="a") == Target(5, sha("h5"), "fresh")
    # a swarm of two whose first round failed on one side only: the fresh side takes the other's step, no deadlock
    # (it searched at step 0 with nobody left there, the other at step 1 with nobody there yet)
    assert choose_target(view({"b": history("h", 1)}), history("h", 0), fresh=True, own_id="a") == Target(1, sha("h1"), "fresh")
    assert moved_past(view({"b": history("h", 1)}), history("h", 0), own_id="a")
    # ... but a peer with a history of its own does not follow a lone peer somewhere else
    assert choose_target(view({"x": history("x", 20)}), history("h", 12), fresh=False, own_id="a") is None
    # and the first peer, which trained alone (still fresh), does not go back to the second's start
    assert choose_target(view({"b": [(0, sha("init"))]}), history("h", 21), fresh=True, own_id="a") is None


def test_in_a_swarm_of_two_the_next_step_is_taken_only_as_a_checked_next_step():
    partner = history("h", 11)
    assert choose_target(view({"b": partner}), history("h", 10), fresh=False, own_id="a") == Target(11, sha("h11"), "next")
    assert moved_past(view({"b": partner}), history("h", 10), own_id="a")  # nobody left at step 10 to group with
    far = history("h", 14)
    assert choose_target(view({"b": far}), history("h", 10), fresh=False, own_id="a") is None  # no majority of one


def test_a_partition_merges_onto_the_larger_side_even_at_a_lower_step():
    small, large = [*history("h", 8), *history("b", 14, first=9)], [*history("h", 8), *history("a", 10, first=9)]
    peers = {"a1": large, "a2": large, "a3": large, "b1": small, "b2": small}
    records = view(peers)
    decisions = {peer: choose_target(records, chain, fresh=False, own_id=peer) for peer, chain in peers.items()}
    assert decisions == {"a1": None, "a2": None, "a3": None, "b1": Target(10, sha("a10"), "majority"),
                         "b2": Target(10, sha("a10"), "majority")}
    halves = {"a1": large, "a2": large, "b1": small, "b2": small}  # no majority: the tie at the step they split
    records = view(halves)
    decisions = {peer: choose_target(records, chain, fresh=False, own_id=peer) for peer, chain in halves.items()}
    winner, loser = ("a", "b") if sha("a9") < sha("b9") else ("b", "a")
    head = (large if winner == "a" else small)[-1]
    # the losing half is offered the winner's head as a tie, which the learner takes only within one honest round
    # of its own state (verify.tie_problem): halves that split five steps ago stay apart
    assert decisions == {f"{winner}1": None, f"{winner}2": None, f"{loser}1": Target(*head, "tie"),
                         f"{loser}2": Target(*head, "tie")}


def test_a_same_step_fork_goes_to_the_better_vouched_bytes_then_the_smaller_hash():
    base = history("h", 6)
    left, right = [*base, (7, sha("left"))], [*base, (7, sha("right"))]
    smaller, larger = sorted([left, right], key=lambda chain: chain[-1][1])
    assert choose_target(view({"b": larger}), smaller, fresh=False, own_id="a") is None
    assert choose_target(view({"b": smaller}), larger, fresh=False, own_id="a") == Target(*smaller[-1], "tie")
    records = view({"b": left, "c": left, "d": left})
    assert choose_target(records, right, fresh=False, own_id="e") == Target(*left[-1], "majority")
    records = view({"b": left, "c": left, "d": right})  # two against two: the smaller hash, on both sides
    assert {choose_target(records, right, fresh=False, own_id="e"), choose_target(view({"b": left, "d": right, "e": right}),
            left, fresh=False, own_id="c")} - {None} == {Target(*smaller[-1], "tie")}
    # the better-vouched side of a fork is a plain fork, not a tie: three against our two
    records = view({"b": left, "c": left, "d": left, "f": right})
    assert choose_target(records, right, fresh=False, own_id="e") in (Target(*left[-1], "majority"), Target(*left[-1], "fork"))


def test_two_halves_of_a_split_round_merge_even_when_one_carried_on():
    """A round split into two groups of two (a partial all-reduce, then two retries): step 7 on other bytes on each
    side. If one side averaged again before the tie was seen, no head shares a step, and both sides kept their own
    for good (a CI run stopped such a swarm with its halves apart). The rule of a same-step fork, applied at the step
    where the sides differ, gives both sides the same answer whichever side is ahead."""
    base = history("h", 6)
    left, right = [*base, (7, sha("left"))], [*base, (7, sha("right"))]
    smaller, larger = sorted([left, right], key=lambda chain: chain[-1][1])
    for small, big in (([*smaller, (8, sha("s8"))], larger), (smaller, [*larger, (8, sha("b8"))]), (smaller, larger)):
        peers = {"a": small, "b": small, "c": big, "d": big}
        records = view(peers)
        decisions = {peer: choose_target(records, chain, fresh=False, own_id=peer) for peer, chain in peers.items()}
        assert decisions == {"a": None, "b": None, "c": Target(*small[-1], "tie"), "d": Target(*small[-1], "tie")}
    # both sides carried on: the heads at one step decide (the existing rule), and nothing contradicts it
    small, big = [*smaller, (8, sha("s8"))], [*larger, (8, sha("b8"))]
    peers = {"a": small, "b": small, "c": big, "d": big}
    records = view(peers)
    decisions = {peer: choose_target(records, chain, fresh=False, own_id=peer) for peer, chain in peers.items()}
    assert sum(decision is not None for decision in decisions.values()) == 2
    assert len({decision for decision in decisions.values() if decision is not None}) == 1
    # three against one is a majority, not a tie; and a lone fork of one peer moves nobody
    peers = {"a": [*smaller, (8, sha("s8"))], "b": larger, "c": larger, "d": larger}
    records = view(peers)
    assert choose_target(records, peers["b"], fresh=False, own_id="b") is None
    assert choose_target(records, peers["a"], fresh=False, own_id="a") == Target(*larger[-1], "majority")


def test_a_peer_one_step_ahead_of_everyone_keeps_its_head():
    """Its chain no longer reaches back as far as theirs: their oldest heads are our history too, not another one."""
    others = history("h", 31)
    records = view({"b": others, "c": others, "d": others})
    assert choose_target(records, history("h", 32), fresh=False, own_id="a") is None
    assert choose_target(records, history("h", 32), fresh=True, own_id="a") is None
    assert not unbacked_claims(records, history("h", 32), own_id="a") and not moved_past(records, history("h", 32), "a")


def test_a_read_that_lacks_peers_seen_a_moment_ago_is_no_swarm_of_one():
    """A joiner's first records are whoever pushed first; a DHT answer may come from part of the swarm. Peers seen a
    moment ago that a read lacks count as unseen peers at our head: a read that shows only a liar, or only two
    colluders, moves nobody (it did: a late joiner took a claimer's state, the honest peers' records not yet read)."""
    start = [(0, sha("init"))]
    claimer = view({"x": [*history("h", 3), *history("x", 8, first=4)]})
    assert choose_target(claimer, start, fresh=True, own_id="a") == Target(8, sha("x8"), "fresh")  # truly a swarm of two
    assert choose_target(claimer, start, fresh=True, own_id="a", unseen=2) is None
    colluders = [*history("h", 9), *history("x", 14, first=10)]  # they vouch for our history, then claim more
    for fresh, own in ((False, history("h", 9)), (True, start)):
        assert choose_target(view({"x": colluders, "y": colluders}), own, fresh=fresh, own_id="a").node == (14, sha("x14"))
        assert choose_target(view({"x": colluders, "y": colluders}), own, fresh=fresh, own_id="a", unseen=3) is None
    # an honest majority is still followed with a peer unseen, and a partition still merges onto the larger side
    honest = view({"b": history("h", 11), "c": history("h", 11), "d": history("h", 11)})
    assert choose_target(honest, history("h", 10), fresh=False, own_id="a", unseen=1) == Target(11, sha("h11"), "majority")
    assert choose_target(honest, start, fresh=True, own_id="a", unseen=1) == Target(11, sha("h11"), "fresh")


def test_the_view_remembers_peers_a_read_lacks_for_two_idle_periods():
    view_ = SwarmView("a", idle_s=5.0)
    start = [(0, sha("init"))]
    claimer = record([*history("h", 3), *history("x", 8, first=4)])
    everyone = {"b": record(history("h", 12)), "c": record(history("h", 12)), "x": claimer}
    assert view_.target(everyone, start, fresh=True, now=100.0) == Target(12, sha("h12"), "fresh")
    assert view_.target({"x": claimer}, start, fresh=True, now=101.0) is None  # b and c are unseen, not gone
    assert view_.target({"x": claimer}, start, fresh=True, now=109.0) is None
    # two idle periods on, they are gone (they left, or their records expired): the one left is a swarm of two
    assert view_.target({"x": claimer}, start, fresh=True, now=112.0) == Target(8, sha("x8"), "fresh")


def test_a_joiner_whose_first_read_shows_only_a_claimer_waits_for_the_swarm():
    """A joiner's first reads may show only the peer whose record reached it first: a claimer 5 steps ahead, the
    honest peers' records not yet read (a CI run: a late joiner took the claimer's state at its first check, 0.2 s
    in, and healed back 4 s later). Nobody was seen before, so nobody is unseen: a lone word that is not the peer we
    joined through is a swarm of one only once we have read the swarm for two idle periods."""
    start = [(0, sha("init"))]
    claimer = [*history("h", 3), *history("x", 8, first=4)]
    lone = view({"x": claimer})
    assert choose_target(lone, start, fresh=True, own_id="a", settled=False) is None
    assert choose_target(lone, start, fresh=True, own_id="a", anchors={"x"}, settled=False) == Target(8, sha("x8"), "fresh")
    assert choose_target(lone, start, fresh=True, own_id="a", settled=True) == Target(8, sha("x8"), "fresh")
    # a majority needs no settling: two honest peers seen at once are followed at the first read
    honest = view({"b": history("h", 6), "c": history("h", 6), "x": claimer})
    assert choose_target(honest, start, fresh=True, own_id="a", settled=False) == Target(6, sha("h6"), "fresh")

    joiner = SwarmView("a", anchors=["b"], idle_s=5.0)
    everyone = {"b": record(history("h", 6)), "c": record(history("h", 6)), "x": record(claimer)}
    assert joiner.target({"x": record(claimer)}, start, fresh=True, now=100.0) is None
    assert joiner.target(everyone, start, fresh=True, now=101.0) == Target(6, sha("h6"), "fresh")
    # alone for two idle periods of reads, it is a swarm of two after all
    alone = SwarmView("a", anchors=["b"], idle_s=5.0)
    assert alone.target({"x": record(claimer)}, start, fresh=True, now=100.0) is None
    assert alone.target({"x": record(claimer)}, start, fresh=True, now=109.0) is None
    assert alone.target({"x": record(claimer)}, start, fresh=True, now=110.0) == Target(8, sha("x8"), "fresh")
    # the peer we joined through is believed at once: a second peer joining a swarm of one waits for nothing
    second = SwarmView("a", anchors=["b"], idle_s=5.0)
    assert second.target({"b": record(history("h", 20))}, start, fresh=True, now=100.0) == Target(20, sha("h20"), "fresh")


def test_a_killed_peers_record_beside_its_restart_makes_no_honest_survivor_a_claimant():
    """A peer killed at step 2 restarts from its checkpoint at step 2 under a new id; its old record lives until it
    expires. The two records made a majority of four for step 2, under which two honest survivors one step apart
    (one's round failed) took each other's heads for unbacked claims and banned each other at the third check (a CI
    run), and the banned pair's halves forked. A quiet record does not vote, and a head at our step claims nothing."""
    honest = history("h", 7)
    records = view({"b": honest[:7], "dead": honest[:3], "back": honest[:3]})
    # b at our own step: no claim, whatever the majority
    assert unbacked_claims(records, honest[:7], own_id="a") == {}
    # b two steps ahead of us (two of our rounds failed): with the killed peer's record voting, step 2 is the majority's
    records = view({"b": honest, "dead": honest[:3], "back": honest[:3]})
    assert unbacked_claims(records, honest[:6], own_id="a") == {"b": (7, sha("h7"))}
    silent = {"b": 0.5, "back": 0.5, "dead": 14.0}  # its record unrenewed for 14 s, against a horizon of 2 + 2 s
    view_ = SwarmView("a", fast_s=1.0, idle_s=5.0)
    for check in range(5):
        assert view_.target(records, honest[:6], fresh=False, now=100.0 + check, silent_s=silent.__getitem__) is None
    assert view_.history_banned == frozenset()
    # counting it, b would have been banned: what the CI run did
    counted = SwarmView("a", fast_s=1.0, idle_s=5.0)
    for check in range(5):
        counted.target(records, honest[:6], fresh=False, now=100.0 + check)
    assert counted.history_banned == {"b"}
    # when its record expires it is gone, not unseen (a partial read): seen live a moment before it went quiet, it
    # counted as a peer at the restarted one's head for the view's memory (2 idle periods), and the restarted peer,
    # fresh, waited that long to take the survivors' head
    later = history("h", 12)  # the survivors ten steps on: their chains no longer reach back to step 2
    restarted = SwarmView("back", fast_s=1.0, idle_s=5.0)
    survivors = {"a": record(later), "b": record(later)}
    silent = {"dead": 0.5}
    silent_s = lambda peer: silent.get(peer, 0.5)  # noqa: E731
    # the killed peer's record at the restarted one's head: one against two, no more vouch for theirs (2) than are
    # at ours (2); waiting is what a fresh peer does beside a second peer at its start
    assert restarted.target({**survivors, "dead": record(honest[:3])}, honest[:3], True, 100.0, silent_s) is None
    silent["dead"] = 14.0  # quiet: no vote
    expected = Target(12, sha("h12"), "fresh")
    assert restarted.target({**survivors, "dead": record(honest[:3])}, honest[:3], True, 101.0, silent_s) == expected
    assert restarted.target(survivors, honest[:3], True, 102.0, silent_s) == expected  # expired: gone, not unseen
    # its record expires before it looks quiet (a restarted peer's first reads find it unrenewed for less than its
    # horizon): a record that expired is gone too, not missed by a partial read; one that did not is unseen
    for gone, taken in ((lambda peer: peer == "dead", expected), (lambda peer: False, None), (None, None)):
        fresh_view = SwarmView("back", fast_s=1.0, idle_s=5.0)
        assert fresh_view.target({**survivors, "dead": record(honest[:3])}, honest[:3], True, 100.0, lambda _: 0.0) is None
        assert fresh_view.target(survivors, honest[:3], True, 101.0, lambda _: 0.0, gone) == taken



def test_a_search_whose_only_partner_at_its_step_was_killed_ends_as_stale():
    """Killed mid-averaging at step 5, a peer's record still shows step 5 until it expires: the search of a survivor
    whose other partner moved on to step 6 waited for it to its whole timeout. Quiet, it keeps no search alive."""
    honest = history("h", 6)
    records = view({"b": honest, "dead": honest[:6]})
    own = record(honest[:6])
    assert not SwarmView("a").moved_past(records, own, 5)
    assert SwarmView("a").moved_past(records, own, 5, {"b": 0.3, "dead": 9.0}.__getitem__)
    assert not SwarmView("a").moved_past(records, own, 5, {"b": 0.3, "dead": 3.0}.__getitem__)  # within 2 + 2 s


def test_made_says_what_each_peer_computed_for_a_step_and_ignores_what_is_malformed():
    """``made`` is a peer's word on the steps it averaged (a download later changes its chain, not this): the fork
    line of train/catch_up.py counts by it whose arithmetic differs."""
    a, b = "a" * 64, "b" * 64
    records = {
        "p1": {"outer_step": 7, "global_sha256": b, "made": [[5, a], [6, a]]},  # made 6 as a, downloaded b since
        "p2": {"outer_step": 6, "global_sha256": b, "made": [[6, b]]},
        "p3": {"outer_step": 6, "global_sha256": b},  # said nothing: left out, not counted as either
        "bad": {"made": [[6, "A" * 64], [True, a], [6], "66", [-1, a], [6, a[:-1]]]},
        "odd": {"made": "6"},
    }
    assert made_sha256(records, 6) == {"p1": a, "p2": b}
    assert made_sha256(records, 5) == {"p1": a} and made_sha256(records, 7) == {}
    # only the last MADE entries count: a record cannot list the whole run to seem to have made every step
    long = {"p": {"made": [[step, a] for step in range(3 * MADE)]}}
    assert made_sha256(long, 0) == {} and made_sha256(long, 2 * MADE) == {"p": a} and made_sha256(long, 2 * MADE - 1) == {}


def test_donors_holding_the_target_are_asked_first_then_the_furthest_heads():
    target = Target(5, sha("a5"), "majority")
    records = view({"holder": history("a", 5), "ahead": history("a", 7), "forked": history("b", 5), "behind": history("a", 3)})
    records["garbled"] = dict(outer_step="5", global_sha256=sha("a5"))
    ranks = donor_ranks(records, target)
    assert "garbled" not in ranks  # no well-formed head: left to the declared order, after every ranked donor
    assert sorted(ranks, key=ranks.get, reverse=True) == ["holder", "ahead", "forked", "behind"]
    # a liar that claims a further head on other bytes ranks below every holder of the target
    liar = view({"liar": history("x", 40)})
    assert donor_ranks({**records, **liar}, target)["liar"] < ranks["holder"]


def test_two_colluders_of_five_move_nobody_whatever_the_honest_peers_are_doing():
    """The records an honest peer read when it took two colluders' made-up step 7 (scripts/attack.py, colluders):
    it had averaged step 2; one honest peer was a step behind (its round failed), the late joiner still at the start,
    and the colluders vouched for our history up to step 2, then for their own. Counting only the peers on our
    history, two of three made a majority; two of the five live peers are none. Nor when the honest peers are quiet
    or unseen, nor at a later step where the colluders claim other bytes for ours (a tie they could grind for)."""
    made_up = [*history("h", 2), *history("x", 7, first=3)]
    moment = view({"b": history("h", 1), "c": history("h", 0), "x": made_up, "y": made_up})
    assert choose_target(moment, history("h", 2), fresh=False, own_id="a") is None
    for fresh, own in ((True, history("h", 0)), (False, history("h", 1)), (True, history("h", 1))):
        target = choose_target({**moment, "a": record(history("h", 2))}, own, fresh=fresh, own_id="c")
        assert target is None or not target.sha256.startswith(tuple(sha(f"x{k}")[:8] for k in range(3, 8)))
    colluders_only = view({"x": made_up, "y": made_up})
    for abstaining, unseen in ((2, 0), (0, 2), (1, 1)):  # the honest peers quiet (slow to publish) or missed by a read
        for fresh in (False, True):
            assert choose_target(colluders_only, history("h", 2), fresh, "a", unseen=unseen, abstaining=abstaining) is None
    # step 12: one honest peer at our head, one behind; the colluders at our step on bytes of their own
    theirs = [*history("h", 11), (12, sha("x12"))]
    later = view({"b": history("h", 12), "c": history("h", 10), "x": theirs, "y": theirs})
    assert choose_target(later, history("h", 12), fresh=False, own_id="a") is None
    # the same counts among honest peers only (a round split in two groups of two, the fifth behind): a fifth live
    # peer makes halves no longer the whole electorate, so nobody moves on the smaller hash until it catches up
    assert choose_target(later, history("h", 12), fresh=False, own_id="a", abstaining=0) is None


def test_a_node_only_colluders_vouch_for_is_never_taken_in_random_swarms():
    """Random swarms of up to 9 peers, honest ones at random heads of one honest history (fresh, behind, ahead,
    quiet, unseen), and colluders, fewer than half of the live peers, vouching for our history and then for a
    made-up one of their own, ahead or at our step: no rule returns a made-up node."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        live = rng.randint(3, 9)
        colluders = rng.randint(1, (live - 1) // 2)
        honest = live - colluders - 1  # this peer aside
        top = rng.randint(1, 30)
        own_step = rng.randint(0, top)
        heads = [rng.randint(0, top) for _ in range(honest)]
        quiet = rng.randint(0, honest)
        unseen = rng.randint(0, honest - quiet)
        fork = rng.randint(max(1, own_step - 3), own_step + 3)
        lead = rng.choice([0, 1, 2, 5])
        made_up = [*history("h", fork - 1, first=max(0, fork - 4)), *history("x", fork + lead, first=fork)]
        peers = {f"h{i}": history("h", step, first=max(0, step - CHAIN + 1))
                 for i, step in enumerate(heads[quiet + unseen:])}
        peers.update({f"x{i}": made_up for i in range(colluders)})
        for fresh in (False, True):
            target = choose_target(view(peers), history("h", own_step, first=max(0, own_step - CHAIN + 1)), fresh,
                                   "a", unseen=unseen, abstaining=quiet, settled=True)
            assert target is None or target.sha256 not in {node[1] for node in history("x", fork + lead, first=fork)}, (
                peers.keys(), own_step, fork, lead, unseen, quiet, fresh, target)
