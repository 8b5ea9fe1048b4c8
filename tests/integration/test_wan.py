"""The emulated wide-area network (root only): two peers in their own network namespaces behind capped links
average a round, the kernel counts about the bytes the codec predicts, and nothing is left behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from experiments.wan import Wan, leftovers, unavailable_reason
from p2p_diloco.cli.peer_processes import LocalSwarm
from p2p_diloco.core.compression import make_codec
from p2p_diloco.core.config import SwarmConfig

from .harness import FAST_PEER_FLAGS

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no emulated network here: {REASON}")

MODEL_PARAMS = 834_304  # the built-in model at 4 layers, d_model 128 (the flags below)
STATE_BYTES = 3 * 4 * MODEL_PARAMS  # a served state: global params, outer momentum and the last average, fp32
CAP_MBIT = 20.0


def _prefix() -> str:
    return f"p2pt{os.getpid() % 10000}"  # own names: a benchmark's network on the same machine is never touched


_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 9000))
connection, _ = server.accept()
received, started = 0, None
while chunk := connection.recv(1 << 16):
    started = started or time.monotonic()
    received += len(chunk)
print(received, time.monotonic() - started, flush=True)
"""
_SENDER = "import socket, sys; s = socket.create_connection((sys.argv[1], 9000), timeout=30); s.sendall(b'x' * 4_000_000)"


def test_the_cap_holds_and_everything_is_removed(reaper):
    prefix = _prefix()
    with Wan(2, [CAP_MBIT, None], prefix=prefix, subnet=78) as wan:
        assert any(name.startswith(f"netns {prefix}-") for name in leftovers(prefix))
        receiver = subprocess.Popen([*wan.command_prefix(1), sys.executable, "-c", _RECEIVER, wan.host(1)],
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
        reaper.append(receiver.pid)
        time.sleep(1.5)  # the receiver is listening
        subprocess.run([*wan.command_prefix(0), sys.executable, "-c", _SENDER, wan.host(1)], check=True, timeout=60)
        received, seconds = receiver.communicate(timeout=60)[0].split()
        sent_on_wire, _ = wan.wire_bytes(0)
    assert int(received) == 4_000_000
    assert sent_on_wire >= 4_000_000  # payload plus TCP/IP headers
    # the capped peer's upload: 32 Mbit at 20 Mbit/s takes ~1.6 s; uncapped loopback-like links take ~0.05 s
    assert 4_000_000 * 8 / float(seconds) / 1e6 < CAP_MBIT * 1.2
    assert leftovers(prefix) == []


def test_a_stale_network_is_removed_at_the_next_start():
    prefix = _prefix()
    stale = Wan(1, None, prefix=prefix, subnet=79)
    stale.up()  # as if the script that made it had been SIGKILLed: never torn down
    try:
        with Wan(2, CAP_MBIT, prefix=prefix, subnet=79) as wan:
            assert len([n for n in leftovers(prefix) if n.startswith("netns")]) == 2
            assert wan.wire_bytes(0)[0] < 10_000  # a fresh link (a few router solicitations at most)
    finally:
        stale.down()
    assert leftovers(prefix) == []


def test_two_peers_average_over_capped_links(tmp_path, reaper):
    prefix = _prefix()
    flags = [*FAST_PEER_FLAGS, "--n-layers", "4", "--d-model", "128", "--n-heads", "4", "--inner-steps", "60",
             "--max-outer-steps", "4", "--compression", "int8", "--run-id", "wantest"]
    with Wan(2, CAP_MBIT, prefix=prefix, subnet=80) as wan:
        swarm = LocalSwarm(tmp_path, flags, on_start=reaper.append, wan=wan)
        try:
            swarm.start("peer0", 0, 2)
            swarm.start("peer1", 1, 2)
            swarm.wait_all_exited(180)
        finally:
            codes = swarm.stop_all()
        wire = [wan.wire_bytes(i) for i in range(2)]
    assert leftovers(prefix) == [], "the emulated network was not fully removed"
    assert codes == {"peer0": 0, "peer1": 0}, swarm.log_tails()
    records = swarm.all_records()
    averaged = {name: [r for r in rs if r["status"] == "ok" and r["group_size"] == 2] for name, rs in records.items()}
    assert all(averaged.values()), f"no round averaged in a group of 2: {swarm.log_tails()}"
    # what the codec predicts: with 2 peers each one sends the encoded half it does not reduce, then the
    # encoded average of the half it reduces, so the encoded size of the whole outer gradient per all-reduce; a
    # cross-checked round (the default) runs its all-reduce twice, each half reduced by the other peer the second time
    all_reduces = 2 if SwarmConfig().cross_check else 1
    encoded = all_reduces * MODEL_PARAMS * make_codec("int8").bytes_per_value()
    for name, (sent, _) in zip(("peer0", "peer1"), wire):
        predicted = len(averaged[name]) * encoded
        counted = sum(r["bytes_sent"] for r in averaged[name])  # the averager's own count of what it sent
        assert counted == pytest.approx(predicted, rel=0.02)
        assert sent >= predicted, f"{name}: {sent} B on the wire < {predicted:.0f} B the codec predicts"
    # a peer also serves its state to each peer that catches up from it: when the other joins, and after a round
    # that failed on one side only (the last one can: the other side stops once its own results are in). Its
    # averager counts what it served (its last line says so: it may serve after its last record), and a donor
    # refused or a download given up still cost those bytes; the catch-ups the other peer recorded are a floor
    ids = {name: rs[0]["peer_id"] for name, rs in records.items()}
    for name, (sent, received) in zip(("peer0", "peer1"), wire):
        served = _served(swarm.peers[name].log_file.read_text(errors="replace"))
        assert served is not None, f"{name} did not say what it served: {swarm.log_tail(name)}"
        states, state_bytes = served
        named = sum(ids[name] in r["reason"] for other, rs in records.items() if other != name for r in rs
                    if r["status"] == "caught_up")
        assert states >= named, f"{name} served {states} states, the other peer caught up from it {named} times"
        assert state_bytes <= states * STATE_BYTES * 1.01, f"{name}: {state_bytes} B in {states} states served"
        failed = sum(r["bytes_sent"] for r in records[name] if r["status"] in ("partial", "error"))
        predicted = len(averaged[name]) * encoded + failed + state_bytes
        overhead_allowance = 0.10 * predicted + 0.05 * received + 400_000  # TCP/IP headers, ACKs, DHT, libp2p
        assert sent <= predicted + overhead_allowance, f"{name}: {sent} B on the wire, {predicted:.0f} B predicted ({states} states served)"


def _served(log: str) -> tuple[int, int] | None:
    """The states a peer served and their bytes, from the line it prints as it stops (cli/peer.py)."""
    found = re.search(r"stopped at outer step \d+, having served (\d+) states \(([\d,]+) B\)", log)
    return (int(found[1]), int(found[2].replace(",", ""))) if found else None
