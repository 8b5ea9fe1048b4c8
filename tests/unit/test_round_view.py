"""What a peer reads from the others' progress records (swarm.py): what counts toward its round's budget (the
others' live records, less the senders its reducer left out of its latest averaging), and the weight limits."""

from __future__ import annotations

from types import SimpleNamespace

from p2p_diloco.config import SwarmConfig
from p2p_diloco.link import RoundView
from p2p_diloco.robust import TokenLedger, banned_by_majority
from p2p_diloco.swarm import ProgressReader, SwarmLink


def _link(records: dict[str, dict], left_out: frozenset[str]) -> SwarmLink:
    link = SwarmLink.__new__(SwarmLink)  # no DHT: round_view reads only the beacon's records and the left-out set
    link.config = SwarmConfig()
    link._period_now = link.config.progress_period_s
    link._beacon = SimpleNamespace(peers=records)
    link._left_out = left_out
    link._shunned, link._participants, link._history_banned = frozenset(), frozenset(), frozenset()
    return link


def test_a_sender_left_out_of_our_latest_averaging_does_not_count_in_the_round():
    records = {
        "honest": dict(round=4, round_tokens=1000, rate=0.0),
        "poisoner": dict(round=4, round_tokens=5000, rate=0.0),  # trains and publishes, but its parts are refused
        "ahead": dict(round=5, round_tokens=10, rate=0.0),
    }
    assert _link(records, frozenset()).round_view(4) == RoundView(live_peers=3, tokens_by_others=6000, peers_ahead=1)
    assert _link(records, frozenset({"poisoner"})).round_view(4) == RoundView(
        live_peers=2, tokens_by_others=1000, peers_ahead=1
    )
    # a left-out peer that is ahead does not end our round either
    records["poisoner"]["round"] = 5
    assert _link(records, frozenset({"poisoner"})).round_view(4).peers_ahead == 1


def test_a_banned_peers_progress_bounds_its_weight_though_it_is_not_live(monkeypatch):
    records = {
        "me": dict(round=7, round_tokens=900, rate=0.0),
        "honest": dict(round=7, round_tokens=1000, rate=0.0),
        "banned": dict(round=7, round_tokens=1200, rate=0.0),  # a groupmate that has not banned it may let it in
    }
    monkeypatch.setattr("p2p_diloco.swarm.read_progress_items", lambda dht, key, **_: {k: (dict(v), 1e12) for k, v in records.items()})
    link = _link({}, frozenset())
    link.dht, link._progress_key, link.peer_id = None, "run.progress", "me"
    link._reader = ProgressReader(SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me")), "run.progress", push=False)
    link._banned, link._ledger = frozenset({"banned"}), TokenLedger()
    assert set(link._read_progress()) == {"honest"} and set(link.live_peers()) == {"honest"}
    assert link._ledger.allowed(7) == {"honest": 1000.0, "banned": 1200.0}


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


def test_a_shunned_peer_is_not_live_but_its_progress_still_bounds_its_weight(monkeypatch):
    records = {
        "me": dict(round=3, round_tokens=900, rate=0.0),
        "honest0": dict(round=3, round_tokens=1000, rate=0.0, banned=["garbage"]),
        "honest1": dict(round=3, round_tokens=1100, rate=0.0, banned=["garbage"]),
        "garbage": dict(round=3, round_tokens=1200, rate=0.0),
    }
    monkeypatch.setattr("p2p_diloco.swarm.read_progress_items", lambda dht, key, **_: {k: (dict(v), 1e12) for k, v in records.items()})
    link = _link({}, frozenset())
    link.dht, link._progress_key, link.peer_id = None, "run.progress", "me"
    link._reader = ProgressReader(SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me")), "run.progress", push=False)
    link._banned, link._ledger, link._participants = frozenset(), TokenLedger(), frozenset()
    assert set(link._read_progress()) == {"honest0", "honest1", "garbage"}  # no voter known to have averaged yet
    link._participants = frozenset({"honest0", "honest1", "garbage"})  # e.g. from a downloaded state's history
    assert set(link._read_progress()) == {"honest0", "honest1"} and set(link.live_peers()) == {"honest0", "honest1"}
    assert link._shunned == {"garbage"}
    assert link._ledger.allowed(3)["garbage"] == 1200.0


def test_a_record_with_an_infinite_or_nan_rate_counts_its_tokens_and_breaks_nothing():
    # int() of an infinite extrapolation raised OverflowError in round_view, which the training loop calls every step
    records = {
        "inf": dict(round=4, round_tokens=1000, rate=float("inf"), time=0.0),
        "nan": dict(round=4, round_tokens=2000, rate=float("nan"), time=0.0),
        "huge": dict(round=4, round_tokens=3000, rate=1e308, time=0.0),  # finite, but rate x age is not
    }
    assert _link(records, frozenset()).round_view(4) == RoundView(live_peers=3, tokens_by_others=6000, peers_ahead=0)
