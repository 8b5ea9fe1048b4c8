"""How often a peer publishes and reads progress records (core/swarm_view.py ``ProgressPace``): the short period
near a round's end, while averaging, at start and when the live peers change; the idle period otherwise. And how far
a record is extrapolated (``horizon_s``): by the period it says it was published under, within our own two."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.core.config import SwarmConfig
from p2p_diloco.core.swarm_view import ProgressPace, horizon_s, tokens_now, well_formed
from p2p_diloco.swarm.progress import ProgressBeacon

FAST, IDLE, TTL = 1.0, 5.0, 20.0


class Pace:
    """A ProgressPace past its start window, over fixed records (``peers`` may change between calls)."""

    def __init__(self, own: dict, peers: dict[str, dict], fast: float = FAST, idle: float = IDLE):
        self.own, self.peers, self.averaging = own, peers, False
        self.pace = ProgressPace(fast, idle, TTL, now=time.monotonic() - 1e6)
        self.pace.next_period(own, dict(peers), False, time.monotonic(), get_dht_time())  # the members seen so far
        self.pace.fast_until = 0.0  # ... without their arrival making the pace fast

    def __call__(self) -> float:
        return self.pace.next_period(self.own, dict(self.peers), self.averaging, time.monotonic(), get_dht_time())

    def seconds_to_round_end(self) -> float:
        return self.pace.seconds_to_round_end(self.own, self.peers, get_dht_time(), FAST)


def _record(round_index: int, tokens: int, rate: float, **extra: object) -> dict:
    return dict(round=round_index, round_tokens=tokens, rate=rate, time=get_dht_time(), **extra)


def test_the_round_end_is_budget_less_the_swarm_tokens_over_the_swarm_rate():
    own = _record(3, 10_000, 1000.0, round_budget=100_000)
    peers = {"a": _record(3, 20_000, 1000.0), "b": _record(2, 50_000, 9000.0)}  # b is still in the last round
    assert Pace(own, peers).seconds_to_round_end() == pytest.approx(35.0, abs=0.5)
    peers["c"] = _record(4, 0, 1000.0)  # someone already moved on: the round is over
    assert Pace(own, peers).seconds_to_round_end() == 0.0


@pytest.mark.parametrize("broken", [dict(round_budget=None), dict(round_budget="x"), dict(round=None), {}])
def test_an_unknown_budget_or_round_means_the_end_may_be_near(broken):
    own = {**_record(3, 10_000, 1000.0, round_budget=100_000), **broken}
    if not broken:
        del own["round_budget"]
    assert Pace(own, {}).seconds_to_round_end() == 0.0


def test_hostile_rates_are_skipped_and_nobody_training_means_near():
    own = _record(3, 10_000, 0.0, round_budget=100_000)
    peers = {"nan": _record(3, 0, float("nan")), "inf": _record(3, 0, float("inf")), "text": _record(3, 0, "fast")}
    assert Pace(own, peers).seconds_to_round_end() == 0.0  # no usable rate at all
    peers["honest"] = _record(3, 0, 500.0)
    assert Pace(own, peers).seconds_to_round_end() == pytest.approx(180.0, abs=2.0)


def test_pace_is_idle_only_when_the_end_is_far_and_nothing_changes():
    far = _record(3, 0, 1000.0, round_budget=100_000)  # 50 s to go at the two peers' 2,000 tokens/s
    near = _record(3, 90_000, 1000.0, round_budget=100_000)  # 5 s: under 3 idle periods
    peers = {"a": _record(3, 0, 1000.0)}
    assert Pace(far, peers)() == IDLE
    assert Pace(near, peers)() == FAST
    pace = Pace(far, peers)
    pace.averaging = True
    assert pace() == FAST
    pace = Pace(far, peers)
    pace.pace.fast_until = time.monotonic() + 60  # just started
    assert pace() == FAST


def test_a_peer_joining_makes_the_pace_fast_for_three_idle_periods_a_missed_read_does_not():
    own = _record(3, 0, 1000.0, round_budget=1_000_000)
    peers = {"a": _record(3, 0, 1000.0)}
    pace = Pace(own, peers)
    assert pace() == IDLE
    peers["joiner"] = _record(0, 0, 0.0)
    before = time.monotonic()
    assert pace() == FAST
    assert pace.pace.fast_until >= before + 3 * IDLE
    assert pace() == FAST  # still, though the members are now the known ones
    pace.pace.fast_until = 0.0
    assert pace() == IDLE
    record = peers.pop("a")
    assert pace() == IDLE  # one read without a known peer (a partial DHT answer): no change
    peers["a"] = record
    assert pace() == IDLE  # and back: no joiner either
    pace.pace._seen["a"] = time.monotonic() - TTL - 1
    assert pace() == FAST  # unseen for longer than a record lives: it joins anew


def test_equal_periods_mean_a_constant_pace():
    own = _record(3, 0, 1000.0, round_budget=1_000_000)
    assert Pace(own, {}, fast=2.0, idle=2.0)() == 2.0


@pytest.mark.parametrize(
    "period, horizon",
    [(None, 2 * FAST), (IDLE, 2 * IDLE), (3.0, 6.0), (1e9, 2 * IDLE), (0.0, 2 * FAST), ("x", 2 * FAST), (float("nan"), 2 * FAST)],
)
def test_a_record_is_extrapolated_by_its_own_period_within_ours(period, horizon):
    record = _record(3, 0, 1000.0) if period is None else _record(3, 0, 1000.0, period=period)
    assert horizon_s(record, FAST, IDLE, FAST) == horizon


def test_a_record_read_at_the_idle_pace_is_extrapolated_as_far_as_it_may_be_stale():
    # we read every 5 s: a record published every second may be 6 s old
    assert horizon_s(_record(3, 0, 1000.0, period=FAST), FAST, IDLE, IDLE) == 2 * IDLE


def test_config_idle_period_is_automatic_or_at_least_the_period_and_fits_the_ttl():
    assert SwarmConfig().idle_period_s == 5.0
    assert SwarmConfig(progress_period_s=6.0).idle_period_s == 6.0  # a period that was valid before stays valid
    assert SwarmConfig(progress_idle_period_s=3.0).idle_period_s == 3.0
    for bad in (0.5, -1.0, float("nan")):
        with pytest.raises(ValueError, match="progress_idle_period_s must be 0 .automatic. or at least"):
            SwarmConfig(progress_idle_period_s=bad)
    with pytest.raises(ValueError, match="progress_ttl_s must be at least 3x swarm.progress_idle_period_s"):
        SwarmConfig(progress_idle_period_s=10.0, progress_ttl_s=20.0)


def test_a_smaller_budget_or_a_deadline_of_a_peer_in_our_round_brings_the_end_nearer():
    own = _record(3, 0, 1000.0, round_budget=100_000)
    peers = {"a": _record(3, 0, 1000.0, round_budget=20_000)}
    assert Pace(own, peers).seconds_to_round_end() == pytest.approx(10.0, abs=0.5)
    peers = {"a": _record(3, 0, 1000.0, round_deadline=get_dht_time() + 7.0)}
    assert Pace(own, peers).seconds_to_round_end() == pytest.approx(7.0, abs=0.5)
    peers = {"other round": _record(2, 0, 1000.0, round_budget=1)}  # only budgets of our own round count
    assert Pace(own, peers).seconds_to_round_end() == pytest.approx(100.0, abs=1.0)


@pytest.mark.parametrize(
    "field, value",
    [("round", float("inf")), ("rate", float("nan")), ("time", float("-inf")), ("round_tokens", "many"),
     ("period", True), ("round_budget", [1]), ("outer_step", float("inf"))],
)
def test_records_with_non_finite_or_non_numeric_fields_are_dropped(field, value):
    assert well_formed(_record(3, 0, 1000.0))
    assert not well_formed({**_record(3, 0, 1000.0), field: value})
    assert not well_formed("a record that is not a dict")


def test_extrapolation_survives_huge_rates_and_clamps_negative_tokens():
    now = get_dht_time()
    assert tokens_now(dict(round_tokens=5, rate=1e308, time=now - 5), now, 10.0) == 5  # rate x age overflows
    assert tokens_now(dict(round_tokens=-10**9, rate=0.0, time=now), now, 10.0) == 0


def test_publishing_a_new_round_or_end_wakes_the_beacon_and_a_plan_keeps_the_record_time():
    dht = SimpleNamespace(store=lambda *args, **kwargs: None, peer_id=SimpleNamespace(to_base58=lambda: "me"))
    beacon = ProgressBeacon(dht, "key", 60.0, 200.0, read_peers=dict)
    woken: list[bool] = []
    try:
        beacon.wake = lambda: woken.append(True)
        beacon.update(round=3, round_tokens=100, time=1.0)
        beacon.set(round_budget=1000)
        assert beacon.own_record()["time"] == 1.0 and woken == [True]  # no new tokens: the time is its tokens'
        beacon.set(round_budget=1000)
        assert woken == [True]  # unchanged: nothing to hurry
        beacon.set(round=3, round_tokens=200)
        assert beacon.own_record()["time"] > 1.0 and woken == [True]
        beacon.set(round=4, round_tokens=0)
        assert woken == [True, True]
    finally:
        beacon.close()


def test_the_beacon_publishes_at_its_pace_and_says_which():
    stored: list[dict] = []
    published = threading.Event()

    def store(key, subkey, value, expiration_time, return_future):
        stored.append(value)
        if len(stored) >= 3:
            published.set()

    dht = SimpleNamespace(store=store, peer_id=SimpleNamespace(to_base58=lambda: "me"))
    paces = iter([0.01, 0.02, 0.03] + [0.05] * 1000)
    beacon = ProgressBeacon(dht, "key", 0.01, 20.0, read_peers=dict, pace=lambda: next(paces))
    try:
        beacon.update(round=0)
        assert published.wait(5.0), "the beacon did not publish 3 records in 5 s at a pace of 10-30 ms"
    finally:
        beacon.close()
    assert [record["period"] for record in stored[:3]] == [0.01, 0.02, 0.03]


def _beacon(stored: list[dict], pace) -> ProgressBeacon:
    dht = SimpleNamespace(store=lambda key, subkey, value, expiration_time, return_future: stored.append(value),
                          peer_id=SimpleNamespace(to_base58=lambda: "me"))
    beacon = ProgressBeacon(dht, "key", 0.01, 20.0, read_peers=dict, pace=pace)
    beacon.update(round=0)
    return beacon


def test_a_woken_beacon_publishes_at_once_though_its_pace_is_long():
    stored: list[dict] = []
    beacon = _beacon(stored, pace=lambda: 60.0)
    try:
        deadline = time.monotonic() + 5.0
        while not stored and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(stored) == 1  # the first record, then a 60 s wait
        beacon.wake()
        while len(stored) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(stored) == 2
    finally:
        beacon.close()


def test_a_pace_that_raises_falls_back_to_the_period_and_publishing_goes_on():
    stored: list[dict] = []

    def broken() -> float:
        raise OverflowError("cannot convert float infinity to integer")

    beacon = _beacon(stored, pace=broken)
    try:
        deadline = time.monotonic() + 5.0
        while len(stored) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(stored) >= 3 and stored[-1]["period"] == 0.01
    finally:
        beacon.close()
