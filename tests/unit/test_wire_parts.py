"""How an averaging is cut into all-reduce parts (swarm/wire.py): one part per reducer where hivemind's default part
allows, every part whole norm blocks, and the norms a member declared per block adding up to each part's norm."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.partition import TensorPartContainer

from p2p_diloco.core.compression import make_codec
from p2p_diloco.core.robust import RobustPolicy
from p2p_diloco.swarm.guarded_runner import RoundGuard
from p2p_diloco.swarm.wire import WireCodec, largest_part_values, part_blocks, part_norms_of, part_values_for


def _container(tensors: list[torch.Tensor], fractions, codec: WireCodec) -> TensorPartContainer:
    return TensorPartContainer(tensors, fractions, compression=codec)


def _group_codec(name: str, numels: list[int], fractions) -> WireCodec:
    codec = make_codec(name)
    return WireCodec(codec, part_values_for(codec, sum(numels))).for_group(numels, fractions)


@pytest.mark.parametrize("name", ["int8", "int4", "none"])
@pytest.mark.parametrize("total", [841_216, 300_001, 100_000])
@pytest.mark.parametrize("bandwidths", [[None] * 2, [None] * 3, [None] * 4, [None] * 5, [None, 0.0, None, None]])
def test_each_reducer_gets_its_share_in_one_part(name, total, bandwidths):
    fractions = load_balance_peers(total, bandwidths, 0)  # what hivemind hands the runner (0: a client)
    codec = _group_codec(name, [total], fractions)
    container = _container([torch.zeros(total)], fractions, codec)
    reducers = [f > 0 for f in fractions]
    even = total / sum(reducers)
    parts_each = math.ceil(even / largest_part_values(codec.codec))  # 1 unless a share is over hivemind's part
    assert container.num_parts_by_peer == tuple(parts_each * int(r) for r in reducers)
    assert codec.part_values % codec.block_values == 0 and codec.part_values <= largest_part_values(codec.codec)
    shares = [sum(part.numel() for part, _ in parts) for parts in container._input_parts_by_peer]
    assert sum(shares) == total
    # whole blocks cost each share at most a few blocks of evenness, the last reducer taking the remainder
    assert all(abs(share - even) <= codec.block_values * (len(fractions) + parts_each) for share, r in zip(shares, reducers) if r)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_share_larger_than_hivemind_part_is_cut_into_parts_no_larger(name):
    total = 3 * largest_part_values(make_codec(name)) + 12_345
    fractions = load_balance_peers(total, [None, None], 0)
    codec = _group_codec(name, [total], fractions)
    assert codec.part_values <= largest_part_values(codec.codec)
    container = _container([torch.zeros(total)], fractions, codec)
    assert all(part.numel() <= codec.part_values for parts in container._input_parts_by_peer for part, _ in parts)
    assert min(container.num_parts_by_peer) >= 1


def test_without_a_group_the_parts_are_the_blocks():
    codec = make_codec("int8")
    block = part_values_for(codec, 841_216)
    wire = WireCodec(codec, block)
    assert wire.part_values == wire.block_values == block
    assert wire.for_group([841_216], ()) is wire  # no fractions (not hivemind's all-reduce): unchanged


@pytest.mark.parametrize("numels", [[841_216], [5_000, 70_000, 1, 33_333], [40_000, 40_000]])
@pytest.mark.parametrize("peers", [2, 3, 4])
def test_part_blocks_follow_hivemind_cut_and_declared_norms_add_up(numels, peers):
    generator = torch.Generator().manual_seed(sum(numels) + peers)
    tensors = [torch.randn(n, generator=generator) for n in numels]
    fractions = load_balance_peers(sum(numels), [None] * peers, 0)
    codec = _group_codec("int8", numels, fractions)
    container = _container(tensors, fractions, codec)
    parts = [part for by_peer in container._input_parts_by_peer for part, _ in by_peer]
    blocks = part_blocks(numels, codec.block_values, codec.part_values)
    declared = part_norms_of(tensors, codec.block_values)
    assert len(blocks) == len(parts)
    assert [i for r in blocks for i in r] == list(range(len(declared)))  # every block in exactly one part, in order

    guard = RoundGuard(RobustPolicy(), {})
    guard.part_norms = [declared, [n * 2 for n in declared], [1.0]]  # the last declared per part of another cut
    for part, covered in zip(parts, blocks):
        norms = guard.declared_norms(covered, len(declared))
        assert norms is not None and len(norms) == 2
        assert norms[0] == pytest.approx(float(part.norm()), rel=1e-5)
        assert norms[1] == pytest.approx(2 * float(part.norm()), rel=1e-5)


def test_declared_norms_need_half_the_group():
    guard = RoundGuard(RobustPolicy(), {})
    guard.part_norms = [[3.0, 4.0], [], [1.0]]
    assert guard.declared_norms(range(0, 2), 2) is None  # one member of three declared per block
    guard.part_norms = [[3.0, 4.0], [0.0, 0.0], []]
    assert guard.declared_norms(range(0, 2), 2) == [5.0, 0.0]
    assert math.isclose(guard.declared_norms(range(1, 2), 2)[0], 4.0)
