"""Streaming fragments: a balanced split of whole tensors, and each outer step touching only its own fragment."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.core.config import InnerConfig, OuterConfig, RunConfig
from p2p_diloco.core.link import LocalLink
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.fragments import Fragments, partition_fragments
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.recorder import SendRate

from .helpers import make_dataset, snapshot


@pytest.mark.parametrize("count", [1, 2, 3, 5, 7])
def test_partition_is_complete_balanced_and_keeps_tensors_whole(count):
    sizes = (100, 10, 300, 50, 50, 200, 90, 200, 3)
    params = [torch.zeros(n) for n in sizes]
    fragments = partition_fragments(params, count)
    assert len(fragments) == count and all(fragments)
    # every value of every tensor lies in exactly one fragment
    seen = sorted((s.index, v) for fragment in fragments for s in fragment for v in range(s.start, s.stop))
    assert seen == [(i, v) for i, p in enumerate(params) for v in range(p.numel())]
    share = sum(sizes) // count
    for fragment in fragments:
        for s in fragment:  # a tensor no larger than a fragment's share is never cut
            if sizes[s.index] <= share:
                assert (s.start, s.stop) == (0, sizes[s.index])
            else:
                assert s.stop - s.start <= share
    totals = [sum(s.stop - s.start for s in fragment) for fragment in fragments]
    largest_piece = max(s.stop - s.start for fragment in fragments for s in fragment)
    assert max(totals) - min(totals) <= largest_piece  # largest-first into the least filled
    assert partition_fragments([torch.zeros(n) for n in sizes], count) == fragments  # the same split on every peer


def test_a_tensor_larger_than_a_share_is_cut_into_contiguous_slices():
    fragments = partition_fragments([torch.zeros(1000), torch.zeros(10)], 4)
    big = sorted((s.start, s.stop) for fragment in fragments for s in fragment if s.index == 0)
    assert big == [(0, 250), (250, 500), (500, 750), (750, 1000)]


def test_one_fragment_is_the_whole_tensors():
    params = [torch.zeros(2, 3), torch.zeros(4)]
    assert partition_fragments(params, 1) == [[(0, 0, 6), (1, 0, 4)]]


@pytest.mark.parametrize("count", [1, 3])
def test_an_averaging_carries_one_flat_buffer_and_unpacks_to_each_segment(count):
    """One buffer, with one fragment too: hivemind cuts each tensor of an averaging into parts of its own, so the
    params' small tensors would each be a message (train/fragments.py)."""
    params = [torch.arange(6.0).view(2, 3), torch.arange(4.0) + 10, torch.arange(5.0) + 20]
    fragments = Fragments(params, count)
    (template,) = fragments.template()
    assert template.dim() == 1 and template.numel() == max(sum(s.stop - s.start for s in f) for f in fragments)
    for segments in fragments:
        pieces = [s.of(params) for s in segments]
        (packed,) = fragments.pack(pieces)
        assert packed.shape == template.shape and not any(packed.data_ptr() == p.data_ptr() for p in params)
        assert all(torch.equal(a, b) for a, b in zip(fragments.unpack([packed], segments), pieces, strict=True))
    if count == 1:
        assert template.numel() == 15 and torch.equal(fragments.pack([s.of(params) for s in fragments[0]])[0],
                                                      torch.cat([p.reshape(-1) for p in params]))


def test_more_fragments_than_values_is_refused():
    with pytest.raises(ValueError, match="fragments"):
        partition_fragments([torch.zeros(3), torch.zeros(3)], 7)


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
    for s in second:  # not synced yet: the global params of fragment 1 are still the initial ones
        assert torch.equal(s.of(learner.global_params), s.of(initial))
    for s in first:  # synced with outer lr 1 alone in the swarm: global = the local params that were sent
        assert not torch.equal(s.of(learner.global_params), s.of(initial))
        torch.testing.assert_close(s.of(learner.global_params), s.of([p.detach() for p in learner.params]))
    # the averaging carried one flat buffer of half the model (to one value per tensor), not the whole model
    (template,) = learner.averaging_template()
    total = sum(p.numel() for p in learner.params)
    assert template.numel() == max(sum(s.stop - s.start for s in f) for f in learner.fragments)
    largest = max(p.numel() for p in learner.params)
    assert total // 2 <= template.numel() <= total // 2 + largest


def test_peak_send_rate_is_the_largest_burst_over_a_sliding_second():
    rate, sent = SendRate(), 0
    # an inner step every 0.25 s; 400 kB trickle over 2 s, then 1 MB in a single step at t = 3.1
    for step in range(24):
        now = step * 0.25 + (0.1 if step == 12 else 0.0)
        if 1 <= step <= 8:
            sent += 50_000
        if step == 12:
            sent += 1_000_000
        rate.sample(sent, now)
    # at t = 3.1 the window reaches back to t = 2.0 (1.1 s); one step later, to t = 2.25 (1.0 s): the largest
    # rate is the burst over one second, while the trickle never exceeded 200 kB/s
    assert rate.take() == pytest.approx(1_000_000 / 1.0)
    assert rate.take() == 0.0  # taken: the next record starts afresh
