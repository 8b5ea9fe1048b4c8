"""The outer step of DiLoCo: Nesterov-momentum SGD on the global parameters, and their fingerprint.

Global parameters and momentum are kept as fp32 CPU tensors and updated only with elementwise IEEE
operations, so every peer that starts from the same bytes and applies the same averaged outer gradient
ends with the same bytes (invariant 1). This module knows nothing of the network.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from p2p_diloco.config import OuterConfig


class Segment(NamedTuple):
    """Elements ``start:stop`` of the flattened parameter tensor number ``index``."""

    index: int
    start: int
    stop: int

    def of(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The segment as a 1-D view into ``tensors[index]``: writing to it writes to the tensor."""
        return tensors[self.index].view(-1)[self.start : self.stop]


class OuterOptimizer:
    """SGD with Nesterov momentum, the same arithmetic as ``torch.optim.SGD(nesterov=True, dampening=0)``:

    m <- mu * m + g ;  theta <- theta - lr * (g + mu * m)      (DiLoCo §2, outer lr 0.7, mu 0.9)
    """

    def __init__(self, global_params: Sequence[torch.Tensor], config: OuterConfig):
        self.params = list(global_params)
        self.lr, self.momentum = config.lr, config.momentum
        self.momentum_buffers = [torch.zeros_like(p) for p in self.params]
        self.steps_taken = 0

    @torch.no_grad()
    def step(self, outer_grads: Sequence[torch.Tensor], segments: Sequence[Segment] | None = None) -> None:
        """Apply the outer step to all params (one gradient per param), or only to ``segments`` (one streaming
        fragment: one 1-D gradient per segment). The arithmetic is elementwise, so a segment's bytes do not
        depend on what else is updated."""
        if segments is None:
            targets = list(zip(self.params, self.momentum_buffers))
        else:
            targets = [(s.of(self.params), s.of(self.momentum_buffers)) for s in segments]
        if len(outer_grads) != len(targets):
            raise ValueError(f"expected {len(targets)} outer gradients, got {len(outer_grads)}")
        for (param, buffer), grad in zip(targets, outer_grads):
            update = grad
            if self.momentum:
                # the buffer starts at zero, so the first step leaves it equal to the gradient, as torch's SGD does
                buffer.mul_(self.momentum).add_(grad)
                update = grad.add(buffer, alpha=self.momentum)
            param.add_(update, alpha=-self.lr)
        self.steps_taken += 1

    def state_tensors(self) -> list[torch.Tensor]:
        return self.momentum_buffers

    def load_state(self, momentum_buffers: Sequence[torch.Tensor], steps_taken: int) -> None:
        for buffer, value in zip(self.momentum_buffers, momentum_buffers, strict=True):
            buffer.copy_(value)
        self.steps_taken = steps_taken


def params_sha256(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 over the raw bytes of the tensors, in order: equal iff every byte is equal."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()
