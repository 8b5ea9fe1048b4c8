"""Peers started together join the first through its ready file (--join-ready-file): the wait, the peer's config,
the launcher's flags, and the address checks that load neither hivemind nor torch."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from p2p_diloco.cli import peer_processes
from p2p_diloco.cli.peer import _join_through_ready_file
from p2p_diloco.cli.peer_processes import LocalSwarm, PeerProcess
from p2p_diloco.cli.preflight import check_local_inputs
from p2p_diloco.cli.ready import wait_for_join_address, write_ready_file
from p2p_diloco.core.config import PeerConfig
from p2p_diloco.swarm import addresses

FIRST = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def _write_later(path: Path, delay_s: float, join_address: str | None = FIRST) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), write_ready_file(path, "peer", join_address, [])))
    thread.start()
    return thread


def test_the_wait_returns_the_address_once_the_file_is_written(tmp_path):
    path = tmp_path / "peer0.ready.json"
    writer = _write_later(path, 0.3)
    start = time.monotonic()
    assert wait_for_join_address(path, timeout_s=10) == FIRST
    assert 0.25 < time.monotonic() - start < 5
    writer.join()


def test_the_wait_is_bounded_and_a_client_mode_peer_cannot_be_joined(tmp_path):
    with pytest.raises(ValueError, match="no peer wrote its ready file .* within 0.3 s"):
        wait_for_join_address(tmp_path / "never.json", timeout_s=0.3)
    write_ready_file(tmp_path / "client.json", "peer", None, [])
    with pytest.raises(ValueError, match="client mode"):
        wait_for_join_address(tmp_path / "client.json", timeout_s=1)


def test_the_peer_adds_the_address_to_its_initial_peers_and_checks_it(tmp_path):
    other = FIRST.replace("4001", "4002")
    config = PeerConfig()
    config = dataclasses.replace(config, swarm=dataclasses.replace(config.swarm, initial_peers=(other,),
                                                                   join_ready_file=str(tmp_path / "r.json")))
    write_ready_file(tmp_path / "r.json", "peer", FIRST, [])
    assert _join_through_ready_file(config).swarm.initial_peers == (other, FIRST)
    assert _join_through_ready_file(PeerConfig()) == PeerConfig()  # no file named: the config as it was
    write_ready_file(tmp_path / "r.json", "peer", "/ip4/127.0.0.1/tcp/4001", [])
    with pytest.raises(ValueError, match="lacks its /p2p/"):
        _join_through_ready_file(config)


def test_a_ready_file_in_a_missing_folder_is_refused_before_anything_starts(tmp_path):
    config = PeerConfig()
    config = dataclasses.replace(config, swarm=dataclasses.replace(config.swarm, join_ready_file=str(tmp_path / "no" / "r.json")))
    with pytest.raises(ValueError, match="--join-ready-file .* its folder does not exist"):
        check_local_inputs(config)


class _Started:
    """start_peer stand-in: records what each peer was started with."""

    def __init__(self):
        self.calls: list[tuple[str, list[str], object]] = []

    def __call__(self, name, out_dir, flags, initial_peer, **_):
        self.calls.append((name, list(flags), initial_peer))
        process = SimpleNamespace(pid=0, poll=lambda: None, returncode=None)  # no process: the unit tier starts none
        return PeerProcess(name, process, out_dir / f"{name}.jsonl", out_dir / f"{name}.log", out_dir / f"{name}.ready.json")


def test_the_local_swarm_starts_the_others_at_once_joining_the_first_through_its_ready_file(tmp_path, monkeypatch):
    started = _Started()
    monkeypatch.setattr(peer_processes, "start_peer", started)
    swarm = LocalSwarm(tmp_path, ["--inner-steps", "5"])
    swarm.start("peer0", shard=0, num_shards=3)
    swarm.start("peer1", shard=1, num_shards=3)  # the first is not in the swarm yet: no address to pass
    write_ready_file(tmp_path / "peer0.ready.json", "peer0", FIRST, [FIRST])
    swarm.start("late", shard=2, num_shards=3)  # now it is: its address, as before
    (first, first_initial), (second, second_initial), (late, late_initial) = ((f, i) for _, f, i in started.calls)
    assert first_initial is None and "--join-ready-file" not in first
    assert second_initial is None and second[second.index("--join-ready-file") + 1] == str(tmp_path / "peer0.ready.json")
    assert late_initial == FIRST and "--join-ready-file" not in late
    assert swarm.address == FIRST


def test_addresses_are_checked_by_hivemind_s_own_parser():
    assert addresses.check_multiaddr(FIRST, need_peer_id=True) == FIRST
    assert addresses.check_multiaddr("/ip4/0.0.0.0/tcp/0", need_peer_id=False) == "/ip4/0.0.0.0/tcp/0"
    for text, reason in (("not-an-address", "bad multiaddr 'not-an-address'"), ("/ip4/1.2.3/tcp/1", "bad multiaddr"),
                         ("/ip4/127.0.0.1/tcp/9", "lacks its /p2p/")):
        with pytest.raises(ValueError, match=reason):
            addresses.check_multiaddr(text, need_peer_id=True)


def test_the_vendored_parser_loads_by_itself_and_agrees_with_hivemind_s():
    from hivemind.utils.multiaddr import Multiaddr

    vendored = addresses._load_vendored()
    assert vendored.Multiaddr is not Multiaddr and vendored.__name__ == "_p2p_diloco_vendored_multiaddr"
    for text in (FIRST, "/ip4/0.0.0.0/tcp/0", "/ip6/::1/tcp/4001"):
        assert str(vendored.Multiaddr(text)) == str(Multiaddr(text))
    with pytest.raises(Exception, match="Must begin with /"):
        vendored.Multiaddr("not-an-address")
