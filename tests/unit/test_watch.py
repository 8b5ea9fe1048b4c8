"""SwarmWatch: progress records in, a bounded and checked picture of the swarm out (what the monitor shows)."""

from __future__ import annotations

import json

import pytest

from p2p_diloco.observe import watch as watch_module
from p2p_diloco.observe.watch import SwarmWatch, pack_stats, unpack_stats


class Clock:
    def __init__(self, now: float = 1_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _record(step: int, tokens: int, at: float, loss: float | None = 2.5, eval_loss: float | None = None, **extra) -> dict:
    metrics = dict(outer_step=step, loss=loss, eval_loss=eval_loss, group_size=2, bytes_sent_total=1000 * step,
                   bytes_received_total=900 * step)
    return dict(outer_step=step, round=step, round_tokens=0, tokens=tokens, rate=50.0, time=at,
                global_sha256=f"sha{step}", stats=pack_stats(metrics), **extra)


def test_stats_round_trip_and_stay_small():
    record = dict(outer_step=7, loss=2.4312, eval_loss=None, group_size=3, bytes_sent_total=123_456_789,
                  bytes_received_total=5)
    packed = pack_stats(record)
    assert packed == [7, 2431, None, 3, 123_456_789, 5]
    assert unpack_stats(packed) == dict(stats_step=7, loss=2.431, eval_loss=None, group_size=3,
                                        bytes_sent=123_456_789, bytes_received=5)
    from hivemind.utils.serializer import MSGPackSerializer

    assert len(MSGPackSerializer.dumps(dict(stats=packed))) <= 24  # bytes added to every progress record


@pytest.mark.parametrize("value", [None, "x", 3, {}, [1, 2], ["a", "b", "c", "d", "e", "f"],
                                   [True, float("nan"), 10**30, -1, 2.5, [1]]])
def test_malformed_stats_are_missing_values_never_errors(value):
    unpacked = unpack_stats(value)
    if unpacked is not None:
        assert all(v is None or isinstance(v, int | float) for v in unpacked.values())
        assert unpacked["stats_step"] is None and unpacked["group_size"] is None


def test_records_from_strangers_are_checked_and_the_snapshot_is_strict_json():
    clock = Clock()
    watch = SwarmWatch("run", self_id="me", clock=clock)
    watch.observe({
        "me": _record(3, 300, clock.now),
        "nan": dict(outer_step=float("nan"), tokens=float("inf"), rate=-5, time="now", global_sha256=123, stats="x"),
        "huge": dict(outer_step=10**40, tokens=True, stats=[1] * 10_000),
        "not-a-dict": ["outer_step", 3],
        7: dict(outer_step=1),
        "x" * 1000: dict(outer_step=1),
    })
    snapshot = watch.snapshot()
    json.dumps(snapshot, allow_nan=False)  # what the page parses: a NaN would break it
    by_id = {p["peer_id"]: p for p in snapshot["peers"]}
    assert set(by_id) == {"me", "nan", "huge"}
    assert snapshot["peers"][0]["peer_id"] == "me" and by_id["me"]["is_self"]
    assert by_id["nan"]["outer_step"] is None and by_id["nan"]["tokens_per_s"] is None
    assert by_id["huge"]["outer_step"] is None and by_id["huge"]["tokens"] is None
    assert by_id["me"]["loss"] == 2.5 and by_id["me"]["bytes_sent"] == 3000


def test_a_point_per_new_metrics_record_and_since_returns_only_newer_points():
    clock = Clock()
    watch = SwarmWatch("run", clock=clock)
    for second in range(6):  # a record every second, a new outer step every other second
        clock.now = 1_000.0 + second
        step = second // 2
        watch.observe({"a": _record(step, 100 * second, clock.now, loss=3.0 - step, eval_loss=4.0 - step)})
    (peer,) = watch.snapshot()["peers"]
    assert [point[1:] for point in peer["history"]] == [[0, 3.0, 4.0], [1, 2.0, 3.0], [2, 1.0, 2.0]]
    assert peer["history_points"] == 3 and peer["eval_loss"] == 2.0
    newer = watch.snapshot(since=peer["history"][1][0])["peers"][0]["history"]
    assert [point[1] for point in newer] == [2]


def test_own_records_give_every_point_once_even_between_polls():
    clock = Clock()
    watch = SwarmWatch("run", self_id="me", clock=clock)
    metrics = [dict(peer_id="me", outer_step=step, loss=2.0 + step, eval_loss=None, group_size=1,
                    bytes_sent_total=0, bytes_received_total=0) for step in range(3)]
    for record in metrics:  # three records within one poll period
        watch.write(record)
    clock.now += 1
    watch.observe({"me": dict(outer_step=2, tokens=10, time=clock.now, stats=pack_stats(metrics[-1]))})
    (peer,) = watch.snapshot()["peers"]
    assert [point[1] for point in peer["history"]] == [0, 1, 2]  # the poll of the last one adds nothing


def test_tokens_per_s_from_the_records_and_a_restart_starts_afresh():
    clock = Clock()
    watch = SwarmWatch("run", clock=clock)
    for second in range(5):
        clock.now = 1_000.0 + second
        watch.observe({"a": _record(0, 2_000 * second, clock.now)})
    assert watch.snapshot()["peers"][0]["tokens_per_s"] == pytest.approx(2_000)
    clock.now += 1
    watch.observe({"a": _record(0, 10, clock.now)})  # restarted from a checkpoint: fewer tokens than before
    assert watch.snapshot()["peers"][0]["tokens_per_s"] == pytest.approx(50.0)  # its published rate, until two records


def test_live_gone_forgotten_agreement_and_a_bound_on_peers(monkeypatch):
    clock = Clock()
    watch = SwarmWatch("run", forget_after_s=60, clock=clock)
    watch.observe({"a": _record(4, 1, clock.now), "b": _record(4, 1, clock.now), "c": _record(3, 1, clock.now)})
    swarm = watch.snapshot()["swarm"]
    assert swarm["live_peers"] == 3 and swarm["outer_step"] == 4 and swarm["agree"] is True
    forked = dict(_record(4, 1, clock.now), global_sha256="other")
    watch.observe({"a": _record(4, 1, clock.now), "b": forked})
    snapshot = watch.snapshot()
    assert snapshot["swarm"]["agree"] is False
    assert {p["peer_id"]: p["live"] for p in snapshot["peers"]} == {"a": True, "b": True, "c": False}
    clock.now += 61
    watch.observe({"a": _record(5, 1, clock.now)})
    assert [p["peer_id"] for p in watch.snapshot()["peers"]] == ["a"]
    assert watch.snapshot()["swarm"]["agree"] is None  # no two peers at one step

    monkeypatch.setattr(watch_module, "MAX_PEERS", 5)
    watch.observe({f"p{i}": _record(1, 1, clock.now) for i in range(20)})
    assert len(watch.snapshot()["peers"]) == 5


def test_the_polling_thread_survives_a_failing_reader():
    calls = []

    def read() -> dict:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("DHT hiccup")
        return {"a": _record(1, 1, 1_000.0)}

    watch = SwarmWatch("run", period_s=0.05)
    watch.start(read)
    try:
        import time

        deadline = time.monotonic() + 5
        while not watch.snapshot()["peers"] and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watch.close()
    assert len(calls) >= 2 and watch.snapshot()["peers"][0]["peer_id"] == "a"


def test_a_full_history_is_thinned_and_keeps_the_whole_run():
    clock = Clock()
    watch = SwarmWatch("run", history_points=10, clock=clock)
    for step in range(25):
        clock.now += 1
        watch.observe({"a": _record(step, step, clock.now, loss=float(step))})
    (peer,) = watch.snapshot()["peers"]
    steps = [point[1] for point in peer["history"]]
    assert len(steps) <= 10 and steps[0] <= 4 and steps[-1] == 24 and steps == sorted(steps)
