"""Streaming fragments: a balanced contiguous split, and each outer step touching only its own fragment."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import InnerConfig, OuterConfig, RunConfig
from p2p_diloco.learner import Learner, partition_fragments
from p2p_diloco.link import LocalLink
from p2p_diloco.metrics import NullSink

from .helpers import make_dataset, snapshot


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_partition_is_contiguous_complete_and_balanced(count):
    params = [torch.zeros(n) for n in (100, 10, 300, 50, 50, 200, 90, 200)]
    fragments = partition_fragments(params, count)
    assert len(fragments) == count and all(fragments)
    assert [i for fragment in fragments for i in fragment] == list(range(len(params)))
    sizes = [sum(params[i].numel() for i in fragment) for fragment in fragments]
    assert max(sizes) <= sum(sizes) / count + 300  # within one tensor of an even split


def test_more_fragments_than_tensors_is_refused():
    with pytest.raises(ValueError, match="fragments"):
        partition_fragments([torch.zeros(3), torch.zeros(3)], 3)


def test_each_outer_step_updates_only_its_fragment(make_config):
    config = make_config(
        inner=InnerConfig(inner_steps=2, batch_size=2, fragments=2),
        outer=OuterConfig(lr=1.0, momentum=0.0),
        run=RunConfig(max_outer_steps=1, eval_batches=1),
    )
    learner = Learner(config, make_dataset(config), NullSink())
    initial = snapshot(learner.global_params)
    learner.run(LocalLink("none"))
    assert learner.outer_step == 1
    first, second = learner.fragments
    for i in second:  # not synced yet: the global params of fragment 1 are still the initial ones
        assert torch.equal(learner.global_params[i], initial[i])
    for i in first:  # synced with outer lr 1 alone in the swarm: global = the local params that were sent
        assert not torch.equal(learner.global_params[i], initial[i])
        torch.testing.assert_close(learner.global_params[i], learner.params[i])
    # the averaging carried one flat buffer sized for the larger fragment, not the whole model
    (template,) = learner.averaging_template()
    assert template.numel() == max(sum(learner.params[i].numel() for i in f) for f in learner.fragments)
