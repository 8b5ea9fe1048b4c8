"""One rank of a 2-rank CPU island (gloo), started by tests/integration/test_island.py with torchrun's environment.

Runs, in one process group, islands of a swarm of one (LocalLink, no DHT): a DDP island and an FSDP island from
the same start for 2 outer steps; an FSDP island stopped after 1 outer step and resumed from its checkpoint to
2; then a shard corrupted on rank 1 after a scatter. Writes what the test compares to OUT/rank<R>.pt.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

from p2p_diloco.cli.peer import open_process_inputs
from p2p_diloco.core.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, PeerConfig, RunConfig
from p2p_diloco.core.link import LocalLink
from p2p_diloco.train.island import Island, IslandDiverged
from p2p_diloco.train.learner import Learner


def _config(corpus: str, out: Path, name: str, max_outer_steps: int, **run: object) -> PeerConfig:
    return PeerConfig(
        model=ModelConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16),
        data=DataConfig(corpus_dir=corpus),
        inner=InnerConfig(inner_steps=3, batch_size=4, lr=1e-3, weight_decay=0.1, grad_clip_norm=1.0),
        outer=OuterConfig(lr=0.7, momentum=0.9),
        # eval_every 1: the held-out losses of two runs are compared step by step; the default schedule follows
        # measured timings, and one run skipped an evaluation the other made (a CI failure)
        run=RunConfig(max_outer_steps=max_outer_steps, eval_batches=1, eval_every=1, seed=3,
                      metrics_file=str(out / f"{name}.jsonl"), **run),
    )


def _train(config: PeerConfig, island: Island, resume: bool = False) -> Learner:
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, resume=resume))
    dataset, metrics = open_process_inputs(config, island)
    learner = Learner(config, dataset, metrics, island=island)
    if island.is_leader:
        if resume:
            learner.resume()
        learner.run(LocalLink("none"))
    else:
        learner.follow()
    metrics.close()
    return learner


def _full(learner: Learner) -> list[torch.Tensor]:
    """Every rank: the model's local params, whole (FSDP: all-gathered from the shards; a collective)."""
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in learner.params]


def main(out: Path, corpus: str) -> None:
    torch.set_num_threads(1)
    ddp_island = Island.from_environment(os.environ, timeout_s=60)  # starts the process group, gloo
    rank, size = ddp_island.rank, ddp_island.size
    result: dict[str, object] = {}

    ddp = _train(_config(corpus, out, "ddp", 2), ddp_island)
    result["ddp_global"], result["ddp_local"] = ddp.global_params, _full(ddp)

    straight = _train(_config(corpus, out, "fsdp", 2), Island(rank, size, sharding="fsdp"))
    result["fsdp_global"], result["fsdp_local"] = straight.global_params, _full(straight)
    result["fsdp_shard_numels"] = [p.to_local().numel() for p in straight.params]
    result["fsdp_outer_step"] = straight.outer_step

    checkpoints = str(out / "checkpoints")
    _train(
        _config(corpus, out, "split", 1, checkpoint_dir=checkpoints, checkpoint_every=1),
        Island(rank, size, sharding="fsdp"),
    )
    resumed_island = Island(rank, size, sharding="fsdp")
    resumed = _train(_config(corpus, out, "resumed", 2, checkpoint_dir=checkpoints), resumed_island, resume=True)
    result["resumed_global"], result["resumed_local"] = resumed.global_params, _full(resumed)
    result["resumed_outer_step"] = resumed.outer_step

    # rank 1's shards go wrong right after a scatter: rank 1 must notice, rank 0 (whose shards are right) not
    sharded = resumed_island._local
    if rank == 1:
        scatter = sharded.scatter

        def scatter_then_flip() -> None:
            scatter()
            with torch.no_grad():
                sharded.params[0].to_local().view(-1)[0] += 1.0

        sharded.scatter = scatter_then_flip
    else:
        with torch.no_grad():
            resumed_island.local_params()[0].add_(0.5)  # a change of rank 0's local params, to be scattered
    try:
        resumed_island.sync(False, resumed.outer_step + 1, "forced", resumed.global_params)
        result["diverged"] = ""
    except IslandDiverged as e:
        result["diverged"] = str(e)
    torch.save(result, out / f"rank{rank}.pt")
    ddp_island.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
