"""A torchrun island of 2 CPU ranks (DDP over gloo) and a single-process peer in one swarm on 127.0.0.1; an FSDP
island of 2 CPU ranks against a DDP one, its checkpoint and resume, and its shard check (island_worker.py)."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from p2p_diloco.cli.peer_processes import start_peer, wait_for_address
from p2p_diloco.core import checkpoint
from p2p_diloco.core.config import DataConfig, InnerConfig, ModelConfig, PeerConfig, RunConfig
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.observe.report import check_invariant_1
from p2p_diloco.train.data import open_dataset
from p2p_diloco.train.learner import Learner

from .harness import PEER_SCRIPT, local_swarm

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


def _failure_logs(swarm) -> str:
    """The peers' log tails, the island's longer and without its sha256 lines: torchrun's summary of a failed
    rank hides that rank's own last words above it."""
    island = [line for line in swarm.peers["island"].log_file.read_text(errors="replace").splitlines() if not _SHA_LINE.search(line)]
    return "--- island\n" + "\n".join(island[-80:]) + "\n--- solo\n" + swarm.log_tail("solo")


@pytest.mark.timeout(200)
def test_torchrun_island_averages_with_a_single_peer_and_its_ranks_stay_identical(tmp_path, reaper):
    # the island starts first, as the swarm's first peer: torchrun and two ranks importing torch are the slowest
    # to start on a loaded 2-core machine; both peers begin training once both are in the swarm
    # 12 s of training together: ~20 rounds here (of ~0.7 s), where the checks below need 3
    swarm = local_swarm(tmp_path, reaper, ["--wait-for-peers", "2", "--max-time-s", "12"])
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
    assert all(p.process.returncode == 0 for p in swarm.peers.values()), _failure_logs(swarm)

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


def _small_corpus(root: Path) -> str:
    """4 generated text files, about 100 KB in all."""
    rng = random.Random(1)
    words = "def class return import yield lambda for while if else try except with as pass None".split()
    root.mkdir()
    for index in range(4):
        lines = (" ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(8)) for _ in range(600))
        (root / f"part_{index}.txt").write_text("\n".join(lines), encoding="utf-8")
    return str(root)


def _assert_equal(actual, expected, **tolerances) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, **tolerances)


@pytest.mark.timeout(150)
def test_fsdp_island_trains_like_ddp_resumes_and_catches_a_wrong_shard(tmp_path, reaper):
    corpus = _small_corpus(tmp_path / "corpus")
    worker = Path(__file__).with_name("island_worker.py")
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONPATH=repo)
    ranks = []
    for rank in range(2):  # what torchrun would start: one process per rank, told its place by the environment
        log = (tmp_path / f"rank{rank}.log").open("wb")
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        ranks.append(subprocess.Popen(
            [sys.executable, str(worker), str(tmp_path), corpus], env=rank_env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        ))
        reaper.append(ranks[-1].pid)
    for process in ranks:
        process.wait(timeout=120)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text(errors="replace")[-3000:] for r in range(2))
    assert [p.returncode for p in ranks] == [0, 0], logs
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    leader = results[0]

    # each rank held half of every tensor (dim 0), not all of it
    full_numels = [t.numel() for t in leader["fsdp_global"]]
    assert [a + b for a, b in zip(leader["fsdp_shard_numels"], results[1]["fsdp_shard_numels"])] == full_numels
    assert all(shard < full for shard, full in zip(leader["fsdp_shard_numels"], full_numels) if full > 1)
    # (a) the FSDP island's inner and outer steps give the DDP island's params (same data, same total batch)
    assert leader["fsdp_outer_step"] == 2
    _assert_equal(leader["fsdp_global"], leader["ddp_global"], rtol=1e-5, atol=1e-5)
    _assert_equal(leader["fsdp_local"], leader["ddp_local"], rtol=1e-5, atol=1e-5)
    initial = Learner(_worker_config(corpus), _dataset(_worker_config(corpus)), NullSink()).global_params
    assert any(not torch.allclose(t, i, atol=1e-3) for t, i in zip(leader["fsdp_global"], initial))  # it did train
    losses = {name: [r["eval_loss"] for r in _records(tmp_path / f"{name}.jsonl")] for name in ("ddp", "fsdp")}
    assert len(losses["fsdp"]) == 3 and losses["fsdp"][-1] < losses["fsdp"][0], losses
    torch.testing.assert_close(losses["fsdp"], losses["ddp"], rtol=1e-5, atol=1e-5)
    # (b) after the last outer step every rank's whole local params are rank 0's new global params, bit for bit
    for result in results:
        _assert_equal(result["fsdp_local"], leader["fsdp_global"], rtol=0, atol=0)
    # (c) stopped after 1 outer step and resumed from its checkpoint: bit-identical to the run that did not stop
    assert leader["resumed_outer_step"] == 2
    _assert_equal(leader["resumed_global"], leader["fsdp_global"], rtol=0, atol=0)
    for result in results:
        _assert_equal(result["resumed_local"], leader["fsdp_local"], rtol=0, atol=0)
    # a shard that does not hold what rank 0 scattered stops that rank (and only that one)
    assert leader["diverged"] == ""
    assert "island rank 1 holds other shards than rank 0 sent" in results[1]["diverged"]

    # the FSDP island's checkpoint is a plain one: a single process resumes from it
    path = tmp_path / "checkpoints" / "outer_step_00000001.pt"
    saved = checkpoint.load(path)
    assert saved["inner_optimizer"]["state"], "the checkpoint lacks the inner AdamW state"
    config = _worker_config(corpus, checkpoint_dir=str(tmp_path / "checkpoints"), resume=True)
    single = Learner(config, _dataset(config), NullSink())
    assert single.resume() == tmp_path / "checkpoints" / "outer_step_00000002.pt"
    saved = checkpoint.load(single.resumed_from)
    _assert_equal(single.params, [saved["local_model"][n] for n, _ in single.model.named_parameters()], rtol=0, atol=0)
    moments = [single.inner.state[p]["exp_avg"] for p in single.params]
    _assert_equal(moments, [saved["inner_optimizer"]["state"][i]["exp_avg"] for i in range(len(moments))], rtol=0, atol=0)


def _worker_config(corpus: str, **run) -> PeerConfig:
    """The island_worker.py model and data (its outer and inner settings do not matter here)."""
    return PeerConfig(
        model=ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16),
        data=DataConfig(corpus_dir=corpus),
        inner=InnerConfig(inner_steps=3, batch_size=4),
        run=RunConfig(eval_batches=1, seed=3, **run),
    )


def _dataset(config: PeerConfig):
    return open_dataset(config.data, config.model.seq_len, config.inner.batch_size, config.run.seed)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
