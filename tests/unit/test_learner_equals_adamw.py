"""One peer with H=1, outer SGD lr 1 without momentum and no compression trains exactly like plain AdamW."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import InnerConfig, OuterConfig, RunConfig
from p2p_diloco.learner import Learner
from p2p_diloco.link import LocalLink
from p2p_diloco.metrics import NullSink
from p2p_diloco.model import build_model

from .helpers import assert_all_close, make_dataset

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


def _plain_adamw(config) -> list[torch.Tensor]:
    """The reference: the same model, batches and clipping, plain AdamW, no outer loop."""
    model = build_model(config.model, config.run.seed)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=config.inner.lr, weight_decay=config.inner.weight_decay)
    dataset = make_dataset(config)
    for _ in range(STEPS):
        inputs, targets = dataset.train.next_batch()
        loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.inner.grad_clip_norm)
        optimizer.step()
    return [p.detach().clone() for p in params]


def test_one_peer_h1_outer_lr1_no_momentum_is_plain_adamw(make_config):
    config = _config(make_config, OuterConfig(lr=1.0, momentum=0.0))
    initial = [p.detach().clone() for p in build_model(config.model, config.run.seed).parameters()]
    learner = _train_learner(config)
    reference = _plain_adamw(config)

    assert learner.outer_step == STEPS
    assert learner.dataset.train.position == STEPS  # one batch per inner step, none skipped or repeated
    assert_all_close(learner.global_params, reference)
    assert_all_close(list(learner.model.parameters()), reference)
    # training really moved the parameters, so the comparison above is not vacuous
    assert any(not torch.allclose(p, q) for p, q in zip(reference, initial, strict=True))


def test_negative_control_outer_momentum_differs_from_plain_adamw(make_config):
    config = _config(make_config, OuterConfig(lr=0.7, momentum=0.9))
    learner = _train_learner(config)
    reference = _plain_adamw(config)

    assert learner.outer_step == STEPS
    with pytest.raises(AssertionError):
        assert_all_close(learner.global_params, reference)
