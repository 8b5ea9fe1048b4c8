"""What a peer reads from the others' progress records (core/swarm_view.py): what counts toward its round's budget
(the others' live records, less the senders its reducer left out of its latest averaging), and the weight limits."""

from __future__ import annotations

from p2p_diloco.core.bans import banned_by_majority
from p2p_diloco.core.link import RoundView
from p2p_diloco.core.swarm_view import SwarmView

NOW = 1e12  # the records' clock: they carry no time here, so nothing is extrapolated


def _view(left_out: frozenset[str] = frozenset(), banned: frozenset[str] = frozenset()) -> SwarmView:
    view = SwarmView("me")
    view.left_out, view.banned = left_out, banned
    return view


def test_a_sender_left_out_of_our_latest_averaging_does_not_count_in_the_round():
    records = {
        "honest": dict(round=4, round_tokens=1000, rate=0.0),
        "poisoner": dict(round=4, round_tokens=5000, rate=0.0),  # trains and publishes, but its parts are refused
        "ahead": dict(round=5, round_tokens=10, rate=0.0),
    }
    # one peer past the round of three in it or past it does not end it (test_one_peers_word_does_not_end_a_round)
    assert _view().round_view(records, 4, NOW) == RoundView(live_peers=3, tokens_by_others=6000, peers_ahead=0)
    # without the poisoner, the peer past the round is one of two: not most of them either
    assert _view(frozenset({"poisoner"})).round_view(records, 4, NOW) == RoundView(
        live_peers=2, tokens_by_others=1000, peers_ahead=0
    )
    # two of three past it end it; a left-out peer that is ahead is not one of them
    records["honest"]["round"] = 5
    assert _view().round_view(records, 4, NOW).peers_ahead == 2
    assert _view(frozenset({"poisoner"})).round_view(records, 4, NOW).peers_ahead == 2
    records["poisoner"]["round"], records["honest"]["round"] = 5, 4
    assert _view(frozenset({"poisoner"})).round_view(records, 4, NOW).peers_ahead == 0


def test_a_banned_peers_progress_bounds_its_weight_though_it_is_not_live():
    records = {
        "honest": dict(round=7, round_tokens=1000, rate=0.0),
        "banned": dict(round=7, round_tokens=1200, rate=0.0),  # a groupmate that has not banned it may let it in
    }
    view = _view(banned=frozenset({"banned"}))
    assert set(view.observe(records, NOW)) == {"honest"} and set(view.live(records)) == {"honest"}
    assert view.ledger.allowed(7) == {"honest": 1000.0, "banned": 1200.0}


def test_a_peer_most_of_the_swarm_banned_is_shunned_by_a_peer_that_never_met_it():
    records = {
        "honest0": dict(banned=["garbage"]),
        "honest1": dict(banned=["garbage"]),
        "garbage": dict(banned=["honest0", "honest1", "late"]),  # accusing back
    }
    everyone = frozenset(records)
    # voters: late (us), honest0, honest1; 2 of 3 banned it. The garbage reducer's accusations: 1 vote each
    assert banned_by_majority(records, "late", frozenset(), everyone) == {"garbage"}
    # one peer's word is not enough: 1 of 3 voters
    assert banned_by_majority({**records, "honest1": {}}, "late", frozenset(), everyone) == frozenset()
    # nor is a tie: 2 of 4 voters
    assert banned_by_majority({**records, "honest2": {}}, "late", frozenset(), everyone | {"honest2"}) == frozenset()
    # a peer we banned ourselves gets no vote, and is not reported again
    assert banned_by_majority(records, "late", frozenset({"garbage"}), everyone) == frozenset()
    # only peers known to have averaged vote: records under made-up ids (anyone can write one) count for nothing
    sybils = {f"sybil{k}": dict(banned=["honest0"]) for k in range(5)}
    assert banned_by_majority({**records, **sybils}, "late", frozenset(), everyone) == {"garbage"}
    assert banned_by_majority(records, "late", frozenset(), frozenset({"honest0"})) == frozenset()  # 1 of 2 voters
    # nobody can get us shunned in our own eyes, nor a peer banned through its own record
    ab = frozenset({"a", "b"})
    assert banned_by_majority({"a": dict(banned=["late", "a"]), "b": dict(banned=["late"])}, "late", frozenset(), ab) == frozenset()
    # malformed records count as no ban
    assert banned_by_majority({"a": dict(banned="garbage"), "b": dict(banned=[3, None])}, "late", frozenset(), ab) == frozenset()


def test_a_shunned_peer_is_not_live_but_its_progress_still_bounds_its_weight():
    records = {
        "honest0": dict(round=3, round_tokens=1000, rate=0.0, banned=["garbage"]),
        "honest1": dict(round=3, round_tokens=1100, rate=0.0, banned=["garbage"]),
        "garbage": dict(round=3, round_tokens=1200, rate=0.0),
    }
    view = _view()
    assert set(view.observe(records, NOW)) == {"honest0", "honest1", "garbage"}  # no voter known to have averaged yet
    view.participants = frozenset({"honest0", "honest1", "garbage"})  # e.g. from a downloaded state's history
    assert set(view.observe(records, NOW)) == {"honest0", "honest1"} and set(view.live(records)) == {"honest0", "honest1"}
    assert view.shunned == {"garbage"}
    assert view.ledger.allowed(3)["garbage"] == 1200.0


def test_a_record_with_an_infinite_or_nan_rate_counts_its_tokens_and_breaks_nothing():
    # int() of an infinite extrapolation raised OverflowError in round_view, which the training loop calls every step
    records = {
        "inf": dict(round=4, round_tokens=1000, rate=float("inf"), time=0.0),
        "nan": dict(round=4, round_tokens=2000, rate=float("nan"), time=0.0),
        "huge": dict(round=4, round_tokens=3000, rate=1e308, time=0.0),  # finite, but rate x age is not
    }
    assert _view().round_view(records, 4, NOW) == RoundView(live_peers=3, tokens_by_others=6000, peers_ahead=0)


def test_at_the_planned_end_only_peers_we_count_are_waited_for_as_behind():
    records = {
        "slow": dict(outer_step=14),
        "done": dict(outer_step=16),
        "claimer": dict(outer_step=3),  # banned for claims no majority backed: it stays at a step of its own
        "shunned": dict(outer_step=2),
        "no step": dict(),
    }
    view = _view()
    assert view.behind(records, 16) == 4
    view.history_banned, view.shunned = frozenset({"claimer"}), frozenset({"shunned"})
    assert view.behind(records, 16) == 2  # "slow" and the record with no step yet
    assert view.behind(records, 14) == 1


def test_a_group_does_not_wait_for_a_peer_whose_record_went_quiet():
    view = SwarmView("me", fast_s=1.0, idle_s=5.0)
    records = {
        "training": dict(round=3, period=1.0),
        "killed": dict(round=3, period=1.0),  # its record lives on until it expires
        "idle": dict(round=3, period=5.0),  # publishes every 5 s while its round's end is far
        "liar": dict(round=3, period=1e9),  # a period past the idle one counts as the idle one
    }
    silent = {"training": 0.8, "killed": 4.5, "idle": 9.0, "liar": 12.5}
    # horizon: two periods (at least ours, at most the idle one), then 2 s of slack
    assert view.group_target(records, silent.__getitem__) == (1 + 4 - 2, ["killed", "liar"])
    silent["killed"] = 3.9  # within 2 x 1 s + 2 s: still waited for
    assert view.group_target(records, silent.__getitem__) == (1 + 4 - 1, ["liar"])
    view.period_now_s = 5.0  # our own reads come every 5 s: a renewal may show that late
    silent["killed"] = 11.9
    assert view.group_target(records, silent.__getitem__) == (1 + 4 - 1, ["liar"])
    # everyone quiet: still a group of 2 at least (a target of 1 would step alone at once, and refuse every joiner)
    assert view.group_target(records, lambda peer: 60.0) == (2, ["idle", "killed", "liar", "training"])
    assert view.group_target({}, lambda peer: 60.0) == (1, [])


def test_one_peers_word_does_not_end_a_round_most_of_them_do_and_so_does_a_later_outer_step():
    """A peer past our round ends it for us only as most of the peers in it or past it, or as one at a later outer
    step than the round (we are behind). One liar claiming the next round ended every honest peer's rounds at once:
    honest tokens per outer step fell 4x and their tokens/s 28% (docs/security.md, "The pace of the rounds")."""
    view = SwarmView("me")
    records = {"a": dict(round=4, outer_step=4, round_tokens=1000), "b": dict(round=4, outer_step=4, round_tokens=900),
               "liar": dict(round=4, outer_step=4, round_tokens=800)}
    view.observe(records, NOW)  # the ledger: what each published for round 4
    records["liar"] = dict(round=5, outer_step=4, round_tokens=0)  # "averaging step 4 already"
    seen = view.round_view(records, 4, NOW)
    assert seen.peers_ahead == 0 and seen.tokens_by_others == 1000 + 900 + 800  # it counts for what it published in 4
    liar_alone = {"a": records["a"], "b": records["b"], "liar": dict(round=5, outer_step=4, round_tokens=0)}
    assert SwarmView("me").round_view(liar_alone, 4, NOW).tokens_by_others == 1900  # it never published round 4: 0
    # most of them past it: the round is over
    records["a"] = dict(round=5, outer_step=4)
    assert view.round_view(records, 4, NOW).peers_ahead == 2
    # one peer a whole outer step past our round: it averaged step 4 without us, we are behind
    records["a"] = dict(round=5, outer_step=5)
    records["liar"] = dict(round=4, outer_step=4, round_tokens=800)
    assert view.round_view(records, 4, NOW).peers_ahead == 1
    # ... but not where it is only one round past (averaging the step we train for)
    records["a"] = dict(round=5, outer_step=4)
    assert view.round_view(records, 4, NOW).peers_ahead == 0
    # a swarm of two: the other peer is all of "most of them"
    assert SwarmView("me").round_view({"a": dict(round=5, outer_step=4)}, 4, NOW).peers_ahead == 1
    # while we average step 4 (our round is 5), a peer that averaged it already and trains round 5 is not past us
    assert SwarmView("me").round_view({"a": dict(round=5, outer_step=5), "b": dict(round=5, outer_step=4)}, 5,
                                      NOW).peers_ahead == 0
    # a malformed round or step ends nothing
    bad = {"a": dict(round=float("inf"), outer_step=9), "b": dict(round=True, outer_step=9)}
    assert SwarmView("me").round_view(bad, 4, NOW).peers_ahead == 0


def test_a_peer_counts_for_at_most_share_cap_medians_of_the_rounds_tokens_ours_included():
    """A peer that publishes more than it trains must not end the rounds sooner: each peer's tokens count towards a
    round's end at most share_cap x the upper median of the round's tokens per peer, with 3 peers or more."""
    own = dict(round=4, round_tokens=900)
    records = {"h1": dict(round=4, round_tokens=1000), "h2": dict(round=4, round_tokens=1100),
               "liar": dict(round=4, round_tokens=7000)}  # the weight liar published 7x what it trained
    capped = SwarmView("me", share_cap=2.0).round_view(records, 4, NOW, own)
    # tokens per peer 900 (us), 1000, 1100, 7000: upper median 1100, cap 2200
    assert capped == RoundView(live_peers=3, tokens_by_others=1000 + 1100 + 2200, peers_ahead=0, share_cap=2200)
    records["liar"]["round_tokens"] = 2199  # just under the cap: counted whole
    assert SwarmView("me", share_cap=2.0).round_view(records, 4, NOW, own).tokens_by_others == 1000 + 1100 + 2199
    # the median is the swarm's, not the liar's: two honest peers and one liar still cap it
    two = {"h1": dict(round=4, round_tokens=1000), "liar": dict(round=4, round_tokens=50_000)}
    assert SwarmView("me", share_cap=2.0).round_view(two, 4, NOW, own).tokens_by_others == 1000 + 2000
    # our own record in another round (just restarted, not yet published) counts 0 in the median
    assert SwarmView("me", share_cap=2.0).round_view(two, 4, NOW, dict(round=3, round_tokens=5000)).share_cap == 2000
    # with one other peer there is no median to hold it to; with share_cap 0 nothing is capped
    assert SwarmView("me", share_cap=2.0).round_view({"liar": two["liar"]}, 4, NOW, own).share_cap is None
    assert SwarmView("me").round_view(records, 4, NOW, own).share_cap is None
