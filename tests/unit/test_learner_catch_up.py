"""Learner._catch_up: when the swarm is ahead, take its state and rebase local progress onto the new global params."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2p_diloco.config import InnerConfig
from p2p_diloco.learner import Learner
from p2p_diloco.link import AveragingOutcome, SwarmState
from p2p_diloco.metrics import NullSink
from p2p_diloco.outer import params_sha256

from .helpers import assert_all_close, make_dataset, snapshot

H = 4


class AheadLink:
    """A fake swarm that is at ``swarm_step`` and serves ``state`` (None = the download fails)."""

    peer_id = "fake"

    def __init__(self, swarm_step: int, state: SwarmState | None):
        self.swarm_step, self.state = swarm_step, state
        self.downloads = 0
        self.published: list[dict] = []

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        raise AssertionError("catch-up must not average")

    def swarm_outer_step(self) -> int:
        return self.swarm_step

    def canonical_sha(self, outer_step: int, own_sha: str | None = None) -> str | None:
        return own_sha  # no other bytes in the swarm: never a fork

    def download_state(self, num_params: int) -> SwarmState | None:
        self.downloads += 1
        return self.state

    def publish(self, **fields: object) -> None:
        self.published.append(fields)

    def traffic(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        pass


def _learner_with_local_progress(make_config) -> Learner:
    config = make_config(inner=InnerConfig(inner_steps=H, batch_size=2, lr=1e-2))
    learner = Learner(config, make_dataset(config), metrics=NullSink())
    learner.round_budget = 2
    learner._train_round(AheadLink(-1, None))  # two inner steps: local params now differ from global
    assert learner.steps_into_round == 2
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
        global_sha256=params_sha256(new_global),
        donor="donor-peer",
    )


def test_catch_up_takes_the_swarm_state_and_rebases_local_progress(make_config):
    learner = _learner_with_local_progress(make_config)
    old_global, old_local = snapshot(learner.global_params), snapshot(learner.params)
    state = _swarm_state(learner, outer_step=7, steps_into_round=3)
    expected_global, expected_momentum = snapshot(state.global_params), snapshot(state.momentum)
    link = AheadLink(7, state)

    assert learner._catch_up(link) is True

    assert link.downloads == 1
    assert_all_close(learner.global_params, expected_global, rtol=0, atol=0)  # exactly the downloaded bytes
    assert learner.global_sha256 == state.global_sha256 == params_sha256(learner.global_params)
    assert learner.outer_step == 7
    assert learner.outer.steps_taken == 7
    assert_all_close(learner.outer.state_tensors(), expected_momentum, rtol=0, atol=0)
    # local_params <- new_global + (old_local - old_global): the unsent progress survives the rebase
    expected_local = [n + (lo - og) for n, lo, og in zip(expected_global, old_local, old_global, strict=True)]
    assert_all_close(learner.params, expected_local)
    assert_all_close(list(learner.model.parameters()), expected_local)
    # it finishes the swarm's current round rather than starting a new one
    assert learner.steps_into_round == 3
    assert learner.round_budget == H - 3
    assert learner.catch_ups == 1
    assert link.published[-1] == dict(outer_step=7, global_sha256=state.global_sha256)


def test_global_params_do_not_alias_the_downloaded_tensors(make_config):
    learner = _learner_with_local_progress(make_config)
    state = _swarm_state(learner, outer_step=2, steps_into_round=0)
    learner._catch_up(AheadLink(2, state))
    before = snapshot(learner.global_params)
    for tensor in state.global_params:
        tensor.add_(1.0)
    assert_all_close(learner.global_params, before, rtol=0, atol=0)
    assert learner.round_budget == H


def test_no_download_when_the_swarm_is_not_ahead(make_config):
    learner = _learner_with_local_progress(make_config)
    old_global, old_local = snapshot(learner.global_params), snapshot(learner.params)
    link = AheadLink(0, _swarm_state(learner, outer_step=5, steps_into_round=0))
    assert learner._catch_up(link) is False
    assert link.downloads == 0
    assert learner.outer_step == 0
    assert_all_close(learner.global_params, old_global, rtol=0, atol=0)
    assert_all_close(learner.params, old_local, rtol=0, atol=0)


def test_failed_or_stale_download_changes_nothing(make_config):
    learner = _learner_with_local_progress(make_config)
    old_global, old_local, old_sha = snapshot(learner.global_params), snapshot(learner.params), learner.global_sha256
    stale = _swarm_state(learner, outer_step=0, steps_into_round=0)  # the donor is no further than we are
    for link in (AheadLink(3, None), AheadLink(3, stale)):
        assert learner._catch_up(link) is False
        assert link.downloads == 1
    assert learner.outer_step == 0 and learner.catch_ups == 0 and learner.global_sha256 == old_sha
    assert_all_close(learner.global_params, old_global, rtol=0, atol=0)
    assert_all_close(learner.params, old_local, rtol=0, atol=0)
