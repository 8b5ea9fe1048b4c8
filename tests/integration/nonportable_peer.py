"""TEST ONLY: peers/peer.py with the outer step of the releases before the portable arithmetic (docs/design.md §5):
``add(alpha=)``, which torch's AVX2 kernels fuse into one multiply-add and its default kernel does not. Started by
tests/integration/test_portable_arithmetic.py under ATEN_CPU_CAPABILITY=avx2 beside portable peers, it computes
other bytes for the steps its group makes, as a machine with a non-conforming kernel would."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from p2p_diloco.cli.peer import peer_main  # noqa: E402
from p2p_diloco.core import outer  # noqa: E402


@torch.no_grad()
def _fused_step(self, outer_grads, segments=None) -> None:
    if segments is None:
        targets = list(zip(self.params, self.momentum_buffers))
    else:
        targets = [(s.of(self.params), s.of(self.momentum_buffers)) for s in segments]
    for (param, buffer), grad in zip(targets, outer_grads):
        buffer.mul_(self.momentum).add_(grad)
        param.add_(grad.add(buffer, alpha=self.momentum), alpha=-self.lr)
    self.steps_taken += 1


if __name__ == "__main__":
    outer.OuterOptimizer.step = _fused_step
    sys.exit(peer_main(prog="nonportable_peer.py"))
