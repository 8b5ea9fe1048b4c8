"""The dial-back probe between two real DHTs on 127.0.0.1: a listening port is found open, and a peer that
asks too often is told so instead of making the server dial again."""

from __future__ import annotations

from p2p_diloco.config import SwarmConfig
from p2p_diloco.joining import start_dht
from p2p_diloco.reachability import probe, serve_dial_back


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
