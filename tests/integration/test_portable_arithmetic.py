"""Invariant 1 across unlike hardware (docs/design.md §5): the computations that make shared state give the same
bytes under every CPU kernel set torch has here and any thread count; a swarm with a peer on the kernels of a CPU
without vector units trains as one swarm (no fork, no healing download, groups of all its peers); a peer whose
arithmetic does differ says so; a peer with another inner optimizer is one of the swarm; and the launcher names a peer
that cannot join."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.cli.peer_processes import LocalSwarm
from p2p_diloco.observe.report import build_report

from .harness import FAST_PEER_FLAGS

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
BYTES_SCRIPT, SWARM = ROOT / "scripts" / "portable_bytes.py", ROOT / "scripts" / "swarm.py"
NONPORTABLE_PEER = Path(__file__).resolve().parent / "nonportable_peer.py"


def _bytes_under_each(settings: list[tuple[str, int]]) -> list[dict]:
    """scripts/portable_bytes.py once per (kernel set, threads), all at once (each run is alone in its process)."""
    runs = [subprocess.Popen([sys.executable, str(BYTES_SCRIPT), "--threads", str(threads)],
                             env=dict(os.environ, ATEN_CPU_CAPABILITY=capability),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for capability, threads in settings]
    try:
        outputs = [run.communicate(timeout=200) for run in runs]
    finally:
        for run in runs:
            run.kill()
            run.wait()
    for run, (_, stderr) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, stderr[-2000:]
    return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]


@pytest.mark.timeout(300)
def test_shared_state_has_the_same_bytes_under_every_cpu_kernel_set_and_thread_count():
    runs = _bytes_under_each([(capability, threads) for capability in ("default", "avx2", "avx512") for threads in (1, 2)])
    kernels = {run["capability"] for run in runs}  # a capability the CPU lacks falls back to the best it has
    if kernels == {"DEFAULT"}:
        pytest.skip("this CPU has no vector kernel set in torch: nothing to compare the default kernels with")
    assert {run["threads"] for run in runs} == {1, 2}
    first = runs[0]["portable"]
    assert len(first) == 8 and not any("differs" in name for name in first), first  # init, 2 outer, 5 decodes
    for run in runs[1:]:
        assert run["portable"] == first, (run["capability"], run["threads"])
    # the controls prove that the runs used other kernels: torch's normal_ and a fused add do differ
    by_kernels = {run["capability"]: run["controls"] for run in runs}
    vector = next(kernels for kernels in by_kernels if kernels != "DEFAULT")
    assert by_kernels["DEFAULT"]["control torch normal_"] != by_kernels[vector]["control torch normal_"]
    assert by_kernels["DEFAULT"]["control fused add"] != by_kernels[vector]["control fused add"]


@pytest.mark.timeout(300)
def test_swarm_py_with_a_peer_on_default_kernels_is_one_swarm_in_groups_of_three(tmp_path):
    """The local swarm command of the issue, with peer0 on the kernels of a CPU without AVX: every peer makes every
    outer step in a group of all three, with the same bytes, and nobody heals a fork."""
    out = tmp_path / "x"
    command = [sys.executable, str(SWARM), "--peers", "3", "--out", str(out), "--inner-steps", "10", "--batch-size",
               "8", "--seq-len", "64", "--max-outer-steps", "6", "--peer-env", "0:ATEN_CPU_CAPABILITY=default"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "held over 7 outer steps" in done.stdout, done.stdout[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["invariant_1"]["status"] == "held" and not report["invariant_1"]["healed_forks"]
    assert "DEFAULT" in (out / "peer0.log").read_text() and "AVX" in (out / "peer1.log").read_text()
    for name, peer in report["peers"].items():
        assert peer["final_outer_step"] == 6, name
        assert peer["forks_healed"] == 0 and peer["arithmetic_mismatches"] == 0, (name, peer)
    for name, records in report["records"].items():
        # every round in a group of all three but, at most, one: in 1 of 17 CI runs the last round's search of one
        # AVX peer did not find the other two's group, which then averaged as two at its matchmaking deadline
        # (hivemind's matchmaking; nothing to do with kernels: no fork, no mismatch, the same bytes after)
        sizes = [r["group_size"] for r in records if r["status"] == "ok"]
        assert sizes and sum(size != 3 for size in sizes) <= 1 and min(sizes) >= 2, (name, sizes)
    for name, records in report["records"].items():
        # rounds of 10 small inner steps last under a second here: a peer may miss one (a partial all-reduce, then
        # a catch-up by download), never more, and never by training apart
        steps = [r["outer_step"] for r in records if r["status"] == "ok"]
        assert len(steps) >= 5 and steps == sorted(set(steps)), (name, steps)


@pytest.mark.timeout(200)
def test_swarm_py_with_a_muon_island_among_adamw_ones_is_one_swarm(tmp_path):
    """The inner optimizer stays on its island (docs/design.md §2): a peer with Muon and one with AdamW average into
    the same bytes at every outer step, and the swarm learns."""
    out = tmp_path / "mixed"
    command = [sys.executable, str(SWARM), "--peers", "2", "--out", str(out), "--inner-steps", "10", "--batch-size", "8",
               "--seq-len", "64", "--max-outer-steps", "4", "--peer-flag", "1:--inner-optimizer=muon"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert '"optimizer": "adamw"' in (out / "peer0.log").read_text()
    assert '"optimizer": "muon"' in (out / "peer1.log").read_text()
    report = json.loads((out / "report.json").read_text())
    assert report["invariant_1"]["status"] == "held", report["invariant_1"]
    for name, peer in report["peers"].items():
        assert peer["final_outer_step"] == 4 and peer["forks_healed"] == 0, (name, peer)
    for name, records in report["records"].items():
        assert sum(r["status"] == "ok" and r["group_size"] == 2 for r in records) >= 3, name
    assert report["final_eval_loss"] < report["initial_eval_loss"] - 1, (report["initial_eval_loss"], report["final_eval_loss"])
    # the two took turns at the held-out loss (docs/design.md §2, --eval-shared): the last step's, one of them
    evaluated = collections.Counter(r["outer_step"] for records in report["records"].values() for r in records
                                    if r["eval_loss"] is not None and r["status"] == "ok")
    assert evaluated[4] == 1 and set(evaluated.values()) == {1}, evaluated


def _cpu_has_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


@pytest.mark.timeout(240)
@pytest.mark.skipif(not _cpu_has_fma(), reason="needs an x86 CPU with AVX2 and FMA (torch's kernels that fuse)")
def test_a_peer_whose_arithmetic_differs_says_so_and_heals(tmp_path, reaper):
    """A peer with a non-portable outer step (the ``add(alpha=)`` of earlier releases) on AVX2 kernels, which fuse
    it into one multiply-add, beside two portable peers on the default kernels: it computes other bytes for steps
    its own group made, names them in one log line and in its metrics, and takes the others' state, while the two
    portable peers agree on every step they both averaged. (On the default kernels that old step rounds twice,
    exactly as the portable one does: only the fused one differs.)"""
    swarm = LocalSwarm(tmp_path, [*FAST_PEER_FLAGS, "--inner-steps", "10", "--max-outer-steps", "5",
                                  "--wait-for-peers", "3"], on_start=reaper.append)
    default = {"ATEN_CPU_CAPABILITY": "default"}
    try:
        swarm.start("odd", shard=0, num_shards=3, entry=[str(NONPORTABLE_PEER)], env={"ATEN_CPU_CAPABILITY": "avx2"})
        swarm.start("peer1", shard=1, num_shards=3, env=default)
        swarm.start("peer2", shard=2, num_shards=3, env=default)
        swarm.wait_all_exited(180)
    finally:
        swarm.stop_all()
    report = build_report({name: peer.metrics_file for name, peer in swarm.peers.items()})
    odd = report["peers"]["odd"]
    assert odd["arithmetic_mismatches"] >= 1 and odd["forks_healed"] >= odd["arithmetic_mismatches"], odd
    log = swarm.peers["odd"].log_file.read_text()
    # said at the step itself ("from 2 of 2 groupmates"), or from a donor's history when the others had moved on
    # before it looked ("from its group of 3"); a round whose group was the odd peer and one other blames nobody
    said = r"(this peer's hardware computed outer step \d+ differently|outer step \d+ came out as other bytes on this peer)"
    assert re.search(said, log), log[-3000:]
    # the group's majority decides which bytes go on (a fork waits for the groupmates still applying the step), so
    # a portable peer blames its own hardware nowhere
    for name in ("peer1", "peer2"):
        assert "this peer's hardware" not in swarm.peers[name].log_file.read_text(), name
    # the two portable peers computed every step they both made by averaging to the same bytes
    averaged = [{r["outer_step"]: r["global_sha256"] for r in report["records"][name] if r["status"] == "ok"}
                for name in ("peer1", "peer2")]
    both = set(averaged[0]) & set(averaged[1])
    assert len(both) >= 3 and all(averaged[0][step] == averaged[1][step] for step in both), averaged
    # and every peer ends on the same bytes (the odd one took the others' state, or sat a round out and caught up)
    finals = {name: records[-1]["global_sha256"] for name, records in report["records"].items()}
    assert len(set(finals.values())) == 1, finals


@pytest.mark.timeout(120)
def test_the_launcher_names_a_peer_that_cannot_join_and_exits_non_zero(tmp_path):
    # peer2's Python cannot even start (no standard library where PYTHONHOME points)
    command = [sys.executable, str(SWARM), "--peers", "3", "--out", str(tmp_path / "out"), "--max-outer-steps", "2",
               "--peer-env", "2:PYTHONHOME=/nonexistent"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=110)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("swarm.py: error: peer2 exited with code"), done.stderr[-2000:]
    assert "before it was in the swarm" in errors[0]


@pytest.mark.timeout(300)
def test_gpu_island_script_runs_its_cpu_parts(tmp_path):
    """scripts/gpu_island.py without a GPU: the byte comparison on the CPU's kernel sets, and one swarm of a bf16
    island (autocast on the CPU here) beside two fp32 islands for 6 outer steps, every island weighted."""
    out = tmp_path / "gpu-island"
    command = [sys.executable, str(ROOT / "scripts" / "gpu_island.py"), "--out", str(out), "--device", "cpu",
               "--outer-steps", "6", "--timeout-s", "200", *FAST_PEER_FLAGS, "--inner-steps", "10"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "gpu_island.json").read_text())
    assert result["bytes_same"] and result["clean"] and result["invariant_1"]["status"] == "held"
    assert {run["capability"] for run in result["bytes_runs"]} >= {"DEFAULT"} and len(result["bytes_runs"]) == 2
    islands = {row["island"]: row for row in result["islands"]}
    assert islands["island0"]["precision"] == "bf16" and islands["island1"]["precision"] == "fp32"
    assert "inner steps in bf16" in (out / "island0.log").read_text()  # autocast on the CPU, as a GPU island's
    assert "inner steps in fp32" in (out / "island1.log").read_text()
    for row in islands.values():
        assert row["outer_steps"] >= 6 and row["forks_healed"] == 0 and row["tokens_per_s"] > 0, row
        assert 0.0 < row["weight_share"] < 1.0 and max(row["group_sizes"]) == 3, row
    assert "weight share" in done.stdout and "invariant 1: held" in done.stdout
