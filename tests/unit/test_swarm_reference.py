"""A group that adversaries dominate (robust.swarm_reference, swarm_problem; docs/design.md §7): centered clipping
centres on a group's majority, so two colluders in a group of three pass every check of the group; the swarm's
published outer-gradient norms, most of them honest, still refuse their average, and never an honest one."""

from __future__ import annotations

import math

import torch

from p2p_diloco.core.bans import TokenLedger
from p2p_diloco.core.link import AveragingOutcome
from p2p_diloco.core.portable import seeded_normal
from p2p_diloco.core.robust import (
    RobustPolicy,
    own_reference,
    result_problem,
    robust_average,
    swarm_problem,
    swarm_reference,
)
from p2p_diloco.core.swarm_view import NORM_MIN_ROUNDS, NORM_WINDOW, OuterNorms, typical_tokens

SHAPE = torch.Size([4096])
POLICY = RobustPolicy()
NO_NORM_CLIP = RobustPolicy(norm_clip_ratio=math.inf)


def _honest(index: int) -> torch.Tensor:
    return seeded_normal(4096, "shared").mul_(0.01) + seeded_normal(4096, f"honest {index}").mul_(0.005)


def _pushed(scale: float, like: torch.Tensor) -> torch.Tensor:
    push = seeded_normal(4096, "attack")
    return push.mul_(scale * float(like.norm()) / float(push.norm()))


def test_two_colluders_in_a_group_of_three_pass_the_groups_checks_and_are_refused_by_the_swarms_norms():
    own = _honest(0)
    push = _pushed(90, own)
    parts = [own, push, push.clone()]  # we reduce this part; the colluders are the group's majority
    result, _, left_out = robust_average(parts, [1000.0] * 3, [None] * 3, SHAPE, POLICY, own=0)
    assert not left_out
    assert float(result.norm()) > 30 * float(own.norm())  # the centre is theirs: the average is mostly their push
    declared = [float(p.norm()) for p in parts]
    assert result_problem(result, own, POLICY, 1.0, declared) is None  # the group's own check lets it through

    # the swarm of five: our own norm, two honest peers outside the group, the two colluders (publishing anything)
    for theirs in ([float(push.norm())] * 2, [0.0, 0.0], [1e30, 1e30]):
        reference = swarm_reference(float(own.norm()), [float(_honest(1).norm()), float(_honest(2).norm()), *theirs], 4)
        assert reference is not None and reference < 1.1 * float(_honest(1).norm())
        assert "swarm's reference norm" in swarm_problem(float(result.norm()), reference, POLICY)

    # an honest group of three is far inside the limit, and so is a peer that trained 4x the tokens of the others
    calm, _, _ = robust_average([own, _honest(1), _honest(2)], [1000.0] * 3, [None] * 3, SHAPE, POLICY, own=0)
    reference = swarm_reference(float(own.norm()), [float(_honest(i).norm()) for i in (1, 2, 3, 4)], 4)
    assert swarm_problem(float(calm.norm()), reference, POLICY) is None
    bigger, _, _ = robust_average([own, _honest(1) * 4, _honest(2)], [1000.0, 4000.0, 1000.0], [None] * 3, SHAPE,
                                  POLICY, own=0)
    assert swarm_problem(float(bigger.norm()), reference, POLICY) is None


def test_the_reference_needs_half_the_swarm_is_at_least_our_own_norm_and_ignores_hostile_values():
    assert swarm_reference(1.0, [], 0) is None  # nobody else: nothing to compare with
    assert swarm_reference(1.0, [2.0], 4) is None  # one of four others published: too few to speak for the swarm
    assert swarm_reference(1.0, [2.0, 3.0], 4) == 2.0  # upper median of [1, 2, 3]
    assert swarm_reference(5.0, [1.0, 1.0, 1.0], 3) == 5.0  # never below ours: a peer larger than the rest
    hostile = [math.nan, math.inf, -1.0, True, "2", None, [1.0]]
    assert swarm_reference(1.0, hostile, 7) is None  # none of these is a norm
    assert swarm_reference(1.0, [*hostile, 2.0, 2.0, 2.0, 2.0], 11) is None  # four of eleven: too few
    assert swarm_reference(1.0, [*hostile[:6], *[2.0] * 6], 12) == 2.0  # half of twelve
    assert swarm_reference(math.nan, [2.0, 3.0], 2) == 2.0  # a non-finite own norm counts as 0
    assert swarm_problem(59.0, 10.0, POLICY) is None
    assert swarm_problem(61.0, 10.0, POLICY) is not None
    assert swarm_problem(1e9, None, POLICY) is None  # no reference: no check


def test_a_dominated_groups_average_is_refused_and_an_accepted_one_keeps_its_ratio():
    norms = OuterNorms(fragments=2)
    honest = {f"h{i}": {"outer_norms": [1.0, 2.0]} for i in range(2)}
    colluders = {f"c{i}": {"outer_norms": [500.0, 500.0]} for i in range(2)}
    live = {**honest, **colluders}
    outcome = AveragingOutcome([torch.full((4,), 30.0)], ("us", "c0", "c1"), 3.0, "ok")  # norm 60 against fragment 1's 2
    refused = norms.checked(outcome, live, 1, 2.0, POLICY)
    assert refused.averaged is None and refused.status == "error" and refused.norm_ratio == 30.0
    assert "swarm's reference norm" in refused.reason
    accepted = norms.checked(outcome, live, 1, 20.0, POLICY)  # we are the large one
    assert accepted.averaged is not None and accepted.norm_ratio == 3.0
    # records of another fragment count (a peer with other --fragments) are not a reference
    other = {peer: {"outer_norms": [1.0]} for peer in live}
    assert norms.checked(outcome, other, 1, 2.0, POLICY).norm_ratio is None


def test_a_peer_publishes_its_recent_largest_norm_and_counts_it_in_its_own_reference():
    """A round begun just after a catch-up holds a step or two: its outer gradient is tiny. Published alone, such
    norms made the reference tiny and honest averages of a heavier groupmate were refused (7-9x); each peer publishes
    the largest of its last NORM_WINDOW norms per fragment instead."""
    norms = OuterNorms(fragments=2)
    norms.sent(0, 3.0)
    norms.sent(0, 0.1)  # a round of one step after a catch-up
    norms.sent(1, 2.0)
    assert norms.published() == [None, None]  # a run's first rounds: nothing said yet
    for _ in range(NORM_MIN_ROUNDS - 1):
        norms.sent(1, 2.0)
    norms.sent(0, 0.1)
    assert norms.published() == [3.0, 2.0]
    norms.sent(0, math.nan)  # never published
    assert norms.published() == [3.0, 2.0]
    for _ in range(NORM_WINDOW):
        norms.sent(0, 0.5)
    assert norms.published() == [0.5, 2.0]  # the window moved on
    # our own tiny norm of this round does not make the reference tiny: our recent largest counts
    live = {"a": {"outer_norms": [0.2, 0.2]}, "b": {"outer_norms": [0.2, 0.2]}}
    assert norms.reference(live, 1, 0.01) == 2.0


def test_before_the_swarm_published_norms_our_own_norm_scaled_to_the_swarms_tokens_is_the_reference():
    """A run's first rounds (docs/design.md §7): no peer published a norm yet, and two colluders were half of a group
    of four, so the group's centre and every check of the group were theirs (a rerun of the attack table diverged
    that way). Our own outer gradient, scaled to the tokens the live peers published for the round, refuses it."""
    own = _honest(0)
    push = _pushed(90, own)
    parts = [own, _honest(1), push, push.clone()]
    # the norm clip (on by default) now cuts both pushes to the lower median norm, an honest one: checked here with
    # it off, as for colluders that get past it (three of four would: the lower median would be theirs)
    clipped, _, _ = robust_average(parts, [1000.0] * 4, [None] * 4, SHAPE, POLICY, own=0)
    assert float(clipped.norm()) < 2 * float(own.norm())
    result, _, left_out = robust_average(parts, [1000.0] * 4, [None] * 4, SHAPE, NO_NORM_CLIP, own=0)
    assert not left_out and float(result.norm()) > 30 * float(own.norm())  # half pushed: the centre moves with them
    assert result_problem(result, own, POLICY, 1.0, [float(p.norm()) for p in parts]) is None
    live = {peer: {} for peer in ("h1", "h2", "c0", "c1")}  # nothing published: no swarm reference
    norms = OuterNorms()
    assert norms.reference(live, 0, float(own.norm())) is None  # without our tokens: no check, as before
    for theirs in (1000.0, 1e12):  # the colluders publish their tokens honestly, or a billion times more
        tokens = {"h1": 1000.0, "h2": 1000.0, "c0": theirs, "c1": theirs}
        outcome = AveragingOutcome([result], ("us", "h1", "c0", "c1"), 4000.0, "ok")
        refused = norms.checked(outcome, live, 0, float(own.norm()), POLICY, 1000.0, tokens)
        assert refused.averaged is None and refused.status == "error" and refused.norm_ratio > 30
        assert "our own norm scaled to a round's typical tokens" in refused.reason
    # an honest group in which a peer trained 4x our tokens passes
    tokens = {"h1": 4000.0, "h2": 1000.0, "c0": 1000.0, "c1": 1000.0}
    calm, _, _ = robust_average([own, _honest(1) * 4, _honest(2), _honest(3)], [1000.0, 4000.0, 1000.0, 1000.0],
                                [None] * 4, SHAPE, POLICY, own=0)
    accepted = norms.checked(AveragingOutcome([calm], ("us", "h1", "h2", "h3"), 7000.0, "ok"), live, 0,
                             float(own.norm()), POLICY, 1000.0, tokens)
    assert accepted.averaged is not None and accepted.norm_ratio < 2


def test_our_own_reference_follows_the_swarms_typical_tokens():
    assert own_reference(2.0, 100.0, [100.0, 100.0]) == 2.0
    # a round of one step after a catch-up: a tiny norm, scaled to the tokens the others trained (500 steps of theirs)
    assert own_reference(0.1, 512.0, [256000.0, 256000.0]) == 0.1 * 500
    assert own_reference(5.0, 7000.0, [1000.0, 1000.0]) == 5.0  # never below our own norm
    # a minority publishing huge (or hostile) token counts does not move the upper median
    assert own_reference(1.0, 1000.0, [1000.0, 1000.0, 1e12, math.inf, math.nan, -5.0, True, "9"]) == 1.0
    assert own_reference(1.0, 1000.0, [1000.0, 1e12, 1e12]) == 1e9  # a majority can (the stated condition)
    # records lag a period: our config's share of the round's budget counts when the published tokens are behind
    assert own_reference(0.1, 512.0, [512.0, 0.0, 0.0], typical_tokens=5120.0) == 0.1 * 10
    assert own_reference(1.0, 1000.0, [1000.0], typical_tokens=math.inf) == 1.0
    for norm, tokens in ((0.0, 1000.0), (1.0, 0.0), (math.nan, 1000.0), (1.0, math.inf)):
        assert own_reference(norm, tokens, [1000.0]) is None  # nothing of ours to measure from


def test_the_token_ledger_keeps_a_hostile_count_finite():
    """A record may say 1e308 tokens (msgpack carries it, and it is a finite float): summed over rounds and turned
    into a float it raised OverflowError in every averaging while the record was in the window."""
    ledger = TokenLedger()
    ledger.observe("hostile", 3, int(1e308))
    ledger.observe("hostile", 4, int(1e308))
    ledger.observe("honest", 4, 1000)
    allowed = ledger.allowed(4, rounds=2)
    assert allowed["honest"] == 1000.0 and math.isfinite(allowed["hostile"])


def test_a_rounds_typical_tokens_come_from_our_own_published_budget():
    assert typical_tokens({"round_budget": 15360}, 1, 2) == 5120.0  # three peers share the round
    assert typical_tokens({"round_budget": 2560}, 2, 3) == 1280.0  # a fragment's budget, over both fragments
    for record in ({}, {"round_budget": None}, {"round_budget": math.nan}, {"round_budget": True}, {"round_budget": -1}):
        assert typical_tokens(record, 1, 2) == 0.0
