"""One peer with H=1, outer SGD lr 1 without momentum and no compression trains exactly like plain AdamW."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.core.config import InnerConfig, OuterConfig, RunConfig
from p2p_diloco.core.link import LocalLink
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.model import build_model

from .helpers import assert_all_close, make_dataset, plain_adamw

STEPS = 5


def _config(make_config, outer: OuterConfig):
    return make_config(
        inner=InnerConfig(inner_steps=1, batch_size=4, lr=3e-3, weight_decay=0.1, grad_clip_norm=0.5),
        outer=outer,
        run=RunConfig(max_outer_steps=STEPS, eval_batches=1, seed=3),
    )


def _train_learner(config) -> Learner:
    learner = Learner(config, make_dataset(config), metrics=NullSink())
    learner.run(LocalLink("none"))
    return learner



def test_one_peer_h1_outer_lr1_no_momentum_is_plain_adamw(make_config):
    config = _config(make_config, OuterConfig(lr=1.0, momentum=0.0))
    initial = [p.detach().clone() for p in build_model(config.model, config.run.seed).parameters()]
    learner = _train_learner(config)
    reference = plain_adamw(config, STEPS)

    assert learner.outer_step == STEPS
    assert learner.dataset.train.position == STEPS  # one batch per inner step, none skipped or repeated
    assert_all_close(learner.global_params, reference)
    assert_all_close(list(learner.model.parameters()), reference)
    # training really moved the parameters, so the comparison above is not vacuous
    assert any(not torch.allclose(p, q) for p, q in zip(reference, initial, strict=True))


def test_negative_control_outer_momentum_differs_from_plain_adamw(make_config):
    config = _config(make_config, OuterConfig(lr=0.7, momentum=0.9))
    learner = _train_learner(config)
    reference = plain_adamw(config, STEPS)

    assert learner.outer_step == STEPS
    with pytest.raises(AssertionError):
        assert_all_close(learner.global_params, reference)
