"""The dial-back probe between two real DHTs on 127.0.0.1: a listening port is found open, and a peer that
asks too often is told so instead of making the server dial again. The circuit check of relay mode, on
127.0.0.1 too."""

from __future__ import annotations

import time

from p2p_diloco.core.config import SwarmConfig
from p2p_diloco.swarm.joining import circuit_addresses, start_dht
from p2p_diloco.swarm.reachability import circuit_reaches_us, probe, serve_dial_back


def test_a_peer_dials_back_the_address_it_sees():
    server = start_dht(SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",)))
    client = None
    try:
        serve_dial_back(server)
        addresses = [str(a) for a in server.get_visible_maddrs()]
        client = start_dht(SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=tuple(addresses)))
        port = int(str(client.get_visible_maddrs()[0]).split("/tcp/")[1].split("/")[0])
        answer = probe(client, addresses)
        assert answer is not None and answer["host"] == "127.0.0.1"
        assert port in answer["open"]
        again = probe(client, addresses)  # within the rate limit: refused, so no answer with open ports
        assert again is None
    finally:
        for dht in (client, server):
            if dht is not None:
                dht.shutdown()


def test_a_peer_in_relay_mode_is_reached_through_its_relay_and_only_then():
    """The circuit check that decides relay mode: a stranger's p2pd reaches our handler over the relay we
    announce; through a relay that is not there it does not."""
    relay = start_dht(SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",)))
    peer = None
    try:
        addresses = tuple(str(a) for a in relay.get_visible_maddrs())
        config = SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=addresses)
        peer = start_dht(config, mode="relay")
        circuits = circuit_addresses(config)
        assert circuits == [f"{addresses[0]}/p2p-circuit"]
        deadline, reached = time.monotonic() + 30, None
        while reached is None and time.monotonic() < deadline:  # the reservation is made within a second or so
            reached = circuit_reaches_us(peer, circuits, timeout_s=10)
        assert reached == circuits[0]
        nobody = f"/ip4/127.0.0.1/tcp/9/p2p/{relay.peer_id.to_base58()}/p2p-circuit"  # nothing listens on port 9
        assert circuit_reaches_us(peer, [nobody], timeout_s=5) is None
    finally:
        for dht in (peer, relay):
            if dht is not None:
                dht.shutdown()
