"""The inner lr schedule (core/schedule.py): warm-up and cosine decay, counted on the swarm's nominal inner step."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.core.config import InnerConfig, OuterConfig, RunConfig
from p2p_diloco.core.link import LocalLink
from p2p_diloco.core.schedule import lr_factor
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.model import build_model

from .helpers import assert_all_close, make_dataset, snapshot


def test_warm_up_then_cosine_to_the_floor_and_no_schedule_is_constant():
    assert [lr_factor(s, 4, 0, 0.1) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(4, 4, 104, 0.1) == 1.0 and lr_factor(54, 4, 104, 0.1) == pytest.approx(0.55)
    assert lr_factor(104, 4, 104, 0.1) == pytest.approx(0.1) and lr_factor(10_000, 4, 104, 0.1) == pytest.approx(0.1)
    assert lr_factor(0, 0, 0, 0.1) == lr_factor(10**9, 0, 0, 0.1) == 1.0


def _config(make_config, **inner):
    return make_config(
        inner=InnerConfig(inner_steps=2, batch_size=4, lr=3e-3, weight_decay=0.1, grad_clip_norm=0.5, **inner),
        outer=OuterConfig(lr=1.0, momentum=0.0),
        run=RunConfig(max_outer_steps=4, eval_batches=1, seed=3),
    )


def test_one_peer_with_a_schedule_is_adamw_with_the_same_schedule(make_config):
    # H = 2, outer lr 1 without momentum: the peer is plain AdamW, so its lr at nominal step n must be the reference's
    config = _config(make_config, warmup_steps=3, lr_decay_steps=8, lr_floor=0.2)
    learner = Learner(config, make_dataset(config), metrics=NullSink())
    learner.run(LocalLink("none"))

    model = build_model(config.model, config.run.seed)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, 3, 8, 0.2))
    dataset = make_dataset(config)
    for _ in range(8):
        inputs, targets = dataset.train.next_batch()
        loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        schedule.step()
    assert learner.outer_step == 4
    assert_all_close(learner.global_params, snapshot(params))
    # and the schedule mattered: the same peer at a constant lr ends elsewhere
    constant = Learner(_config(make_config), make_dataset(config), metrics=NullSink())
    constant.run(LocalLink("none"))
    with pytest.raises(AssertionError):
        assert_all_close(constant.global_params, snapshot(params))


def test_a_peer_that_caught_up_takes_the_swarms_lr_not_a_fresh_warm_up(make_config):
    config = _config(make_config, warmup_steps=10, lr_decay_steps=100, lr_floor=0.1)
    learner = Learner(config, make_dataset(config), metrics=NullSink())
    assert learner.inner_lr() == pytest.approx(3e-3 / 10)  # step 0 of the run
    learner.outer_step = 30  # as after downloading the state of outer step 30: nominal step 60
    assert learner.inner_lr() == pytest.approx(3e-3 * lr_factor(60, 10, 100, 0.1))
    assert Learner(_config(make_config), make_dataset(config), metrics=NullSink()).inner_lr() == 3e-3


@pytest.mark.parametrize("inner, message", [
    (dict(warmup_steps=-1), "warmup_steps must be >= 0"),
    (dict(warmup_steps=10, lr_decay_steps=10), "lr_decay_steps (10) must be 0 (no decay) or more than"),
    (dict(lr_floor=0.0), "lr_floor must be in (0, 1]"),
])
def test_bad_schedules_are_refused_with_the_reason(inner, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        InnerConfig(**inner)
