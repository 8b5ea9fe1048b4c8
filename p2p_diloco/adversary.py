"""TEST ONLY: peers that misbehave on purpose, for scripts/attack.py and tests/integration/test_robust.py.

A peer started with the hidden flag ``--adversary KIND`` gets one of these ``SwarmLink`` subclasses instead of
the honest one, chosen once when the peer is built (``link_class``); the learner and its loop are unchanged.
Each adversary still trains and publishes honest progress records; only the named behaviour differs:

- ``nan``: its outer gradient is all NaN, sent uncompressed (fp32) so that the NaNs arrive as NaNs;
- ``scaled``: its outer gradient is multiplied by 1e4;
- ``weight``: it declares 1e6 times the tokens behind its outer gradient;
- ``garbage_reducer``: as a reducer, it returns -1e4 times the true average of its part to everyone;
- ``wrong_donor``: it serves perturbed global params (claiming the swarm's sha256) to peers that download
  state, and advertises itself as the best donor.

Nothing here is reachable from a normal run: ``--adversary`` is absent from ``--help`` and defaults to honest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression
from hivemind.proto import runtime_pb2

from p2p_diloco.config import SwarmConfig
from p2p_diloco.guarded import GuardedAllReduceRunner
from p2p_diloco.link import AveragingOutcome
from p2p_diloco.swarm import SwarmLink

GRADIENT_SCALE = 1e4
WEIGHT_SCALE = 1e6
DONOR_PRIORITY_BONUS = 1000.0  # ahead of any honest donor (whose priority is its outer step, +0.5)


class _RawWire(CompressionBase):
    """Parts cut exactly as ``codec`` cuts them (so they line up with the reducers'), but sent as raw fp32."""

    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self, codec: CompressionBase):
        self._codec, self._raw = codec, NoCompression()

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return self._raw.compress(tensor, info, allow_inplace)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self._raw.extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self._codec.estimate_compression_ratio(info)


class RawWireRunner(GuardedAllReduceRunner):
    """Sends its parts uncompressed: a codec must not launder what the adversary sends (int8 turns NaN into 0)."""

    def __init__(self, **kwargs: Any):
        kwargs["compression"] = _RawWire(kwargs["compression"])
        super().__init__(**kwargs)


class GarbageReducerRunner(GuardedAllReduceRunner):
    """A reducer that returns -1e4 times the average of its part, encoded once for every sender."""

    def _encode_result(self, part_index: int, averaged_part: torch.Tensor) -> Any:
        return super()._encode_result(part_index, averaged_part * -GRADIENT_SCALE)


class NanGradientLink(SwarmLink):
    runner_class = RawWireRunner

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        return super().average([torch.full_like(t, float("nan")) for t in tensors], weight, outer_step)


class ScaledGradientLink(SwarmLink):
    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        return super().average([t * GRADIENT_SCALE for t in tensors], weight, outer_step)


class InflatedWeightLink(SwarmLink):
    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        return super().average(tensors, max(1.0, weight) * WEIGHT_SCALE, outer_step)


class GarbageReducerLink(SwarmLink):
    runner_class = GarbageReducerRunner


class WrongDonorLink(SwarmLink):
    """Serves perturbed params under the honest metadata, and claims the highest donor priority."""

    def __init__(
        self,
        config: SwarmConfig,
        template: Sequence[torch.Tensor],
        state_provider: Callable[[], tuple[dict, Sequence[torch.Tensor]]],
        fragments: int = 1,
    ):
        def poisoned() -> tuple[dict, Sequence[torch.Tensor]]:
            metadata, tensors = state_provider()
            return metadata, [t + 0.05 * torch.randn_like(t) for t in tensors]

        super().__init__(config, template, poisoned, fragments)

    def refresh_donor_priority(self, outer_step: int, global_sha256: str) -> None:
        super().refresh_donor_priority(outer_step, global_sha256)
        assert self._averager is not None
        self._averager.state_sharing_priority = self._averager.state_sharing_priority + DONOR_PRIORITY_BONUS


_LINKS: dict[str, type[SwarmLink]] = {
    "": SwarmLink,
    "nan": NanGradientLink,
    "scaled": ScaledGradientLink,
    "weight": InflatedWeightLink,
    "garbage_reducer": GarbageReducerLink,
    "wrong_donor": WrongDonorLink,
}


def link_class(adversary: str) -> type[SwarmLink]:
    """The SwarmLink class of a peer: the honest one for "", otherwise the named adversary."""
    return _LINKS[adversary]
