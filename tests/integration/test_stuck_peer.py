"""A peer that does not stop says where it is stuck (cli/stacks.py, docs/architecture.md "Clean shutdown"): the
launcher asks a peer that outlived its grace for every thread's stack before it SIGKILLs it, a stop request that did
not end the process arms a timer that prints them, and a process that does not handle the signal is killed as
before (SIGUSR1's default action would end it with another exit code and no stacks)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p_diloco.cli.peer_processes import PeerProcess

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SigCgt is read from Linux's /proc")

# a stand-in for a trainer stuck in native code or on a lock: it takes SIGTERM (arming the timer, as the peer's
# handler does) and goes on with what it was stuck in
_STUCK = """
import signal, sys, time
from p2p_diloco.cli import stacks
if {enable}:
    assert stacks.enable()
signal.signal(signal.SIGTERM, lambda *_: stacks.arm({arm_s}))
print("ready", flush=True)
def stuck_in_a_checkpoint_write():
    while True:
        time.sleep(0.02)
stuck_in_a_checkpoint_write()
"""


def _start(tmp_path: Path, reaper, enable: bool = True, arm_s: float = 60.0) -> PeerProcess:
    log_file = tmp_path / "stuck.log"
    with open(log_file, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", _STUCK.format(enable=enable, arm_s=arm_s)], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    reaper.append(process.pid)
    deadline = time.monotonic() + 30
    while b"ready" not in log_file.read_bytes():
        assert process.poll() is None, log_file.read_text()
        assert time.monotonic() < deadline, "the stand-in did not start"
        time.sleep(0.02)
    return PeerProcess("stuck", process, tmp_path / "stuck.jsonl", log_file)


def test_a_peer_past_its_grace_prints_its_stacks_before_the_kill(tmp_path, reaper, capsys):
    peer = _start(tmp_path, reaper)
    assert peer.stop(grace_s=1.0) == -signal.SIGKILL
    log = peer.log_file.read_text()
    assert "stuck_in_a_checkpoint_write" in log and "most recent call first" in log
    assert "Timeout (" not in log  # the SIGUSR1's dump, not the timer's (armed for 60 s)
    assert f"stuck did not stop within 1 s: its threads' stacks are at the end of {peer.log_file}" in capsys.readouterr().err


def test_a_stop_request_that_did_not_end_the_process_prints_its_stacks(tmp_path, reaper):
    peer = _start(tmp_path, reaper, arm_s=0.3)
    peer.terminate()
    deadline = time.monotonic() + 10
    while "Timeout (" not in peer.log_file.read_text():  # the timer's header, then every thread's stack
        assert time.monotonic() < deadline, peer.log_file.read_text()
        time.sleep(0.05)
    assert peer.alive  # it only says where it is; the kill is the launcher's
    assert "stuck_in_a_checkpoint_write" in peer.log_file.read_text()
    assert peer.stop(grace_s=0.1) == -signal.SIGKILL


def test_a_process_that_does_not_handle_the_signal_is_killed_as_before(tmp_path, reaper, capsys):
    peer = _start(tmp_path, reaper, enable=False)
    assert peer.stop(grace_s=0.5) == -signal.SIGKILL  # not -SIGUSR1: it was never sent
    assert "most recent call first" not in peer.log_file.read_text()
    assert "did not stop" not in capsys.readouterr().err
