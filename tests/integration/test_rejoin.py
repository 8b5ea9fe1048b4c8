"""Two real DHTs on 127.0.0.1 whose routing tables were emptied, as a peer frozen for a while finds its own
(and the others find theirs) once every request in flight has timed out: hivemind alone leaves them apart for
good; the progress beacon pings the peers it knew and brings them back together."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest
from hivemind import DHT
from hivemind.dht.node import DHTNode

from p2p_diloco.core.config import SwarmConfig
from p2p_diloco.swarm.joining import start_dht
from p2p_diloco.swarm.progress import ProgressBeacon, read_progress

from .harness import eventually

_KEY, _PERIOD_S, _TTL_S = "rejoin-test.progress", 0.5, 3.0


async def _forget_everyone(dht: DHT, node: DHTNode, deaf_s: float = 2.0) -> int:
    """What timeouts on every request do to a routing table: every peer dropped. Returns how many were there.

    For ``deaf_s`` the table also ignores updates, as a frozen peer's does: a request in flight when the table
    was emptied (the beacons publish and read all the time) must not put the other back at once."""
    protocol = node.protocol

    async def ignore(*args: object, **kwargs: object) -> None:
        return None

    async def hear_again() -> None:
        await asyncio.sleep(deaf_s)
        del protocol.update_routing_table  # the class's method again

    protocol.update_routing_table = ignore
    known = list(protocol.routing_table.uid_to_peer_id)
    for node_id in known:
        del protocol.routing_table[node_id]
    asyncio.create_task(hear_again())
    return len(known)


async def _routing_table_size(dht: DHT, node: DHTNode) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


def _reader(dht: DHT):
    own = dht.peer_id.to_base58()
    return lambda: {peer: record for peer, record in read_progress(dht, _KEY).items() if peer != own}


def _publish(dht: DHT, step: int) -> None:
    from hivemind.utils.timed_storage import get_dht_time

    dht.store(_KEY, subkey=dht.peer_id.to_base58(), value={"outer_step": step}, expiration_time=get_dht_time() + _TTL_S)


@dataclass
class _Pair:
    """Two DHTs on 127.0.0.1, the second bootstrapped from the first, and the beacons a test starts on them."""

    first: DHT
    second: DHT
    addresses: tuple[str, ...]  # the first's: the second's initial peers
    beacons: list[ProgressBeacon] = field(default_factory=list)


@pytest.fixture
def pair():
    first = start_dht(SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",)))
    second, made = None, None
    try:
        addresses = tuple(str(a) for a in first.get_visible_maddrs())
        second = start_dht(SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=addresses))
        made = _Pair(first, second, addresses)
        yield made
    finally:
        for beacon in made.beacons if made is not None else []:
            beacon.close()
        for dht in (second, first):
            if dht is not None:
                dht.shutdown()


def test_beacons_bring_back_together_two_dhts_that_forgot_each_other(pair):
    first, second, addresses, beacons = pair.first, pair.second, pair.addresses, pair.beacons
    assert eventually(lambda: first.run_coroutine(_routing_table_size) == 1, 10)

    # control, without beacons: both tables emptied, each keeps publishing, and they stay apart
    assert first.run_coroutine(_forget_everyone) == 1 and second.run_coroutine(_forget_everyone) == 1
    apart_until = time.monotonic() + 2 * _TTL_S
    while time.monotonic() < apart_until:
        _publish(first, 1), _publish(second, 1)
        assert not _reader(first)() and not _reader(second)(), "the DHTs found each other without help"
        time.sleep(_PERIOD_S)

    # the beacons: the second knows the first as its initial peer, the first knows nobody yet
    beacons += [
        ProgressBeacon(first, _KEY, _PERIOD_S, _TTL_S, _reader(first)),
        ProgressBeacon(second, _KEY, _PERIOD_S, _TTL_S, _reader(second), bootstrap=addresses),
    ]
    for step, beacon in enumerate(beacons):
        beacon.update(outer_step=step)
    assert eventually(lambda: all(beacon.peers for beacon in beacons), 20), [b.rejoins for b in beacons]
    assert beacons[1].rejoins >= 1  # it was the second's ping that healed both tables
    assert first.run_coroutine(_routing_table_size) == 1 and second.run_coroutine(_routing_table_size) == 1

    # forgotten again while the second has no beacon (so it pings nobody): the first, which has no initial
    # peers, pings it from the records it saw alone, once the second's last record in its storage expired
    beacons.pop().close()
    rejoins = beacons[0].rejoins
    first.run_coroutine(_forget_everyone), second.run_coroutine(_forget_everyone)
    assert eventually(lambda: beacons[0].rejoins > rejoins, 20), "the first never pinged the peer it had seen"
    beacons.append(ProgressBeacon(second, _KEY, _PERIOD_S, _TTL_S, _reader(second)))  # knows nobody
    beacons[1].update(outer_step=2)
    fresh = lambda: beacons[0].peers.get(second.peer_id.to_base58(), {}).get("outer_step") == 2  # noqa: E731
    assert eventually(lambda: fresh() and beacons[1].peers, 20), [b.rejoins for b in beacons]


def test_a_peer_that_leaves_says_so_and_drops_out_of_the_others_view_before_its_record_expires(pair):
    ttl_s = 60.0  # far longer than the test waits: only the departure record can take the peer out of view
    beacons = pair.beacons
    beacons += [ProgressBeacon(dht, _KEY, _PERIOD_S, ttl_s, _reader(dht)) for dht in (pair.first, pair.second)]
    for step, beacon in enumerate(beacons):
        beacon.update(outer_step=step)
    assert eventually(lambda: all(beacon.peers for beacon in beacons), 20)
    beacons[1].leave()
    assert eventually(lambda: not beacons[0].peers, 10), beacons[0].peers
    assert not _reader(pair.first)()  # read straight from the DHT as well
