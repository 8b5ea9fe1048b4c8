"""The outer step of DiLoCo: Nesterov-momentum SGD on the global parameters, and their fingerprint.

Global parameters and momentum are kept as fp32 CPU tensors and updated only with elementwise IEEE
operations, so every peer that starts from the same bytes and applies the same averaged outer gradient
ends with the same bytes (invariant 1). This module knows nothing of the network.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from p2p_diloco.config import OuterConfig


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
    def step(self, outer_grads: Sequence[torch.Tensor], indices: Sequence[int] | None = None) -> None:
        """Apply the outer step to all params, or only to ``indices`` (one streaming fragment)."""
        indices = range(len(self.params)) if indices is None else indices
        if len(outer_grads) != len(indices):
            raise ValueError(f"expected {len(indices)} outer gradients, got {len(outer_grads)}")
        for index, grad in zip(indices, outer_grads):
            param, buffer = self.params[index], self.momentum_buffers[index]
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
