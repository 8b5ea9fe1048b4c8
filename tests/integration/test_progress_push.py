"""Progress records pushed between real DHTs on 127.0.0.1 (swarm/progress.py ``push_record``): a push reaches every peer the
pusher knows, with no DHT search, and a local read there finds it; in a closed run a non-member's push is refused
as its DHT store would be; beacons that push keep three peers' views complete."""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import pytest
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.core.config import SwarmConfig
from p2p_diloco.swarm.joining import start_dht
from p2p_diloco.swarm.membership import RunMembership
from p2p_diloco.swarm.progress import ProgressBeacon, introduce, push_record, read_progress

from .harness import eventually

pytestmark = pytest.mark.integration
_KEY = "push-test.progress"


def _swarm(count: int, key_files: list[Path | None]) -> list[DHT]:
    dhts: list[DHT] = []
    try:
        for index in range(count):
            key_file = key_files[index]
            validators = RunMembership.from_files(str(key_file) if key_file else None, None, None).validators
            initial = tuple(str(a) for a in dhts[0].get_visible_maddrs()) if dhts else ()
            config = SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=initial)
            dhts.append(start_dht(config, validators))
    except BaseException:
        for dht in dhts:
            dht.shutdown()
        raise
    return dhts


def _push(dht: DHT, value: dict) -> int:
    push = partial(push_record, key=_KEY, subkey=dht.peer_id.to_base58(), value=value,
                   expiration_time=get_dht_time() + 30.0)
    return dht.run_coroutine(push)


async def _known_peers(dht: DHT, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _stored(dht: DHT, node) -> list[str]:
    """The subkeys (peer ids) under the key in this node's storage itself: no search, no cache."""
    item = node.protocol.storage.get(DHTID.generate(source=_KEY))
    return sorted(str(subkey) for subkey, _ in item.value.items()) if item is not None else []


def _holds(dht: DHT, peer: DHT) -> bool:
    return peer.peer_id.to_base58() in dht.run_coroutine(_stored)


@pytest.fixture
def swarms():
    made: list[DHT] = []
    yield made
    for dht in reversed(made):
        dht.shutdown()


def test_a_push_reaches_every_known_peer_and_a_local_read_there_finds_it(swarms):
    swarms += _swarm(3, [None, None, None])
    first, *others = swarms
    assert eventually(lambda: first.run_coroutine(_known_peers) == 2, 15), "the first DHT did not come to know both others"
    assert not any(_holds(dht, first) for dht in others)
    assert _push(first, {"outer_step": 7, "round": 3}) == 2
    name = first.peer_id.to_base58()
    for dht in others:  # in their own storage, where a local read finds it
        assert _holds(dht, first)
        assert read_progress(dht, _KEY, local=True).get(name, {}).get("outer_step") == 7
    assert read_progress(first, _KEY, local=True)[name]["round"] == 3  # and in the pusher's own
    # what a reader does for a peer only the DHT showed it: a ping each (a subkey that is no peer id is skipped)
    ping_each = partial(introduce, peer_ids=[dht.peer_id.to_base58() for dht in others] + ["not a peer id"])
    assert first.run_coroutine(ping_each) == 2


def test_in_a_closed_run_a_non_members_push_is_refused(swarms, tmp_path):
    member_key, other_key = tmp_path / "member.key", tmp_path / "other.key"
    member_key.write_text("a secret every member of this run holds")
    other_key.write_text("a secret of somebody else entirely")
    swarms += _swarm(3, [member_key, member_key, other_key])
    first, second, outsider = swarms
    for dht in swarms:
        assert eventually(lambda dht=dht: dht.run_coroutine(_known_peers) == 2, 15), "the three DHTs did not all meet"
    assert _push(outsider, {"outer_step": 99}) == 0  # each member's validator refuses it
    assert not _holds(first, outsider) and not _holds(second, outsider) and _holds(outsider, outsider)
    assert _push(second, {"outer_step": 5}) == 1  # the first member takes it; the outsider refuses it
    assert _holds(first, second) and not _holds(outsider, second)
    assert read_progress(first, _KEY, local=True)[second.peer_id.to_base58()]["outer_step"] == 5


def test_beacons_that_push_give_every_peer_every_record(swarms, monkeypatch):
    swarms += _swarm(3, [None, None, None])
    # only the first record goes the DHT's way (and the lifetime is too long for another in the test's time):
    # every update after it comes by push
    monkeypatch.setattr("p2p_diloco.swarm.progress.DHT_EVERY", 10**6)
    beacons = []
    try:
        for index, dht in enumerate(swarms):
            beacon = ProgressBeacon(dht, _KEY, 0.5, 120.0, read_peers=partial(read_progress, dht, _KEY, local=True), push=True)
            beacon.update(outer_step=index)
            beacons.append(beacon)
        names = {dht.peer_id.to_base58() for dht in swarms}
        assert eventually(lambda: all(set(read_progress(dht, _KEY, local=True)) == names for dht in swarms), 15)
        time.sleep(2.0)
        for beacon in beacons:
            beacon.update(outer_step=10)
        assert eventually(lambda: all(
            {record["outer_step"] for record in read_progress(dht, _KEY, local=True).values()} == {10} for dht in swarms
        ), 10), "a pushed update did not reach every peer within 10 s"
    finally:
        for beacon in beacons:
            beacon.close()
