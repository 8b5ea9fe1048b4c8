"""A torchrun island of 2 CPU ranks (DDP over gloo) and a single-process peer in one swarm on 127.0.0.1."""

from __future__ import annotations

import os
import re
import socket
import time
from collections import defaultdict

import pytest

from p2p_diloco.launcher import PEER_SCRIPT, start_peer, wait_for_address
from p2p_diloco.report import check_invariant_1

from .harness import local_swarm

pytestmark = pytest.mark.integration
_SHA_LINE = re.compile(r"island rank (\d+): outer step (\d+) (global|local) sha256 ([0-9a-f]{64})")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                if int(handle.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _island_shas(log: str) -> dict[tuple[str, int], dict[int, str]]:
    """(global|local, outer step) -> rank -> the sha256 that rank logged."""
    found: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)
    for rank, step, kind, sha in _SHA_LINE.findall(log):
        found[(kind, int(step))][int(rank)] = sha
    return found


@pytest.mark.timeout(200)
def test_torchrun_island_averages_with_a_single_peer_and_its_ranks_stay_identical(tmp_path, reaper):
    # the island starts first, as the swarm's first peer: torchrun and two ranks importing torch are the slowest
    # to start on a loaded 2-core machine; both peers begin training at the same agreed time
    start_at = time.time() + 60
    swarm = local_swarm(tmp_path, reaper, ["--start-at", f"{start_at:.1f}", "--max-time-s", "30"])
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()), str(PEER_SCRIPT)]
    island = start_peer("island", tmp_path, [*swarm.flags, "--shard-index", "1", "--num-shards", "2"], None, entry=torchrun)
    reaper.append(island.process.pid)
    swarm.peers["island"] = island
    # torchrun starts each rank in a process group of its own: the reaper must know those groups too
    swarm.wait_until(lambda: len(_children(island.process.pid)) == 2, 60, "torchrun to start 2 ranks")
    reaper.extend(_children(island.process.pid))
    swarm.address = wait_for_address(island, timeout_s=90)
    swarm.start("solo", shard=0, num_shards=2)
    swarm.wait_all_exited(130)
    assert all(p.process.returncode == 0 for p in swarm.peers.values()), swarm.log_tails()

    records = swarm.all_records()
    invariant = check_invariant_1(records)
    assert invariant["held"], invariant["forks"]
    assert invariant["outer_steps_reported_by_several_peers"] >= 2, records
    # the island and the single peer averaged together
    paired = {name: [r for r in records[name] if r["status"] == "ok" and r["group_size"] == 2] for name in records}
    assert paired["solo"] and paired["island"], records
    assert records["solo"][0]["peer_id"] in paired["island"][-1]["peers"]
    # the island's tokens are both ranks' batches: twice the single peer's per inner step
    per_step = {name: [r["interval_tokens"] // r["inner_steps"] for r in records[name] if r["inner_steps"]] for name in records}
    assert set(per_step["solo"]) == {8 * 64} and set(per_step["island"]) == {2 * 8 * 64}, per_step

    # the island's ranks hold the same bytes: the global params received at every outer step, and the local
    # params each rank trained itself (checked once per outer step, after at least one DDP inner step)
    shas = _island_shas(island.log_file.read_text(errors="replace"))
    global_steps = sorted(step for kind, step in shas if kind == "global")
    local_steps = sorted(step for kind, step in shas if kind == "local")
    assert len(global_steps) >= 3 and len(local_steps) >= 2, shas
    for (kind, step), by_rank in shas.items():
        assert set(by_rank) == {0, 1} and len(set(by_rank.values())) == 1, (kind, step, by_rank)
    reported = {r["outer_step"]: r["global_sha256"] for r in records["island"]}
    for step in global_steps:
        if step in reported:
            assert shas[("global", step)][0] == reported[step], step
