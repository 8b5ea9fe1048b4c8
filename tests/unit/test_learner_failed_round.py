"""A failed averaging round keeps global state and local progress; the next round weighs both rounds' tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2p_diloco.core.config import InnerConfig, OuterConfig, RunConfig
from p2p_diloco.core.link import AveragingOutcome, LocalLink, SwarmState
from p2p_diloco.core.outer import state_sha256
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.model import build_model

from .helpers import assert_all_close, flat, make_dataset, plain_adamw, snapshot

H, BATCH = 2, 2
FAILED = AveragingOutcome(None, (), 0.0, "partial", "a groupmate dropped out")


class FlakyLink(LocalLink):
    """A swarm of one (LocalLink's no-ops) whose first ``failures`` averaging rounds fail; later ones return the
    input unchanged, and no download is ever expected."""

    peer_id = "fake"

    def __init__(self, failures: int):
        super().__init__("none")
        self.failures = failures
        self.calls: list[dict] = []

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        self.calls.append(dict(tensors=snapshot(tensors), weight=weight, outer_step=outer_step))
        if len(self.calls) <= self.failures:
            return FAILED
        return AveragingOutcome(snapshot(tensors), (self.peer_id,), weight, "ok")

    def download_state(self, num_params: int) -> SwarmState | None:
        raise AssertionError("no peer is ahead, nothing to download")


def _config(make_config, max_outer_steps: int = 0):
    return make_config(
        inner=InnerConfig(inner_steps=H, batch_size=BATCH, lr=1e-2, grad_clip_norm=1.0),
        outer=OuterConfig(lr=0.7, momentum=0.9),
        run=RunConfig(max_outer_steps=max_outer_steps, eval_batches=1, seed=3),
    )



def test_failed_round_keeps_global_state_and_local_progress(make_config):
    config = _config(make_config)
    learner = Learner(config, make_dataset(config), metrics=NullSink())
    link = FlakyLink(failures=1)
    for _ in range(H):
        learner.inner_step(link)
    assert learner.round_is_over(link)  # H steps of this peer's batch: the budget of a swarm of one
    round_tokens = H * BATCH * config.model.seq_len
    global_before, local_before = snapshot(learner.global_params), snapshot(learner.params)
    sha_before, momentum_before = learner.global_sha256, snapshot(learner.outer.state_tensors())

    learner.end_round(link)  # the group of one answers at once, with a failure

    assert [c["weight"] for c in link.calls] == [float(round_tokens)]
    assert learner.pending is None
    assert learner.outer_step == 0 and learner.outer.steps_taken == 0
    assert learner.global_sha256 == sha_before == state_sha256(learner.global_params, learner.outer.momentum_buffers)
    assert_all_close(learner.global_params, global_before, rtol=0, atol=0)
    assert_all_close(learner.outer.state_tensors(), momentum_before, rtol=0, atol=0)
    assert_all_close(learner.params, local_before, rtol=0, atol=0)  # not reset to the global params
    assert any(not torch.equal(p, g) for p, g in zip(learner.params, learner.global_params, strict=True))
    # the tokens stay unsynced, to weigh the next outer gradient; a new round has begun
    assert learner.tokens_unsynced == learner.tokens_total == round_tokens
    assert learner.rounds.tokens == 0 and learner.rounds.steps == 0


def test_next_successful_round_carries_both_rounds_of_tokens_and_progress(make_config):
    """A retry of the same outer step (nobody moved on: the round failed for everyone) is the same round: its
    weight is the tokens of both attempts, as everyone's is (test_learner_catch_up: a peer that carries its
    progress onto the swarm's next step is weighted by its round at that step alone)."""
    config = _config(make_config, max_outer_steps=1)
    initial = snapshot(build_model(config.model, config.run.seed).parameters())
    learner = Learner(config, make_dataset(config), metrics=NullSink())
    link = FlakyLink(failures=1)

    learner.run(link)

    round_tokens = H * BATCH * config.model.seq_len
    assert [c["weight"] for c in link.calls] == [float(round_tokens), float(2 * round_tokens)]
    assert [c["outer_step"] for c in link.calls] == [0, 0]  # the failed round did not advance the step
    # the outer gradient of each attempt is everything trained since the last sync: H, then 2H AdamW steps
    for call, steps in zip(link.calls, (H, 2 * H), strict=True):
        expected_grad = [i - r for i, r in zip(initial, plain_adamw(config, steps), strict=True)]
        assert_all_close(call["tensors"], flat(expected_grad))
    # then one Nesterov step from the init: the first step moves by lr * (1 + mu) * grad
    grads = link.calls[1]["tensors"][0].split([i.numel() for i in initial])  # the flat template, per param
    expected_global = [i - 0.7 * 1.9 * g.view(i.shape) for i, g in zip(initial, grads, strict=True)]
    assert learner.outer_step == 1
    assert learner.dataset.train.position == 2 * H
    assert_all_close(learner.global_params, expected_global)
    # synced after success: local <- new_global + (local - snapshot), and no step ran since the snapshot
    assert_all_close(learner.params, learner.global_params)
    assert learner.tokens_unsynced == 0 and learner.tokens_total == 2 * round_tokens
