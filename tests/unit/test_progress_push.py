"""The push transport of progress records (swarm/progress.py): which records are pushed and which go the DHT's way, and when
a read is local, when it asks the DHT and whom it then introduces itself to. The records' trip between real DHTs
is in tests/integration/test_progress_push.py."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from p2p_diloco.swarm.progress import DHT_EVERY, INTRODUCE_LIMIT, ProgressBeacon, ProgressReader


class _Done:
    def result(self, timeout: float | None = None) -> None:
        return None


def _beacon(sent: list[str], push: bool) -> ProgressBeacon:
    """A beacon whose own loop waits a minute before its first record: only the test publishes."""
    dht = SimpleNamespace(
        store=lambda key, subkey, value, expiration_time, return_future: sent.append("dht") or _Done(),
        run_coroutine=lambda coroutine, return_future: sent.append("push") or _Done(),
        peer_id=SimpleNamespace(to_base58=lambda: "me"),
    )
    beacon = ProgressBeacon(dht, "key", 60.0, 180.0, read_peers=dict, push=push)
    beacon.update(round=0)
    return beacon


def test_pushed_records_go_the_dhts_way_every_tenth_time_the_first_included():
    sent: list[str] = []
    beacon = _beacon(sent, push=True)
    try:
        for _ in range(2 * DHT_EVERY + 1):
            beacon.publish_now()
        beacon.publish_now(dht_store=True)
    finally:
        beacon.close()
    expected = (["dht"] + ["push"] * (DHT_EVERY - 1)) * 2 + ["dht", "dht"]
    assert sent == expected


def test_a_record_goes_the_dhts_way_again_before_its_copy_there_expires(monkeypatch):
    sent: list[str] = []
    clock = itertools.count(0.0, 50.0)  # 50 s between records: past 3/4 of the 180 s lifetime every 3rd one
    monkeypatch.setattr("p2p_diloco.swarm.progress.time.monotonic", lambda: next(clock))
    beacon = _beacon(sent, push=True)
    try:
        for _ in range(7):
            beacon.publish_now()
    finally:
        beacon._stop.set()
        beacon._wake.set()
    assert sent == ["dht", "push", "push", "dht", "push", "push", "dht"]


def test_the_tenth_record_is_counted_from_the_last_store_whatever_made_it_go(monkeypatch):
    sent: list[str] = []
    clock = itertools.count(0.0, 50.0)  # as above: the copy's lifetime sends every 3rd record the DHT's way
    monkeypatch.setattr("p2p_diloco.swarm.progress.time.monotonic", lambda: next(clock))
    beacon = _beacon(sent, push=True)
    try:
        for _ in range(4 * 3):
            beacon.publish_now()
    finally:
        beacon._stop.set()
        beacon._wake.set()
    # counted from the start, the 11th record would have gone the DHT's way too, right after the 10th
    assert DHT_EVERY == 10 and sent == ["dht", "push", "push"] * 4


def test_without_push_every_record_is_a_dht_store():
    sent: list[str] = []
    beacon = _beacon(sent, push=False)
    try:
        for _ in range(3):
            beacon.publish_now()
    finally:
        beacon.close()
    assert sent == ["dht"] * 3


def test_a_departure_goes_both_ways_the_push_first():
    sent: list[str] = []
    beacon = _beacon(sent, push=True)
    beacon.leave()
    assert sent == ["push", "dht"]


class _Swarm:
    """What a node holds locally and what the DHT holds, as ``read_progress_items`` returns them. A peer that pushes
    to us renews its record here at every local read (a later expiration); the others' stay as a DHT read left them."""

    def __init__(self, local: dict[str, dict], everywhere: dict[str, dict], pushing: set[str]):
        self.local, self.everywhere, self.pushing = local, everywhere, pushing
        self.reads: list[bool] = []
        self.pinged: list[list[str]] = []
        self._clock = itertools.count(1000.0)

    def read(self, dht, key, timeout_s=10.0, local=False):
        self.reads.append(local)
        now = next(self._clock)
        records = self.local if local else self.everywhere
        if not local:
            self.local.update(self.everywhere)  # hivemind merges what a DHT read found into the stored dictionary
        return {peer: (dict(record), now + 20.0 if peer in self.pushing or not local else 900.0)
                for peer, record in records.items()}


def _reader(swarm: _Swarm, push: bool, monkeypatch) -> ProgressReader:
    monkeypatch.setattr("p2p_diloco.swarm.progress.read_progress_items", swarm.read)
    dht = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me"),
                          run_coroutine=lambda coroutine, return_future: swarm.pinged.append(sorted(coroutine.keywords["peer_ids"])))
    return ProgressReader(dht, "run.progress", push)


def test_with_push_reads_are_local_but_the_first_and_every_tenth_which_ask_the_dht(monkeypatch):
    local = {"me": dict(round=1), "a": dict(round=1)}
    swarm = _Swarm(local, {**local, "b": dict(round=1)}, pushing={"a"})
    read = _reader(swarm, True, monkeypatch)
    seen = [set(read()) for _ in range(DHT_EVERY + 1)]
    assert swarm.reads == [False] + [True] * (DHT_EVERY - 1) + [False]
    # the first read is the whole swarm, not whoever pushed to a joiner first; our own record is never among them
    assert seen[0] == {"a", "b"} and seen[-1] == {"a", "b"}


def test_a_local_read_that_finds_nobody_asks_the_dht_at_once(monkeypatch):
    everywhere = {"me": dict(round=1)}
    swarm = _Swarm({"me": dict(round=1)}, everywhere, pushing=set())
    read = _reader(swarm, True, monkeypatch)
    assert read() == {}  # the first read asks the DHT: alone so far
    everywhere["a"] = dict(round=1)  # a peer joins and has not pushed to us yet
    assert set(read()) == {"a"}
    assert swarm.reads == [False, True, False]


def test_a_local_read_that_lost_a_peer_which_did_not_say_it_left_asks_the_dht(monkeypatch):
    local = {"a": dict(round=1), "b": dict(round=1)}
    swarm = _Swarm(local, dict(local), pushing={"a", "b"})
    read = _reader(swarm, True, monkeypatch)
    read()
    assert set(read()) == {"a", "b"}
    del local["b"]  # our routing tables dropped each other: its pushes stopped and its record expired here
    assert set(read()) == {"a", "b"}  # the DHT's other nodes still hold it
    assert swarm.reads == [False, True, True, False]


def test_a_peer_whose_record_was_not_renewed_here_is_pinged_and_not_again_soon_and_a_client_never(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("p2p_diloco.swarm.progress.time.monotonic", lambda: clock[0])
    local = {"a": dict(round=1), "b": dict(round=1)}  # "b" only as a DHT read left it: never renewed here
    swarm = _Swarm(local, {**local, "c": dict(round=1, client=True), "d": dict(round=1)}, pushing={"a"})
    read = _reader(swarm, True, monkeypatch)
    read()  # a joiner's first read: nobody has pushed to it yet, so it introduces itself to all it can dial
    assert swarm.pinged == [["a", "b", "d"]]  # "c" can't be dialled
    clock[0] += 600.0  # long after: each may be pinged again
    for _ in range(DHT_EVERY):
        read()
    assert swarm.reads[-1] is False and swarm.pinged[1:] == [["b", "d"]]  # "a" pushes to us
    for _ in range(DHT_EVERY):
        read()
    assert swarm.pinged[1:] == [["b", "d"]]  # pinged a minute ago at most: not again yet


def test_introductions_are_few_per_read(monkeypatch):
    strangers = {f"peer{i:02d}": dict(round=1) for i in range(3 * INTRODUCE_LIMIT)}
    swarm = _Swarm({}, strangers, pushing=set())
    read = _reader(swarm, True, monkeypatch)
    read()
    assert len(swarm.pinged) == 1 and len(swarm.pinged[0]) == INTRODUCE_LIMIT
    assert set(swarm.pinged[0]) <= set(strangers)


def test_without_push_every_read_asks_the_dht_and_nobody_is_pinged(monkeypatch):
    swarm = _Swarm({"a": dict(round=1)}, {"a": dict(round=1), "b": dict(round=1)}, pushing={"a"})
    read = _reader(swarm, False, monkeypatch)
    assert all(set(read()) == {"a", "b"} for _ in range(3))
    assert swarm.reads == [False] * 3 and swarm.pinged == []


def test_a_peer_is_silent_from_the_last_read_that_found_its_record_renewed(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("p2p_diloco.swarm.progress.time.monotonic", lambda: clock[0])
    local = {"a": dict(round=1), "b": dict(round=1)}
    swarm = _Swarm(local, dict(local), pushing={"a", "b"})
    read = _reader(swarm, True, monkeypatch)
    assert read.silent_s("a") == 0.0  # not read yet
    read()
    clock[0] = 3.0
    read()  # both renewed (a later expiration)
    swarm.pushing.discard("b")  # b is killed: its pushes stop, its record stays until it expires
    for t in (4.0, 5.0, 6.5):
        clock[0] = t
        read()
    assert read.silent_s("a") == 0.0 and read.silent_s("b") == 6.5 - 3.0
    clock[0] = 30.0  # our own reads stalled (or failed): silence is as of our latest read that answered
    assert read.silent_s("a") == 0.0 and read.silent_s("b") == 3.5
    swarm.pushing.add("b")  # back (thawed): the next read that finds it renewed resets its silence
    read()
    assert read.silent_s("b") == 0.0


def test_a_reader_knows_a_record_expired_after_it_is_gone(monkeypatch):
    """A peer a read lacks because its record expired is gone, not missed by a partial read (SwarmView's ``gone``): the
    reader keeps the latest expiration it found for each record, past the record itself."""
    dht_now = [1000.0]
    monkeypatch.setattr("p2p_diloco.swarm.progress.get_dht_time", lambda: dht_now[0])
    local = {"a": dict(round=1), "b": dict(round=1)}
    swarm = _Swarm(local, dict(local), pushing={"a", "b"})  # the n-th read finds expirations of 1000 + n + 20
    read = _reader(swarm, True, monkeypatch)
    assert not read.expired("a") and not read.expired("never read")
    read()
    read()
    assert not read.expired("a") and not read.expired("b")
    del swarm.local["b"], swarm.everywhere["b"]  # b was killed: its record expired and the DHT dropped it
    read()
    read()
    dht_now[0] = 1021.5  # past b's latest expiration (1021), before a's (1023)
    assert read.expired("b") and not read.expired("a")
