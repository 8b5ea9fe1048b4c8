"""The harness's warm starts (warm_start.py) make what the launcher's ``Popen`` makes: a peer in its own session, its
output in its log, its flags and environment, its exit code as ``Popen`` reports it, and a fresh interpreter
wherever a fork would differ from one."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from p2p_diloco.cli.peer_processes import LocalSwarm, peer_environment, start_peer, wait_for_ready

from . import harness
from .warm_start import WarmProcess, _read_at_import


@pytest.fixture
def warm():
    if harness.WARM is None or not harness.WARM.start():
        pytest.skip("warm starts are off (P2P_DILOCO_TEST_COLD_STARTS=1) or the server refused to serve")
    return harness.WARM


def test_a_warm_peer_reports_bad_flags_and_its_exit_code_as_a_fresh_one(tmp_path, warm, reaper):
    peer = start_peer("bad", tmp_path, ["--inner-steps", "0"], None, spawn=warm.spawn)
    reaper.append(peer.process.pid)
    assert isinstance(peer.process, WarmProcess)
    assert peer.process.wait(timeout=60) == 2
    lines = peer.log_file.read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2p-diloco peer: error:") and "inner" in lines[0], lines

    printed = start_peer("print", tmp_path, ["--print-config", "--inner-steps", "7"], None, spawn=warm.spawn)
    assert printed.process.wait(timeout=60) == 0
    assert "inner_steps = 7" in printed.log_file.read_text()


def test_a_warm_peer_is_its_own_session_with_its_environment_and_dies_by_its_group(tmp_path, warm, reaper):
    swarm = LocalSwarm(tmp_path, [*harness.FAST_PEER_FLAGS, "--max-time-s", "60"], on_start=reaper.append, spawn=warm.spawn)
    peer = swarm.start("peer0", shard=0, num_shards=1)
    assert isinstance(peer.process, WarmProcess)
    wait_for_ready([peer], 60)
    pid = peer.process.pid
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid  # start_new_session, as Popen's
    environ = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ", "rb").read().decode().split("\0") if "=" in item)
    # as the server started (the child then takes the environment asked for: pytest's test name differs)
    assert _read_at_import(environ) == _read_at_import(peer_environment())
    assert sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))[:3] == [0, 1, 2]
    assert os.readlink(f"/proc/{pid}/fd/1") == os.readlink(f"/proc/{pid}/fd/2") == str(peer.log_file)
    assert os.readlink(f"/proc/{pid}/fd/0") == os.devnull
    assert peer.process.poll() is None and peer.alive
    peer.signal_group(signal.SIGKILL)
    assert peer.process.wait(timeout=30) == -signal.SIGKILL  # Popen's convention for a signal
    with pytest.raises(subprocess.TimeoutExpired):
        # a pid that never was the server's child: the wait times out as Popen's does
        WarmProcess(warm, 1 << 30, ["none"]).wait(timeout=0.2)


def test_a_peer_whose_start_would_differ_from_a_fork_starts_fresh(tmp_path, warm, reaper):
    given_env = start_peer("env", tmp_path, ["--print-config"], None, env={"ATEN_CPU_CAPABILITY": "default"}, spawn=warm.spawn)
    prefixed = start_peer("prefixed", tmp_path, ["--print-config"], None, command_prefix=["env"], spawn=warm.spawn)
    plain = start_peer("plain", tmp_path, ["--print-config"], None, spawn=warm.spawn)
    for peer in (given_env, prefixed, plain):
        reaper.append(peer.process.pid)
    assert isinstance(given_env.process, subprocess.Popen) and isinstance(prefixed.process, subprocess.Popen)
    assert isinstance(plain.process, WarmProcess)
    for peer in (given_env, prefixed, plain):
        assert peer.process.wait(timeout=60) == 0, peer.log_file.read_text()[-2000:]
        assert "[model]" in peer.log_file.read_text()


def _semaphores(pid: int) -> set[str]:
    """The process-shared semaphores (multiprocessing's locks) a process maps."""
    with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps:
        return {line.split()[5] for line in maps.read().splitlines() if len(line.split()) > 5 and "/sem." in line.split()[5]}


def test_warm_peers_share_no_lock_with_each_other_or_the_server(tmp_path, warm, reaper):
    """hivemind makes process-shared locks as it is imported; forked from one server, two peers would share them (a
    peer SIGKILLed holding one wedged every other peer's averager in CI). Each peer has its own, as fresh ones do."""
    swarm = LocalSwarm(tmp_path, [*harness.FAST_PEER_FLAGS, "--max-time-s", "60"], on_start=reaper.append, spawn=warm.spawn)
    peers = [swarm.start(f"peer{i}", shard=i, num_shards=2) for i in range(2)]
    assert all(isinstance(peer.process, WarmProcess) for peer in peers)
    wait_for_ready(peers, 60)
    first, second, server = (_semaphores(pid) for pid in (peers[0].process.pid, peers[1].process.pid, warm.server.pid))
    assert first and second and server, (first, second, server)
    assert not first & second and not (first | second) & server, (first & second, (first | second) & server)
    assert all(code == 0 for code in swarm.stop_all().values())

