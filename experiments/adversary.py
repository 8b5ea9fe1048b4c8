"""TEST ONLY: peers that misbehave on purpose, for scripts/attack.py and tests/integration/test_robust.py.

A peer started by ``experiments/adversary_peer.py --adversary KIND`` gets one of these ``SwarmLink`` subclasses
instead of the honest one, chosen once when the peer is built (``link_class``); the learner and its loop are
unchanged.
Each adversary still trains and publishes honest progress records; only the named behaviour differs:

- ``nan``: its outer gradient is all NaN, sent uncompressed (fp32) so that the NaNs arrive as NaNs;
- ``scaled``: its outer gradient is multiplied by 1e4;
- ``weight``: it declares 1e6 times the tokens behind its outer gradient;
- ``garbage_reducer``: as a reducer, it returns -1e4 times the true average of its part to everyone;
- ``wrong_donor``: it serves perturbed global params (claiming the swarm's sha256) to peers that download
  state, and advertises itself as the best donor.

and the cleverer ones, each just under a threshold or on a rule's blind side (docs/design.md §7):

- ``ahead``: claims to be ``LEAD`` outer steps ahead: publishes its real chain followed by made-up heads, serves its
  own perturbed params under the made-up head's sha256 (a state that hashes right), as the best donor;
- ``scaled_under``: its outer gradient times ``UNDER_SCALE`` (90), just under the reducers' 100x per token;
- ``weight_under``: publishes 7x its progress and declares 9.5x its tokens, just under the 1.5x-published and the
  10x-median caps;
- ``reducer_under``: as a reducer, returns the opposite of the true average, scaled to 95% of the largest result its
  groupmates accept (the group's declared part norms times ``result_median_ratio``);
- ``round_ahead``: trains and averages honestly, but its records say it is one round further on than it is;
- ``colluder``: two of them claim the same made-up history ahead (each vouches for the other's) and push their
  outer gradients, scaled as ``scaled_under``, in one shared direction.

Nothing here is reachable from the installed package: experiments/ is not part of it.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression
from hivemind.proto import runtime_pb2

from p2p_diloco.core.config import SwarmConfig
from p2p_diloco.core.history import CHAIN
from p2p_diloco.core.link import AveragingOutcome
from p2p_diloco.core.outer import state_sha256
from p2p_diloco.core.portable import seeded_normal
from p2p_diloco.swarm.guarded import GuardedAllReduceRunner
from p2p_diloco.swarm.swarm_link import SwarmLink

GRADIENT_SCALE = 1e4
WEIGHT_SCALE = 1e6
DONOR_PRIORITY_BONUS = 1000.0  # ahead of any honest donor whose records say the same (an honest one declares 0)
LEAD = 5  # outer steps an ``ahead`` peer claims past its real one
UNDER_SCALE = 90.0  # under RobustPolicy.max_norm_ratio (100)
PUBLISHED_SCALE, DECLARED_SCALE = 7.0, 9.5  # under weight_margin (1.5) x published, and max_weight_ratio (10) x median
UNDER_LIMIT = 0.95  # of the largest result a groupmate accepts


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


class RoundAheadLink(SwarmLink):
    """Trains and averages honestly, but every progress record says it is one round further on than it is: a peer
    already past a round ends that round for everyone who reads it (docs/design.md §4)."""

    def publish(self, **fields: object) -> None:
        if isinstance(fields.get("round"), int):
            fields = dict(fields, round=fields["round"] + 1)
        super().publish(**fields)


class GarbageReducerLink(SwarmLink):
    runner_class = GarbageReducerRunner


class WrongDonorLink(SwarmLink):
    """Serves perturbed params under the honest metadata, and claims the highest donor priority."""

    declared_priority = DONOR_PRIORITY_BONUS

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


class AheadClaimLink(SwarmLink):
    """Claims to be ``LEAD`` outer steps ahead of where it is, with a state that hashes to the claim (see the module
    docstring). ``colluding``: the made-up history is a function of the run and the real head alone, so that two
    colluders at the same real head claim the same one and vouch for each other."""

    colluding = False
    declared_priority = DONOR_PRIORITY_BONUS

    def __init__(self, config: SwarmConfig, template: Sequence[torch.Tensor],
                 state_provider: Callable[[], tuple[dict, Sequence[torch.Tensor]]], fragments: int = 1):
        self._real_state, self._claim, self._real_sha = state_provider, None, None
        self._key = config.run_id if self.colluding else secrets.token_hex(8)
        super().__init__(config, template, self._claimed_state, fragments)

    def _made_up(self, step: int, sha: str) -> tuple[dict, list[torch.Tensor], list[list]]:
        metadata, tensors = self._real_state()
        served_average = metadata.get("parent_sha256") is not None  # params, momentum, then the last average
        count = (len(tensors) - (len(self._template_shapes) if served_average else 0)) // 2
        params = [t + seeded_normal(t.numel(), f"{self._key} {sha} {i}").view(t.shape) * 0.05
                  for i, t in enumerate(tensors[:count])]
        momentum = list(tensors[count : 2 * count])
        chain = [[step + k, hashlib.sha256(f"{self._key} {sha} {k}".encode()).hexdigest()] for k in range(1, LEAD)]
        claim = dict(metadata, outer_step=step + LEAD, outer_steps_taken=step + LEAD, parent_sha256=None,
                     global_sha256=state_sha256(params, momentum))
        return claim, [*params, *momentum], chain

    def _base(self) -> str | None:
        return self._real_sha  # it averages from its real state: it stays in honest groups while it lies

    def publish(self, **fields: object) -> None:
        if "outer_step" in fields and "global_sha256" in fields:
            step, sha = int(fields["outer_step"]), str(fields["global_sha256"])
            self._real_sha = sha
            claim, tensors, made_up = self._made_up(step, sha)
            self._claim = (claim, tensors)
            recent = [*list(fields.get("recent") or []), [step, sha], *made_up]
            fields = dict(fields, outer_step=claim["outer_step"], global_sha256=claim["global_sha256"],
                          recent=recent[-(CHAIN - 1):])
        super().publish(**fields)

    def _claimed_state(self) -> tuple[dict, Sequence[torch.Tensor]]:
        if self._claim is None:
            return self._real_state()
        claim, tensors = self._claim
        return dict(claim, recent=[]), [t.clone() for t in tensors]


class ScaledUnderLink(SwarmLink):
    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        return super().average([t * UNDER_SCALE for t in tensors], weight, outer_step)


class WeightUnderLink(SwarmLink):
    def publish(self, **fields: object) -> None:
        if isinstance(fields.get("round_tokens"), int):
            fields = dict(fields, round_tokens=int(fields["round_tokens"] * PUBLISHED_SCALE))
        super().publish(**fields)

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        return super().average(tensors, weight * DECLARED_SCALE, outer_step)


class ReducerUnderRunner(GuardedAllReduceRunner):
    """A reducer that returns the opposite of the true average of its part, just under what its groupmates accept."""

    def _encode_result(self, part_index: int, averaged_part: torch.Tensor) -> Any:
        container = self.tensor_part_container
        own = self.ordered_peer_ids.index(self.peer_id)
        norms = self.guard.declared_norms(sum(container.num_parts_by_peer[:own]) + part_index,
                                          sum(container.num_parts_by_peer))
        norm = float(averaged_part.norm())
        if norms and norm > 0:
            limit = self.guard.policy.result_median_ratio * sorted(norms)[len(norms) // 2]
            averaged_part = averaged_part * (-UNDER_LIMIT * limit / norm)
        else:  # no declared norms to measure the limit by: turned around at its own size, which every check passes
            averaged_part = -averaged_part
        return super()._encode_result(part_index, averaged_part)


class ReducerUnderLink(SwarmLink):
    runner_class = ReducerUnderRunner


class ColluderLink(AheadClaimLink):
    """Claims the made-up history ahead that its fellow colluder claims, and pushes its outer gradient, scaled as
    ``scaled_under``, in the direction they share."""

    colluding = True

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        pushed = []
        for index, tensor in enumerate(tensors):
            direction = seeded_normal(tensor.numel(), f"{self.config.run_id} push {index}").view(tensor.shape)
            pushed.append(direction * (UNDER_SCALE * float(tensor.norm()) / max(float(direction.norm()), 1e-12)))
        return super().average(pushed, weight, outer_step)


_LINKS: dict[str, type[SwarmLink]] = {
    "": SwarmLink,
    "nan": NanGradientLink,
    "scaled": ScaledGradientLink,
    "weight": InflatedWeightLink,
    "garbage_reducer": GarbageReducerLink,
    "wrong_donor": WrongDonorLink,
    "ahead": AheadClaimLink,
    "scaled_under": ScaledUnderLink,
    "weight_under": WeightUnderLink,
    "reducer_under": ReducerUnderLink,
    "colluder": ColluderLink,
    "round_ahead": RoundAheadLink,
}


ADVERSARIES = tuple(name for name in _LINKS if name)


def link_class(adversary: str) -> type[SwarmLink]:
    """The SwarmLink class of a peer: the honest one for "", otherwise the named adversary."""
    return _LINKS[adversary]
