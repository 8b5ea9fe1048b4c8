"""Catching up (train/catch_up.py): when the swarm is ahead, take its state and rebase local progress onto the new global params."""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from p2p_diloco.core.config import InnerConfig
from p2p_diloco.core.history import Node, Target
from p2p_diloco.core.link import AveragingOutcome, ImmediateAveraging, SwarmState
from p2p_diloco.core.outer import OuterOptimizer, state_sha256
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.learner import Learner, PendingAveraging

from .helpers import assert_all_close, flat, make_dataset, snapshot

H, BATCH = 4, 2
LOCAL_STEPS = 2  # inner steps of local progress before the swarm's state arrives


class AheadLink(ImmediateAveraging):
    """A fake swarm that is at ``swarm_step`` and serves ``state`` (None = the download fails).

    A group of one if asked to average: it records the call and returns the tensors it got."""

    peer_id = "fake"

    def __init__(self, swarm_step: int, state: SwarmState | None):
        self.swarm_step, self.state = swarm_step, state
        self.downloads = 0
        self.published: list[dict] = []
        self.averaged: list[dict] = []

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        self.averaged.append(dict(tensors=snapshot(tensors), weight=weight, outer_step=outer_step))
        return AveragingOutcome(snapshot(tensors), (self.peer_id,), weight, "ok")

    def swarm_target(self, chain: Sequence[Node], fresh: bool) -> Target | None:
        if self.swarm_step <= chain[-1][0]:
            return None  # no other bytes in the swarm, and nobody ahead
        return Target(self.swarm_step, self.state.global_sha256 if self.state else "0" * 64, "majority")

    def download_state(self, shapes: Sequence[Sequence[int]], target: Target) -> SwarmState | None:
        self.downloads += 1
        return self.state

    def publish(self, **fields: object) -> None:
        self.published.append(fields)

    def traffic(self) -> tuple[int, int]:
        return 0, 0

    def states_served(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        pass


def _learner_with_local_progress(make_config) -> Learner:
    config = make_config(inner=InnerConfig(inner_steps=H, batch_size=BATCH, lr=1e-2))
    learner = Learner(config, make_dataset(config), metrics=NullSink())
    link = AheadLink(-1, None)
    for _ in range(LOCAL_STEPS):  # local params now differ from global
        learner.inner_step(link)
    assert learner.rounds.steps == LOCAL_STEPS
    assert learner.rounds.tokens == learner.tokens_unsynced == LOCAL_STEPS * BATCH * config.model.seq_len
    assert not learner.round_is_over(link)
    assert link.downloads == 0 and not link.averaged
    assert any(not torch.equal(p, g) for p, g in zip(learner.params, learner.global_params, strict=True))
    return learner


def _swarm_state(learner: Learner, outer_step: int, steps_into_round: int) -> SwarmState:
    generator = torch.Generator().manual_seed(42)
    new_global = [g + 0.1 * torch.randn(g.shape, generator=generator) for g in learner.global_params]
    momentum = [torch.randn(g.shape, generator=generator) for g in learner.global_params]
    return SwarmState(
        outer_step=outer_step,
        global_params=new_global,
        momentum=momentum,
        outer_steps_taken=outer_step,
        steps_into_round=steps_into_round,
        global_sha256=state_sha256(new_global, momentum),
        donor="donor-peer",
    )


def test_catch_up_takes_the_swarm_state_and_rebases_local_progress(make_config):
    learner = _learner_with_local_progress(make_config)
    old_global, old_local = snapshot(learner.global_params), snapshot(learner.params)
    round_tokens, unsynced = learner.rounds.tokens, learner.tokens_unsynced
    state = _swarm_state(learner, outer_step=7, steps_into_round=3)
    expected_global, expected_momentum = snapshot(state.global_params), snapshot(state.momentum)
    link = AheadLink(7, state)

    assert learner.catch_up(link) is True

    assert link.downloads == 1 and not link.averaged
    assert_all_close(learner.global_params, expected_global, rtol=0, atol=0)  # exactly the downloaded bytes
    assert learner.global_sha256 == state.global_sha256 == state_sha256(learner.global_params, learner.outer.momentum_buffers)
    assert learner.outer_step == 7
    assert learner.outer.steps_taken == 7
    assert_all_close(learner.outer.state_tensors(), expected_momentum, rtol=0, atol=0)
    # local_params <- new_global + (old_local - old_global): the unsent progress survives the rebase
    expected_local = [n + (lo - og) for n, lo, og in zip(expected_global, old_local, old_global, strict=True)]
    assert_all_close(learner.params, expected_local)
    assert_all_close(list(learner.model.parameters()), expected_local)
    # rounds are swarm-wide token budgets: catching up neither shortens nor restarts this peer's round,
    # and the rebased progress still counts as unsynced
    assert learner.rounds.steps == LOCAL_STEPS
    assert learner.rounds.tokens == round_tokens and learner.tokens_unsynced == unsynced
    assert learner.catch_ups == 1 and learner.forks_healed == 0
    assert learner.pending is None and learner.round_index == 7
    steps_published = [fields for fields in link.published if "outer_step" in fields]
    # a download is no step this peer computed: nothing in ``made`` (history.made_sha256)
    assert steps_published[-1] == dict(outer_step=7, global_sha256=state.global_sha256, round=7, recent=[], made=[])
    assert link.published[-1]["stats"][0] == 7  # then the summary of its metrics record, for watchers (watch.py)


def test_global_params_do_not_alias_the_downloaded_tensors(make_config):
    learner = _learner_with_local_progress(make_config)
    state = _swarm_state(learner, outer_step=2, steps_into_round=0)
    assert learner.catch_up(AheadLink(2, state)) is True
    before, momentum_before = snapshot(learner.global_params), snapshot(learner.outer.state_tensors())
    for tensor in [*state.global_params, *state.momentum]:
        tensor.add_(1.0)
    assert_all_close(learner.global_params, before, rtol=0, atol=0)
    assert_all_close(learner.outer.state_tensors(), momentum_before, rtol=0, atol=0)


def test_no_download_when_the_swarm_is_not_ahead(make_config):
    learner = _learner_with_local_progress(make_config)
    old_global, old_local = snapshot(learner.global_params), snapshot(learner.params)
    link = AheadLink(0, _swarm_state(learner, outer_step=5, steps_into_round=0))
    assert learner.catch_up(link) is False
    assert link.downloads == 0
    assert learner.outer_step == 0
    assert_all_close(learner.global_params, old_global, rtol=0, atol=0)
    assert_all_close(learner.params, old_local, rtol=0, atol=0)


def test_failed_or_stale_download_changes_nothing(make_config):
    learner = _learner_with_local_progress(make_config)
    old_global, old_local, old_sha = snapshot(learner.global_params), snapshot(learner.params), learner.global_sha256
    ours = SwarmState(0, snapshot(learner.global_params), snapshot(learner.outer.momentum_buffers), 0, 0, old_sha,
                      donor="donor-peer")  # the donor is no further than we are
    for link in (AheadLink(3, None), AheadLink(3, ours)):
        assert learner.catch_up(link) is False
        assert link.downloads == 1
    assert learner.outer_step == 0 and learner.catch_ups == 0 and learner.global_sha256 == old_sha
    assert_all_close(learner.global_params, old_global, rtol=0, atol=0)
    assert_all_close(learner.params, old_local, rtol=0, atol=0)


def test_no_catch_up_while_an_averaging_is_in_flight(make_config):
    """Its result is still to be applied to the global params it was computed against."""
    learner = _learner_with_local_progress(make_config)
    old_global, old_local = snapshot(learner.global_params), snapshot(learner.params)
    learner.pending = PendingAveraging(Future(), outer_step=0, weight=1.0, snapshot=snapshot(learner.params))
    link = AheadLink(5, _swarm_state(learner, outer_step=5, steps_into_round=0))
    assert learner.catch_up(link) is False
    assert link.downloads == 0 and learner.outer_step == 0
    assert_all_close(learner.global_params, old_global, rtol=0, atol=0)
    assert_all_close(learner.params, old_local, rtol=0, atol=0)


def test_round_end_catches_up_before_taking_the_outer_gradient(make_config):
    """The outer gradient sent after a catch-up is the same local progress, measured from the swarm's params."""
    learner = _learner_with_local_progress(make_config)
    old_global, old_local, unsynced = snapshot(learner.global_params), snapshot(learner.params), learner.tokens_unsynced
    state = _swarm_state(learner, outer_step=4, steps_into_round=0)
    link = AheadLink(4, state)

    learner.end_round(link)

    assert link.downloads == 1 and learner.catch_ups == 1
    assert len(link.averaged) == 1
    call = link.averaged[0]
    assert call["outer_step"] == 4 and call["weight"] == float(unsynced)
    assert_all_close(call["tensors"], flat([g - lo for g, lo in zip(old_global, old_local, strict=True)]))
    assert learner.outer_step == 5 and learner.pending is None  # the group of one answered at once
    assert learner.tokens_unsynced == 0 and learner.rounds.tokens == 0 and learner.rounds.steps == 0


def _failed_on_our_side(learner: Learner) -> PendingAveraging:
    """An averaging of outer step 0 whose all-reduce failed here after our outer gradient went out."""
    segments = learner.fragments[0]
    snapshot_now = [s.of(learner.params).detach().clone() for s in segments]
    future: Future = Future()
    future.set_result(AveragingOutcome(None, (), 0.0, "partial", "partial all-reduce: 10 of 100 values lost"))
    learner.pending = PendingAveraging(future, 0, float(learner.tokens_unsynced), snapshot_now, 0, segments)
    return learner.pending


def _apply_failed_round_then_catch_up(make_config, history_peers):
    learner = _learner_with_local_progress(make_config)
    link = AheadLink(-1, None)
    pending = _failed_on_our_side(learner)
    learner.complete_averaging(link)  # failed here: the progress stays local, for now
    assert learner.unconfirmed is pending and learner.outer_step == 0
    for _ in range(LOCAL_STEPS):  # more local progress after the snapshot
        learner.inner_step(link)
    old_global, old_local = snapshot(learner.global_params), snapshot(learner.params)
    state = _swarm_state(learner, outer_step=1, steps_into_round=0)
    state = SwarmState(**{**state.__dict__, "round_history": {0: tuple(history_peers)}})
    assert learner.catch_up(AheadLink(1, state)) is True
    return learner, pending, state, old_global, old_local


def test_a_round_failed_only_on_our_side_is_not_counted_twice(make_config):
    learner, pending, state, _old_global, old_local = _apply_failed_round_then_catch_up(make_config, ["fake", "other"])
    # the donor's history says our outer gradient made step 0 -> 1: only the progress after the snapshot is carried
    expected = [n + (lo - s.view(lo.shape)) for n, lo, s in zip(state.global_params, old_local, pending.snapshot, strict=True)]
    assert_all_close(learner.params, expected)
    assert learner.tokens_unsynced == LOCAL_STEPS * BATCH * learner.config.model.seq_len
    assert learner.unconfirmed is None and learner.round_history[0] == ("fake", "other")


def test_a_round_that_failed_without_us_carries_all_progress(make_config):
    learner, _pending, state, old_global, old_local = _apply_failed_round_then_catch_up(make_config, ["other", "third"])
    expected = [n + (lo - og) for n, lo, og in zip(state.global_params, old_local, old_global, strict=True)]
    assert_all_close(learner.params, expected)
    assert learner.tokens_unsynced == 2 * LOCAL_STEPS * BATCH * learner.config.model.seq_len
    assert learner.unconfirmed is None


class FailingLink(AheadLink):
    """AheadLink whose averagings all fail (nobody came)."""

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        self.averaged.append(dict(tensors=snapshot(tensors), weight=weight, outer_step=outer_step))
        return AveragingOutcome(None, (), 0.0, "no_group", "nobody came")


def test_progress_carried_past_a_failed_round_onto_the_swarms_next_step_weighs_only_that_steps_round(make_config):
    """A peer whose averaging failed while the others' succeeded carries its progress into the swarm's next step;
    its outer gradient then holds both rounds, but its weight is the tokens of its round at that step, as the
    others' is: weighted by both, its progress would count twice in that average."""
    learner = _learner_with_local_progress(make_config)
    tokens_per_step = BATCH * learner.config.model.seq_len
    learner.end_round(FailingLink(-1, None))  # outer step 0 fails here; the others' succeeded
    assert learner.outer_step == 0 and learner.tokens_unsynced == LOCAL_STEPS * tokens_per_step
    link = AheadLink(-1, None)
    for _ in range(LOCAL_STEPS):
        learner.inner_step(link)
    state = _swarm_state(learner, outer_step=1, steps_into_round=0)
    assert learner.catch_up(AheadLink(1, state)) is True  # the round failed without us in it: all progress carried
    for _ in range(LOCAL_STEPS):
        learner.inner_step(link)
    ahead = AheadLink(1, state)
    learner.end_round(ahead)
    (call,) = ahead.averaged
    assert call["outer_step"] == 1
    assert call["weight"] == float(2 * LOCAL_STEPS * tokens_per_step)  # its round at step 1, across the catch-up
    assert learner.outer_step == 2 and learner.tokens_unsynced == 0  # the success synced all three rounds' worth
    assert learner.tokens_total == 3 * LOCAL_STEPS * tokens_per_step


class NextStepLink(AheadLink):
    """A swarm one step past us whose step no majority backs ("next"): its donor serves ``state`` and the average
    that made it; ``reference`` is the swarm's reference norm the link reports."""

    def __init__(self, state: SwarmState, reference: float | None):
        super().__init__(state.outer_step, state)
        self.reference, self.refused, self.asked = reference, [], []

    def swarm_target(self, chain: Sequence[Node], fresh: bool) -> Target | None:
        return Target(self.state.outer_step, self.state.global_sha256, "next") if chain[-1][0] < self.swarm_step else None

    def norm_reference(self, outer_step: int, own_norm: float, own_tokens: float = 0.0) -> float | None:
        self.asked.append((outer_step, own_norm, own_tokens))
        return self.reference

    def refuse_donor(self, donor: str, reason: str) -> None:
        self.refused.append((donor, reason))


def test_a_next_step_that_a_dominated_group_computed_is_refused_against_the_swarms_reference(make_config):
    """docs/design.md §7: a member refused its group's average (colluders were the group's majority); the colluders
    then serve the step they computed as the step after ours. It recomputes and passes a reducer result's loose
    checks, but not the swarm's reference norm, which the learner asks its link for."""
    learner = _learner_with_local_progress(make_config)
    learner.end_round(FailingLink(-1, None))  # outer step 0 failed on our side: our outer gradient is unconfirmed
    pending = learner.unconfirmed
    assert pending is not None
    sent = [segment.of(learner.global_params) - snap for segment, snap in zip(pending.segments, pending.snapshot)]
    sent_norm = math.sqrt(sum(float(piece.norm()) ** 2 for piece in sent))
    pushed = [piece * 40 for piece in sent]  # the colluders' pushed average: 40x our outer gradient
    params, momentum = snapshot(learner.global_params), snapshot(learner.outer.momentum_buffers)
    optimizer = OuterOptimizer(params, learner.config.outer)
    optimizer.load_state(momentum, learner.outer.steps_taken)
    optimizer.step(pushed, pending.segments)
    state = SwarmState(1, params, optimizer.momentum_buffers, 1, 0, state_sha256(params, optimizer.momentum_buffers),
                       donor="colluder", parent_sha256=learner.global_sha256,
                       last_average=[torch.cat(pushed)], how="next")
    ours = learner.global_sha256

    refusing = NextStepLink(state, reference=sent_norm)  # the swarm's outer gradients are the size of ours
    assert learner.catch_up(refusing) is False
    assert learner.global_sha256 == ours and learner.outer_step == 0
    assert [donor for donor, _ in refusing.refused] == ["colluder"]
    assert "swarm's check of a group average" in refusing.refused[0][1]
    # asked for our step, with our outer gradient and the tokens behind it (before the swarm published norms, the
    # reference is that norm scaled to the swarm's tokens: robust.own_reference)
    assert refusing.asked == [(0, sent_norm, pending.weight)] and pending.weight > 0

    trusting = NextStepLink(state, reference=None)  # no reference known: a reducer result's checks only (40x < 100x)
    assert learner.catch_up(trusting) is True
    assert learner.global_sha256 == state.global_sha256 and learner.outer_step == 1 and not trusting.refused


class TieLink(AheadLink):
    """A swarm in which ``state`` is a fork at our own step that as many peers vouch for as for ours, and whose
    smaller sha256 wins the tie (history.py: "tie")."""

    def swarm_target(self, chain: Sequence[Node], fresh: bool) -> Target | None:
        return Target(self.state.outer_step, self.state.global_sha256, "tie") if chain[-1][1] != self.state.global_sha256 else None

    def download_state(self, shapes: Sequence[Sequence[int]], target: Target) -> SwarmState | None:
        self.downloads += 1
        return SwarmState(**{**self.state.__dict__, "how": target.how})


def test_a_fork_won_on_a_tie_is_taken_only_within_one_honest_round_and_a_refused_one_is_not_fetched_again(make_config):
    """docs/design.md §7: two colluders made outer step 1 on their own, two honest peers made theirs; as many vouch for
    each, and the colluders ground their sha256 to be the smaller. Their step lies far from ours (a pushed average):
    kept ours, said once, not downloaded again. Another honest group's step from the same parent is taken."""
    learner = _learner_with_local_progress(make_config)
    parent_params, parent_momentum = snapshot(learner.global_params), snapshot(learner.outer.momentum_buffers)
    learner.end_round(AheadLink(-1, None))  # a group of one: outer step 0 -> 1 with our own average
    assert learner.outer_step == 1 and learner.last_average is not None
    ours = learner.global_sha256

    def fork(scale: float, seed: int) -> SwarmState:
        generator = torch.Generator().manual_seed(seed)
        average = [a * scale + 0.1 * a.abs().mean() * torch.randn(a.shape, generator=generator) for a in learner.last_average]
        params, momentum = [p.clone() for p in parent_params], [m.clone() for m in parent_momentum]
        optimizer = OuterOptimizer(params, learner.config.outer)
        optimizer.load_state(momentum, 0)
        optimizer.step(learner.fragments.unpack(average, learner.fragments[0]), learner.fragments[0])
        return SwarmState(1, params, optimizer.momentum_buffers, 1, 0, state_sha256(params, optimizer.momentum_buffers),
                          donor="other-side")

    pushed = TieLink(1, fork(40.0, 1))
    assert learner.catch_up(pushed) is False and learner.catch_up(pushed) is False
    assert pushed.downloads == 1  # refused once, then left alone
    assert learner.global_sha256 == ours and pushed.state.global_sha256 in learner.refused_ties

    honest = TieLink(1, fork(1.0, 2))
    assert learner.catch_up(honest) is True
    assert learner.global_sha256 == honest.state.global_sha256 and learner.forks_healed == 1
