"""Cross-checked averaging's rules (core/cross_check.py): who reduces each share the second time, which shares
disagree, and whom a disagreement blames."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.core.cross_check import agreed_limits, disagreeing_shares, second_order, suspects


def test_each_share_goes_to_the_next_reducer_and_non_reducers_keep_their_place():
    assert second_order(["a", "b", "c"], [0.3, 0.3, 0.4]) == ["b", "c", "a"]
    assert second_order(["a", "b"], [0.5, 0.5]) == ["b", "a"]
    # b is a client (or demoted): it reduces nothing either time, and the shares of a and c swap reducers
    assert second_order(["a", "b", "c"], [0.5, 0.0, 0.5]) == ["c", "b", "a"]
    for peers, fractions in ((list("abcde"), [0.2] * 5), (list("abcd"), [0.0, 0.5, 0.0, 0.5])):
        order = second_order(peers, fractions)
        assert sorted(order) == sorted(peers)  # a permutation: everyone sends in both all-reduces
        assert all(order[i] != peers[i] for i, f in enumerate(fractions) if f > 0)  # another reducer each time


def test_shares_that_differ_beyond_the_tolerance_are_found_and_codec_noise_is_not():
    torch.manual_seed(0)
    first = torch.randn(1000)
    second = first + 0.01 * first.norm() / 1000**0.5 * torch.randn(1000)  # ~1% noise: two CPUs' roundings
    assert disagreeing_shares(first, second, [400, 0, 600], 0.05) == []
    turned = second.clone()
    turned[400:] = -turned[400:]  # the reducer of the last share returned it turned around
    assert disagreeing_shares(first, turned, [400, 0, 600], 0.05) == [2]
    nan = first.clone()
    nan[3] = float("nan")
    assert disagreeing_shares(first, nan, [400, 0, 600], 0.05) == [0]
    with pytest.raises(ValueError):
        disagreeing_shares(first, second, [400, 500], 0.05)


def test_a_disagreement_blames_the_other_reducer_where_we_reduced_one_side():
    first, second = ["a", "b", "c", "d"], ["b", "c", "d", "a"]
    # c lied both times: share 2 (c, then d) and share 1 (b, then c) disagree
    assert suspects([1, 2], first, second, own="b") == {"c"}
    assert suspects([1, 2], first, second, own="d") == {"c"}
    assert suspects([1, 2], first, second, own="a") == {"c"}  # the only reducer in both pairs
    # c lied once: only the peer that reduced the same share itself knows who; the others blame nobody
    assert suspects([2], first, second, own="d") == {"c"}
    assert suspects([2], first, second, own="a") == set()
    assert suspects([], first, second, own="a") == set()
    # two reducers (a third peer demoted or a client): both pairs hold the same two peers, so a member that
    # reduced neither cannot tell the liar from the honest one, and names nobody
    assert suspects([0, 2], ["a", "x", "b"], ["b", "x", "a"], own="x") == set()
    assert suspects([0, 2], ["a", "x", "b"], ["b", "x", "a"], own="a") == {"b"}


def test_both_reducers_clamp_by_the_limits_the_group_agrees_on():
    members = ["a", "b", "c"]
    views = [
        {"a": 1e9, "b": 100.0, "c": 90.0},  # a's word on itself does not count
        {"a": 120.0, "c": 80.0},
        {"a": 110.0, "b": 0.0},  # c, hostile or stale, says b published nothing: b's other view is larger
    ]
    assert agreed_limits(members, views) == {"a": 120.0, "b": 100.0, "c": 90.0}
    # unreadable views and values count as none; a sender nobody else has a view of has no limit
    assert agreed_limits(members, ["x", {"a": float("nan"), "b": -1, "c": True}, None]) == {}
    assert agreed_limits(["a", "b"], [{"b": 50}, {"a": 70, "b": 1e9}]) == {"a": 70.0, "b": 50.0}

