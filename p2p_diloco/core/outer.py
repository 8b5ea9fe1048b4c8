"""The outer step of DiLoCo: Nesterov-momentum SGD on the global parameters, and their fingerprint.

Global parameters and momentum are fp32 tensors updated with single, separately rounded IEEE fp32 operations
(portable.py, docs/design.md §5), so every peer that starts from the same bytes and applies the same averaged
outer gradient ends with the same bytes on any CPU, thread count or GPU (invariant 1). The fingerprint of the
shared state covers the momentum as well as the params: a momentum that drifted apart shows at the step where
it drifts, not steps later in the params. This module knows nothing of the network.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from p2p_diloco.core.config import OuterConfig
from p2p_diloco.core.portable import fp32


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

    Each of the five operations is one fp32 multiply or add, rounded on its own (docs/design.md §5): never
    ``add(alpha=)``, which AVX2 kernels fuse into one FMA and the default kernel does not, and never a Python
    float, which a kernel may apply in double. Its bytes are the same on every backend; its values are within
    an ulp or two of torch's SGD.

    With ``warmup_steps`` W, update k (counted from 0 in ``steps_taken``, which peers share) uses lr (k + 1) / W
    while k < W: a Python double rounded once to fp32, so the same bytes on every peer.
    """

    def __init__(self, global_params: Sequence[torch.Tensor], config: OuterConfig):
        self.params = list(global_params)
        self.lr, self.momentum, self.warmup_steps = config.lr, config.momentum, config.warmup_steps
        self._momentum = fp32(config.momentum)
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
        lr = fp32(self.current_lr)  # --outer-lr itself once the warm-up is over (or without one)
        for (param, buffer), grad in zip(targets, outer_grads):
            grad = grad.to(param.device, torch.float32)
            update = grad
            if self.momentum:
                # the buffer starts at zero, so the first step leaves it equal to the gradient, as torch's SGD does
                buffer.mul_(self._momentum).add_(grad)  # m <- mu * m + g: a multiply, then an add
                update = buffer.mul(self._momentum).add_(grad)  # g + mu * m
            param.sub_(update.mul(lr))  # theta <- theta - lr * update
        self.steps_taken += 1

    @property
    def current_lr(self) -> float:
        """The outer lr the next update uses (below ``lr`` during the warm-up)."""
        if self.steps_taken >= self.warmup_steps:
            return self.lr
        return self.lr * (self.steps_taken + 1) / self.warmup_steps

    def state_tensors(self) -> list[torch.Tensor]:
        return self.momentum_buffers

    def load_state(self, momentum_buffers: Sequence[torch.Tensor], steps_taken: int) -> None:
        for buffer, value in zip(self.momentum_buffers, momentum_buffers, strict=True):
            buffer.copy_(value)
        self.steps_taken = steps_taken


def params_sha256(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 over the raw (little-endian) bytes of the tensors, in order: equal iff every byte is equal."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def state_sha256(global_params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> str:
    """The fingerprint of the state every peer shares at an outer step, published as ``global_sha256``: the global
    params and the outer momentum, everything the next outer step reads (docs/design.md §3, invariant 1)."""
    return params_sha256([*global_params, *momentum])
