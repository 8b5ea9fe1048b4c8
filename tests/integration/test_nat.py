"""Volunteers behind home routers (root only): 4 peers, 2 of them each behind its own NAT (private address,
outgoing connections masqueraded, incoming ones dropped), one of those started late. Each NATed peer finds
out by itself that nobody can dial it, takes part in client mode, and every round of the swarm is averaged
by all 4; the late one downloads the state from a peer it can dial. Nothing is left behind: no namespace,
no link, no iptables rule in this machine's own tables."""

from __future__ import annotations

import os
import subprocess

import pytest

from experiments.wan import Wan, leftovers, unavailable_reason
from p2p_diloco.cli.peer_processes import LocalSwarm
from p2p_diloco.observe.report import check_invariant_1

from .harness import FAST_PEER_FLAGS

REASON = unavailable_reason(nat=True)
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no emulated home routers here: {REASON}")


def _root_rules() -> str:
    return "\n".join(subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True, timeout=20).stdout
                     for table in ("filter", "nat"))


def _averaged_by_all_four(records: dict[str, list[dict]]) -> set[int]:
    """The outer steps that every one of the 4 peers averaged in a group of 4."""
    in_fours = [{r["outer_step"] for r in rs if r["status"] == "ok" and r["group_size"] == 4} for rs in records.values()]
    return set.intersection(*in_fours) if len(in_fours) == 4 else set()


def test_peers_behind_nat_take_part_in_every_round(tmp_path, reaper):
    prefix = f"p2pn{os.getpid() % 10000}"
    rules_before = _root_rules()
    # the swarm runs until every peer has averaged two outer steps in a group of 4 (bounded): how many steps the
    # founders make before the late peer is in depends on the machine's speed (2.5 s rounds on a fast one)
    flags = [*FAST_PEER_FLAGS, "--inner-steps", "80", "--max-outer-steps", "60", "--relay-wait-s", "3"]
    with Wan(4, 20.0, prefix=prefix, subnet=84, nat=[2, 3]) as wan:
        swarm = LocalSwarm(tmp_path, flags, on_start=reaper.append, wan=wan)
        try:
            together = ["--wait-for-peers", "3"]  # train together once the NATed one has found its way
            for index in range(3):
                swarm.start(f"peer{index}", index, 4, extra=together)
            swarm.wait_until(lambda: swarm.outer_step("peer0") >= 2, 150, "two outer steps")
            swarm.start("peer3", 3, 4)  # behind NAT and late: it must download the state to join
            swarm.wait_until(lambda: len(_averaged_by_all_four(swarm.all_records())) >= 2, 240, "two rounds of 4")
        finally:
            codes = swarm.stop_all()
        described = wan.describe()
    assert leftovers(prefix) == [], "the emulated network was not fully removed"
    assert _root_rules() == rules_before, "iptables rules were left in the root namespace"
    assert [link["behind_nat"] for link in described] == [False, False, True, True]
    assert codes == {f"peer{i}": 0 for i in range(4)}, swarm.log_tails()

    logs = {name: swarm.peers[name].log_file.read_text() for name in swarm.peers}
    for name in ("peer2", "peer3"):  # each found out by itself, and says so in one line
        assert "client mode: behind NAT (seen from outside as 10.84.0." in logs[name], swarm.log_tail(name)
    assert "a peer dialled back 10.84.0.2" in logs["peer1"], swarm.log_tail("peer1")

    records = swarm.all_records()
    assert check_invariant_1(records)["held"], swarm.log_tails()
    assert len(_averaged_by_all_four(records)) >= 2, swarm.log_tails()
    assert any(r["status"] == "caught_up" for r in records["peer3"]), "the late NATed peer never downloaded state"
    evaluated = [r["eval_loss"] for r in records["peer0"] if r.get("eval_loss") is not None]
    assert evaluated[-1] < evaluated[0] - 0.5, f"held-out loss did not fall: {evaluated}"
