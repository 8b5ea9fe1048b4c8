"""The island's single-process path and its data split (the multi-rank path runs in tests/integration/test_island.py)."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, resolve_config
from p2p_diloco.core.config import DataConfig, PeerConfig, RunConfig
from p2p_diloco.train.island import Island, collective_timeout_s


def test_without_torchrun_the_island_is_one_process_and_changes_nothing():
    island = Island.from_environment({}, timeout_s=10)
    assert (island.rank, island.size, island.is_leader) == (0, 1, True)
    data = DataConfig(shard_index=1, num_shards=3)
    assert island.shard(data) is data
    model = torch.nn.Linear(2, 2)
    assert island.wrap(model) is model
    optimizer = torch.optim.AdamW(model.parameters())
    island.attach(model, optimizer, [p.detach() for p in model.parameters()])
    assert island.local_params() == list(model.parameters())
    assert island.sync(True, 7, "sha", [torch.ones(2)]) == (True, 7)
    assert island.share_start(3) == 3


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_split_the_island_shard_into_disjoint_sub_shards(size):
    data = DataConfig(shard_index=1, num_shards=3)
    shards = [Island(rank, size).shard(data) for rank in range(size)]
    assert all(s.num_shards == 3 * size for s in shards)
    # the island's shard 1 of 3 covers exactly sub-shards size ... 2*size - 1 of 3*size
    assert [s.shard_index for s in shards] == list(range(size, 2 * size))


def test_collectives_outlast_every_wait_of_rank_zero():
    config = PeerConfig()
    swarm = config.swarm
    assert collective_timeout_s(config) > swarm.startup_timeout_s + swarm.averaging_timeout_s + swarm.state_timeout_s
    with pytest.raises(ValueError):
        Island(rank=2, size=2)


def test_fsdp_needs_a_torchrun_island_of_two_ranks_or_more():
    with pytest.raises(ValueError, match="fsdp needs a torchrun island of 2 or more ranks"):
        Island.from_environment({}, timeout_s=10, sharding="fsdp")
    with pytest.raises(ValueError, match="run.island_sharding must be one of ddp, fsdp"):
        RunConfig(island_sharding="zero3")
    assert Island.from_environment({}, timeout_s=10, sharding="ddp").size == 1


def test_the_sharding_flag_sets_the_run_config_and_defaults_to_ddp():
    parser = OneLineParser(prog="t")
    add_peer_flags(parser)
    assert resolve_config(parser.parse_args([])).run.island_sharding == "ddp"
    assert resolve_config(parser.parse_args(["--island-sharding", "fsdp"])).run.island_sharding == "fsdp"
