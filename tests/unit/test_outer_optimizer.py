"""OuterOptimizer matches torch.optim.SGD(nesterov=True, dampening=0) step by step, with and without momentum."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.core.config import OuterConfig
from p2p_diloco.core.outer import OuterOptimizer, params_sha256

from .helpers import assert_all_close

SHAPES = [(7, 5), (13,), (2, 3, 4)]


def _random_tensors(generator: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


@pytest.mark.parametrize(("lr", "momentum", "warmup"), [(0.7, 0.9, 0), (0.7, 0.0, 0), (1.0, 0.0, 0), (0.3, 0.5, 0), (0.8, 0.6, 4)])
def test_outer_step_equals_torch_nesterov_sgd(lr: float, momentum: float, warmup: int):
    """Step for step, with the outer lr's warm-up as torch's SGD with that lr schedule: lr (k + 1) / W, then lr."""
    generator = torch.Generator().manual_seed(0)
    start = _random_tensors(generator)
    ours = [t.clone() for t in start]
    outer = OuterOptimizer(ours, OuterConfig(lr=lr, momentum=momentum, warmup_steps=warmup))
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    sgd = torch.optim.SGD(reference, lr=lr, momentum=momentum, dampening=0, nesterov=momentum > 0)

    lrs = []
    for k in range(6):
        lrs.append(outer.current_lr)
        sgd.param_groups[0]["lr"] = lr * min(1.0, (k + 1) / warmup) if warmup else lr
        grads = _random_tensors(generator)
        outer.step(grads)
        for param, grad in zip(reference, grads, strict=True):
            param.grad = grad.clone()
        sgd.step()
        assert_all_close(ours, reference)
        if momentum:
            assert_all_close(outer.state_tensors(), [sgd.state[p]["momentum_buffer"] for p in reference])
    assert outer.steps_taken == 6
    assert lrs == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8] if warmup else [lr] * 6)
    # the optimizer updates the very tensors it was given (the learner's global params), in place
    assert outer.params[0] is ours[0]
    assert not torch.equal(ours[0], start[0])


def test_first_step_with_momentum_is_lr_times_one_plus_mu_times_grad():
    param = torch.zeros(4)
    grad = torch.tensor([1.0, -2.0, 0.5, 0.0])
    OuterOptimizer([param], OuterConfig(lr=0.7, momentum=0.9)).step([grad])
    torch.testing.assert_close(param, -0.7 * 1.9 * grad)


@pytest.mark.parametrize(("warmup", "before", "lr_at_join"), [(0, 3, 0.7), (6, 2, 0.35)])
def test_loaded_state_continues_exactly_like_the_original(warmup: int, before: int, lr_at_join: float):
    """A peer that downloads (params, momentum, steps_taken) mid-run continues bit-identically (invariant 1), during
    the outer lr's warm-up too: steps_taken travels with the state, so a joiner's warm-up lr is the swarm's."""
    generator = torch.Generator().manual_seed(1)
    config = OuterConfig(lr=0.7, momentum=0.9, warmup_steps=warmup)
    original_params = _random_tensors(generator)
    original = OuterOptimizer(original_params, config)
    grads = [_random_tensors(generator) for _ in range(8)]
    for g in grads[:before]:
        original.step(g)

    joined_params = [p.clone() for p in original_params]
    joined = OuterOptimizer(joined_params, config)
    joined.load_state([m.clone() for m in original.state_tensors()], original.steps_taken)
    assert joined.current_lr == original.current_lr == pytest.approx(lr_at_join)
    for g in grads[before:]:
        original.step(g)
        joined.step(g)
    assert params_sha256(joined_params) == params_sha256(original_params)
    assert joined.steps_taken == original.steps_taken == 8


def test_wrong_number_of_gradients_raises():
    outer = OuterOptimizer([torch.zeros(2), torch.zeros(3)], OuterConfig())
    with pytest.raises(ValueError, match="expected 2 outer gradients, got 1"):
        outer.step([torch.zeros(2)])


def test_a_negative_warmup_is_refused():
    with pytest.raises(ValueError, match="outer.warmup_steps must be >= 0"):
        OuterConfig(warmup_steps=-1)
