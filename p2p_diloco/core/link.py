"""The small interface between the learner and the swarm, and its one-process implementation.

The learner never touches hivemind: it hands outer gradients to a ``Link`` and gets back an
``AveragingOutcome`` saying who took part, or asks it for the swarm's state. ``LocalLink`` is the
swarm of one: no sockets, the same code path (invariant 6).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from p2p_diloco.core.compression import Codec, make_codec
from p2p_diloco.core.history import Node, Target


@dataclass(frozen=True)
class AveragingOutcome:
    """What one attempt at averaging returned; ``averaged`` is None when the round failed."""

    averaged: list[torch.Tensor] | None
    peers: tuple[str, ...]
    weight_total: float
    status: str  # "ok", "partial", "no_group", "error" or "stale"
    reason: str = ""
    # (peer id, why) for every groupmate whose contribution or result this peer rejected, or whose weight it clamped
    rejected: tuple[tuple[str, str], ...] = ()
    # the group's average's norm over the reference norm (the swarm's, or before it published norms our own scaled to a
    # round's tokens: swarm_view.OuterNorms); None where none was known
    norm_ratio: float | None = None


@dataclass(frozen=True)
class SwarmState:
    """Global state downloaded from a peer and verified against the swarm's published sha256."""

    outer_step: int
    global_params: list[torch.Tensor]
    momentum: list[torch.Tensor]
    outer_steps_taken: int
    steps_into_round: int  # inner steps the donor had done in its current round when it served us
    global_sha256: str
    donor: str
    # outer step r -> the peers whose outer gradients made step r -> r+1, as the donor knows it (recent steps)
    round_history: dict[int, tuple[str, ...]] = field(default_factory=dict)
    refused_donors: tuple[tuple[str, str], ...] = ()  # (peer id, why) of donors whose state failed verification
    chain: tuple[tuple[int, str], ...] = ()  # the donor's last heads (outer step, state sha256), this one last
    # the average that made this state from the donor's previous one (parent_sha256), as the averaging template's
    # tensors, if the donor averaged that step itself: what a peer one step behind recomputes it from (history.py)
    parent_sha256: str | None = None
    last_average: list[torch.Tensor] | None = None
    how: str = "majority"  # the rule of history.py that chose this state (the learner checks a "next" one itself)


@dataclass(frozen=True)
class RoundView:
    """What this peer knows of the swarm's current round (from progress records up to a period or two old, extrapolated)."""

    live_peers: int  # other peers whose progress record is fresh
    tokens_by_others: int  # tokens the other peers report for this round, each at most share_cap
    peers_ahead: int  # other peers already past this round, where that ends it (most of them, or we are behind)
    share_cap: int | None = None  # the most tokens one peer counts for in this round, ours included (None: no cap)


class Link(Protocol):
    peer_id: str

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome: ...

    def average_async(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> Future: ...

    def round_view(self, round_index: int) -> RoundView: ...

    def refresh(self) -> None: ...

    def swarm_target(self, chain: Sequence[Node], fresh: bool) -> Target | None: ...

    def peers_behind(self, outer_step: int) -> int: ...

    def reported_sha256(self, outer_step: int) -> dict[str, str]: ...

    def made_sha256(self, outer_step: int) -> dict[str, str]: ...

    def download_state(self, shapes: Sequence[Sequence[int]], target: Target) -> SwarmState | None: ...

    def refuse_donor(self, donor: str, reason: str) -> None: ...

    def norm_reference(self, outer_step: int, own_norm: float, own_tokens: float = 0.0) -> float | None: ...

    def publish(self, **fields: object) -> None: ...

    def traffic(self) -> tuple[int, int]: ...

    def states_served(self) -> tuple[int, int]: ...

    def background_cpu_s(self) -> float | None: ...

    def close(self) -> None: ...


def codec_round_trip(codec: Codec, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What a group of one gets back: its own reducer's encoded-then-decoded result."""
    return [codec.decode(codec.encode(t.reshape(-1)), t.numel()).reshape(t.shape) for t in tensors]


class ImmediateAveraging:
    """``average_async`` for links whose ``average`` answers at once: a future that is already done."""

    def average_async(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> Future:
        future: Future = Future()
        try:
            future.set_result(self.average(tensors, weight, outer_step))  # type: ignore[attr-defined]
        except Exception as e:  # the learner turns it into a failed round
            future.set_exception(e)
        return future

    def round_view(self, round_index: int) -> RoundView:
        return RoundView(live_peers=0, tokens_by_others=0, peers_ahead=0)

    def refresh(self) -> None:
        pass

    def peers_behind(self, outer_step: int) -> int:
        return 0

    def reported_sha256(self, outer_step: int) -> dict[str, str]:
        return {}

    def made_sha256(self, outer_step: int) -> dict[str, str]:
        return {}

    def refuse_donor(self, donor: str, reason: str) -> None:
        pass

    def norm_reference(self, outer_step: int, own_norm: float, own_tokens: float = 0.0) -> float | None:
        return None

    def background_cpu_s(self) -> float | None:
        return None  # no processes beside the training


class LocalLink(ImmediateAveraging):
    """A swarm of exactly one peer, in process."""

    peer_id = "local"

    def __init__(self, compression: str = "none"):
        self.codec = make_codec(compression)

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        return AveragingOutcome(codec_round_trip(self.codec, tensors), (self.peer_id,), weight, "ok")

    def swarm_target(self, chain: Sequence[Node], fresh: bool) -> Target | None:
        return None

    def download_state(self, shapes: Sequence[Sequence[int]], target: Target) -> SwarmState | None:
        return None

    def publish(self, **fields: object) -> None:
        pass

    def traffic(self) -> tuple[int, int]:
        return 0, 0

    def states_served(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        pass
