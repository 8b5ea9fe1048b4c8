"""Centered clipping (robust.py): adversaries just under every threshold move a part's average by no more than the
stated bound, 2 (W_adv / W) tau, against the clipped mean of the honest senders; a group of two clips the other's
deviation against our own part; a reducer's result is checked against the norms the group declared."""

from __future__ import annotations

import math

import torch

from p2p_diloco.core.portable import seeded_normal
from p2p_diloco.core.robust import RobustPolicy, coordinate_median, result_problem, robust_average

SHAPE = torch.Size([4096])
POLICY = RobustPolicy()


def _honest(index: int) -> torch.Tensor:
    # honest outer gradients share a direction and differ by noise: their parts correlate
    return seeded_normal(4096, "shared").mul_(0.01) + seeded_normal(4096, f"honest {index}").mul_(0.005)


def test_two_adversaries_of_five_just_under_every_threshold_move_the_average_by_at_most_the_bound():
    honest = [_honest(i) for i in range(3)]
    # the adversaries push one direction, 90x the honest norm per token (under the 100x the reducer refuses), and
    # declare 9.5x the median weight (under the 10x cap)
    push = seeded_normal(4096, "attack")
    push.mul_(90 * float(honest[0].norm()) / float(push.norm()))
    parts = [*honest, push, push.clone()]
    weights = [1000.0, 1100.0, 900.0, 9500.0, 9500.0]
    result, notes, left_out = robust_average(parts, weights, [None] * 5, SHAPE, POLICY)
    assert not left_out  # nobody is over a threshold: all are averaged, the adversaries clipped
    assert {3, 4} <= set(notes) and all("cut" in notes[i] or "clamped" in notes[i] for i in (3, 4))

    clamped = [min(w, POLICY.max_weight_ratio * sorted(weights)[2]) for w in weights]
    centre = torch.stack(parts).median(dim=0).values
    deviations = [p - centre for p in parts]
    radius = POLICY.clip_ratio * sorted(float(d.norm()) for d in deviations)[2]
    clipped = [d * min(1.0, radius / float(d.norm())) for d in deviations]
    honest_weight = sum(clamped[:3])
    honest_mean = centre + sum(w * c for w, c in zip(clamped[:3], clipped[:3])) / honest_weight
    share = sum(clamped[3:]) / sum(clamped)
    moved = float((result - honest_mean).norm())
    assert moved <= 2 * share * radius * (1 + 1e-4)
    plain = sum(w * p for w, p in zip(clamped, parts)) / sum(clamped)  # a plain weighted mean, for scale
    assert moved < float((plain - honest_mean).norm()) / 20


def test_in_a_group_of_two_the_other_is_clipped_against_our_own_part():
    own, other = _honest(0), _honest(1) * 50  # 50x our norm, with the same declared weight
    radius_only = RobustPolicy(norm_clip_ratio=math.inf)  # the pair's radius alone: no norm clipping first
    result, notes, _ = robust_average([own, other], [1000.0, 1000.0], [None, None], SHAPE, radius_only, own=0)
    deviation = float((other - own).norm())
    limit = POLICY.pair_clip_ratio * float(own.norm())
    expected = own + (other - own) * (limit / deviation) / 2
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-7)
    assert "cut" in notes[1]
    # a peer that trained 4x the tokens may deviate 4x as far (capped at result_weight_scale_cap)
    bigger, _, _ = robust_average([own, other], [1000.0, 4000.0], [None, None], SHAPE, radius_only, own=0)
    assert float((bigger - own).norm()) > 3 * float((result - own).norm())
    # with the norm clip (the default) the other's part is first cut to our norm (times norm_clip_ratio): it moves the
    # average less
    clipped, notes, _ = robust_average([own, other], [1000.0, 1000.0], [None, None], SHAPE, POLICY, own=0)
    assert "norm" in notes[1]
    cut = other * (POLICY.norm_clip_ratio * float(own.norm()) / float(other.norm()))
    torch.testing.assert_close(clipped, (own + cut) / 2)
    assert float((clipped - own).norm()) < 0.8 * float((result - own).norm())
    # two honest peers of about the same size: the radius cuts nothing, the norm clip at most the larger part to the
    # smaller's norm (a few percent here), which no note names
    calm, notes, _ = robust_average([own, _honest(1)], [1000.0, 1000.0], [None, None], SHAPE, POLICY, own=0)
    smaller = min(float(own.norm()), float(_honest(1).norm()))
    expected = sum(p * min(1.0, POLICY.norm_clip_ratio * smaller / float(p.norm())) for p in (own, _honest(1))) / 2
    torch.testing.assert_close(calm, expected, rtol=1e-5, atol=1e-7)
    assert float((calm - (own + _honest(1)) / 2).norm()) < 0.05 * float(calm.norm())
    assert not notes


def test_one_acceptable_sender_averages_to_its_own_part_exactly():
    # a group of two whose other member never sent (or was left out): the part is ours alone. This raised
    # StopIteration inside the reducer, whose part then waited for the round's timeout (docs/design.md §6)
    own = _honest(0)
    far = _honest(1) * 1e4  # over the norm per token any group accepts: left out, which leaves ours alone
    for parts in ([own], [own, far]):
        for ours in (0, None):
            result, _, left_out = robust_average(parts, [1000.0] * len(parts), [None] * len(parts), SHAPE, POLICY, own=ours)
            assert torch.equal(result, own) and 0 not in left_out and left_out == frozenset(range(1, len(parts)))


def test_a_result_is_checked_against_the_norms_the_group_declared():
    sent = _honest(0)
    declared = [float(sent.norm()), float(_honest(1).norm()), 1e6]  # a liar among the three declares a huge norm
    median = sorted(declared)[1]
    assert result_problem(sent * 5, sent, POLICY, declared_norms=declared) is None
    problem = result_problem(sent * (POLICY.result_median_ratio * median / float(sent.norm()) * 1.1), sent, POLICY,
                             declared_norms=declared)
    assert problem is not None and "median norm the group declared" in problem
    # with no declared norms (an earlier version), the looser check against what we sent
    assert result_problem(sent * 50, sent, POLICY) is None and result_problem(sent * 200, sent, POLICY) is not None


def test_the_coordinate_median_is_exactly_what_a_sort_selects():
    """The sorting network against torch's sort along the stacking dimension, bit for bit, for 1 to 7 rows: random
    values, ties (rows equal in some coordinates), and rows that are all one value."""
    generator = torch.Generator().manual_seed(5)
    for count in range(1, 8):
        rows = [torch.randn(4096, generator=generator) for _ in range(count)]
        if count >= 2:
            rows[1][:1000] = rows[0][:1000]  # ties
        rows.append(torch.full((4096,), 0.25))
        for group in (rows[:count], rows[: count + 1]):
            ordered = torch.stack(group).sort(dim=0).values
            n = len(group)
            expected = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
            assert torch.equal(coordinate_median(group), expected), n
    assert torch.equal(coordinate_median([torch.tensor([3.0, -1.0]), torch.tensor([1.0, 2.0]),
                                          torch.tensor([2.0, 0.5])]), torch.tensor([2.0, 0.5]))
