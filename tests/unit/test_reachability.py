"""How a peer decides to take part: address parsing for the dial-back probe, the DHT options of each mode,
and the config checks of the reachability flags."""

from __future__ import annotations

import pytest

from p2p_diloco.core.config import SwarmConfig
from p2p_diloco.swarm import reachability
from p2p_diloco.swarm.joining import dht_options, p2pd_env
from p2p_diloco.swarm.reachability import direct_line, observed_endpoint, relay_of

PEER = "12D3KooWDGQAkevkKV36UiPMUBEyRAb3eS7DdurCmoSwf9NbQJsE"
RELAY = "12D3KooWRRm7U2j1aJNDKHKUmad9Ax79zwNC7zrqB9E9RzTSHUgD"


def test_the_observed_endpoint_of_a_direct_connection_is_dialled_back():
    assert observed_endpoint(f"/ip4/10.84.0.3/tcp/41153/p2p/{PEER}") == ("10.84.0.3", 41153)
    assert observed_endpoint("/ip6/2001:db8::7/tcp/4001") == ("2001:db8::7", 4001)


def test_a_relayed_connection_has_no_address_to_dial_back():
    assert observed_endpoint(f"/ip4/10.84.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit") == (None, None)
    assert observed_endpoint("/unix/tmp/socket") == (None, None)


def test_relay_of_names_the_relay_peer_of_a_circuit_address():
    name = relay_of(f"/ip4/10.84.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}")
    assert name.startswith(RELAY[:8]) and name.endswith(RELAY[-6:])


def test_direct_line_prefers_an_address_others_can_use():
    line = direct_line([f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}", f"/ip4/10.84.0.1/tcp/1/p2p/{PEER}"], "10.84.0.1:1")
    assert line.startswith(f"reachable directly at /ip4/10.84.0.1/tcp/1/p2p/{PEER}")
    assert "dialled back 10.84.0.1:1" in line


def test_each_mode_starts_the_dht_its_own_way():
    config = SwarmConfig(initial_peers=(f"/ip4/10.84.0.1/tcp/1/p2p/{RELAY}",))
    direct, flags = dht_options(config, "direct")
    assert direct == {"force_reachability": "public"} and flags == {}  # relays for others by default
    relay, flags = dht_options(config, "relay")
    assert relay["use_auto_relay"] and relay["force_reachability"] == "private"
    assert relay["trusted_relays"] == list(config.initial_peers)  # the initial peers, unless --relay says
    assert relay["announce_maddrs"] == [f"{config.initial_peers[0]}/p2p-circuit"]  # p2pd would advertise none
    assert flags == {"relayService": False, "relayDiscovery": False}  # static relays: a reservation at once
    client, _ = dht_options(config, "client")
    assert client == {"client_mode": True}
    own = SwarmConfig(relays=(f"/ip4/10.84.0.9/tcp/1/p2p/{PEER}",), relay_service=False)
    assert dht_options(own, "relay")[0]["trusted_relays"] == list(own.relays)
    assert dht_options(own, "relay")[0]["announce_maddrs"] == [f"{own.relays[0]}/p2p-circuit"]
    announced = SwarmConfig(relays=own.relays, announce_maddrs=("/ip4/1.2.3.4/tcp/5",))
    assert dht_options(announced, "relay")[0]["announce_maddrs"] == ["/ip4/1.2.3.4/tcp/5", f"{own.relays[0]}/p2p-circuit"]
    assert dht_options(own, "direct")[1] == {"relayService": False}  # --no-relay-service


@pytest.mark.parametrize("overrides, message", [
    (dict(reachability="sometimes"), "swarm.reachability must be one of auto, direct, relay, client"),
    (dict(relay_wait_s=0), "swarm.relay_wait_s must be > 0"),
])
def test_bad_reachability_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        SwarmConfig(**overrides)


class _AnsweringDHT:
    """Stands in for the DHT's process: each probe gets the next of ``answers`` (an exception is raised)."""

    def __init__(self, answers: list[object]):
        self.answers, self.asked = list(answers), []

    def get_visible_maddrs(self) -> list[str]:
        return [f"/ip4/10.84.0.2/tcp/34777/p2p/{PEER}"]

    def run_coroutine(self, coroutine: object, return_future: bool = False) -> object:
        self.asked.append(coroutine.keywords["peer_id"])
        answer = self.answers.pop(0) if self.answers else {"error": "no more answers"}

        class Done:
            def result(self, timeout: float) -> object:
                if isinstance(answer, Exception):
                    raise answer
                return answer

        return Done()


def test_a_probe_that_every_initial_peer_failed_at_once_is_tried_again(monkeypatch):
    slept = []
    monkeypatch.setattr(reachability.time, "sleep", slept.append)
    # both initial peers fail the first round (a connection not up yet), the second round's first one answers
    dht = _AnsweringDHT([{"error": "stream reset"}, TimeoutError("no answer"), {"host": "10.84.0.2", "open": [34777]}])
    initial = [f"/ip4/10.84.0.1/tcp/4001/p2p/{RELAY}", f"/ip4/10.84.0.5/tcp/4001/p2p/{PEER}"]
    assert reachability.probe(dht, initial) == {"host": "10.84.0.2", "open": [34777]}
    assert dht.asked == [RELAY, PEER, RELAY] and slept == [1.0]


def test_a_probe_nobody_answers_gives_up_after_its_attempts(monkeypatch):
    slept = []
    monkeypatch.setattr(reachability.time, "sleep", slept.append)
    dht = _AnsweringDHT([])
    assert reachability.probe(dht, [f"/ip4/10.84.0.1/tcp/4001/p2p/{RELAY}", "/ip4/10.84.0.9/tcp/1"]) is None
    assert dht.asked == [RELAY] * reachability._PROBE_ATTEMPTS and slept == [1.0, 2.0]


def test_p2pd_gets_its_go_threads_from_the_config():
    assert p2pd_env(SwarmConfig()) == {"GOMAXPROCS": "1"}  # the default: one Go thread
    assert p2pd_env(SwarmConfig(p2pd_threads=4)) == {"GOMAXPROCS": "4"}
    assert p2pd_env(SwarmConfig(p2pd_threads=0)) == {}  # Go's default, or the environment's GOMAXPROCS
    with pytest.raises(ValueError, match="swarm.p2pd_threads must be >= 0, got -1"):
        SwarmConfig(p2pd_threads=-1)
