"""The runner of a guarded all-reduce (guarded.py): robust reducers and checked results, one all-reduce at a time.

- ``RobustPartReducer`` (hivemind's ``TensorPartReducer``, through ``reducer.PartReducer``): holds each sender's
  part aside and, when the part is complete, averages only the acceptable ones (``robust.robust_average``), with
  weights clamped to the limits the round was given. hivemind's own bookkeeping (part order, late and banned
  senders) runs unchanged on a zero placeholder.
- ``GuardedAllReduceRunner``: uses that reducer, and checks every averaged part it gets back from a reducer
  (``robust.result_problem``) before it is applied; a bad one fails the round on our side.
- ``RoundGuard``: one all-reduce's weight limits in, its rejections out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from hivemind.averaging.partition import AllreduceException

from p2p_diloco.core.robust import RobustPolicy, result_excess, result_problem, robust_average
from p2p_diloco.swarm.averaging import ExactAllReduceRunner
from p2p_diloco.swarm.reducer import PartReducer
from p2p_diloco.swarm.wire import part_blocks

logger = logging.getLogger(__name__)
_PLACEHOLDER = torch.zeros(())  # what hivemind's accumulator adds (times weight 0) while we hold the real part


class RobustPartReducer(PartReducer):
    """A reducer that averages each part over the senders that pass the checks of robust.py.

    ``allowed[i]``: tokens sender i's published progress supports (None: no limit known); ``report(i, reason,
    left_out)`` is called for every sender left out of a part (``left_out`` True) or whose weight was clamped.
    """

    def __init__(
        self,
        part_shapes: Sequence[torch.Size],
        num_senders: int,
        policy: RobustPolicy,
        allowed: Sequence[float | None],
        report: Callable[[int, str, bool], None],
        own: int | None = None,
    ):
        self._inputs: dict[tuple[int, int], tuple[Any, float]] = {}  # (sender, part) -> (part, declared weight)
        self._policy, self._allowed, self._report, self._own = policy, list(allowed), report, own
        super().__init__(part_shapes, num_senders)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        self._inputs[(sender_index, part_index)] = (tensor_part, weight)
        return await super().accumulate_part(sender_index, part_index, _PLACEHOLDER, weight=0.0)

    def _average_current_part(self) -> torch.Tensor:
        index = self.current_part_index
        # the senders hivemind counted for this part: a sender banned before sending it is not among them
        senders = sorted(s for (s, p) in self._inputs if p == index and p < self.sender_failed_after[s])
        inputs = [self._inputs[(s, index)] for s in senders]
        for key in [key for key in self._inputs if key[1] <= index]:
            del self._inputs[key]
        result, notes, left_out = robust_average(
            [part for part, _ in inputs],
            [weight if isinstance(weight, int | float) else math.nan for _, weight in inputs],
            [self._allowed[s] for s in senders],
            torch.Size(self.part_shapes[index]),
            self._policy,
            own=senders.index(self._own) if self._own in senders else None,
        )
        for position, reason in notes.items():
            self._report(senders[position], reason, position in left_out)
        return result


class GuardedAllReduceRunner(ExactAllReduceRunner):
    """The exact all-reduce with robust reducers and checked results (see the module docstring).

    ``guard``: the round's ``RoundGuard`` (weight limits in, rejections out).
    """

    def __init__(self, *, guard: RoundGuard, **kwargs: Any):
        self.guard = guard  # before the runner builds its reducer (_make_reducer)
        super().__init__(**kwargs)
        # hivemind registers each reducer's result in its container; check it there first, whoever the reducer is
        container = self.tensor_part_container
        # how many values each position's share holds (hivemind consumes its parts as it sends them)
        self.share_values = tuple(sum(int(part.numel()) for part, _ in parts) for parts in container._input_parts_by_peer)
        # the norm blocks each part covers, in hivemind's order: what the members declared norms for
        codec = self._wire_codec
        self._part_blocks = part_blocks([t.numel() for t in container.local_tensors], codec.block_values, codec.part_values)
        self._register_unchecked = container.register_processed_part
        container.register_processed_part = self._register_checked

    def _make_reducer(self) -> RobustPartReducer:
        names = [peer.to_base58() for peer in self.sender_peer_ids]
        guard = self.guard
        return RobustPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            guard.policy,
            [guard.allowed.get(name) for name in names],
            lambda sender, reason, left_out: guard.reject(names[sender], reason, "left out" if left_out else "limited"),
            own=self.sender_peer_ids.index(self.peer_id) if self.peer_id in self.sender_peer_ids else None,
        )

    def _register_checked(self, peer_index: int, part_index: int, part: torch.Tensor) -> None:
        container = self.tensor_part_container
        sent = container._input_parts_by_peer[peer_index][part_index][0]  # what we sent that reducer (hivemind 1.1.12)
        first = sum(container.num_parts_by_peer[:peer_index])  # parts are dealt to reducers in order
        norms = self.guard.declared_norms(self._part_blocks[first + part_index], self._part_blocks[-1].stop)
        problem = result_problem(part, sent, self.guard.policy, self.guard.weight_ratio, norms)
        if problem is None:
            return self._register_unchecked(peer_index, part_index, part)
        reducer = self.ordered_peer_ids[peer_index].to_base58()
        self.guard.reject(reducer, f"returned a bad average: {problem}")
        self.guard.bad_results.append(reducer)
        if problem.startswith("norm"):
            excess = result_excess(part, sent, self.guard.policy, self.guard.weight_ratio)
            if excess < self.guard.policy.result_ban_excess:  # perhaps honest, seen by a peer that just caught up
                self.guard.one_strike.add(reducer)  # one strike; more than that far over: banned at once
        container.register_failed_reducer(peer_index)  # its parts count as lost: the round fails on our side
        raise AllreduceException(f"reducer {reducer} returned a bad average: {problem}")


def declared_part_norms(value: object) -> list[float]:
    """A member's declared part norms, if well formed (a list of finite numbers >= 0), else []."""
    if not isinstance(value, list | tuple) or len(value) > 1 << 20:
        return []
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in value):
        return []
    return [float(v) for v in value]


class RoundGuard:
    """One all-reduce's weight limits (peer id -> tokens) and what it rejected (peer id -> first reason)."""

    def __init__(self, policy: RobustPolicy, allowed: dict[str, float]):
        self.policy, self.allowed = policy, allowed
        self.weight_ratio = 1.0  # the group's largest (bounded) weight over ours: how much larger its average may be
        self.rejected: dict[str, str] = {}
        self.left_out: set[str] = set()  # senders our reducer left out of the part it averaged (not just clamped)
        self.bad_results: list[str] = []  # reducers whose averages we refused
        self.part_norms: list[list[float]] = []  # per member, the norm of each part it declared (run_averaging)
        # ... that count one strike, not two: averages finite and well-formed and under result_ban_excess times too
        # large (perhaps honest, seen by a peer that just caught up), or one side of a cross-check's disagreement
        self.one_strike: set[str] = set()

    def declared_norms(self, blocks: range, total_blocks: int) -> list[float] | None:
        """The norms the members declared for the part made of norm ``blocks`` (of ``total_blocks``), from the
        members that declared one per block, each the root of the sum of its blocks' squares; None when fewer than
        half of the group did (an earlier version, or hostile data)."""
        found = [math.sqrt(sum(norms[i] ** 2 for i in blocks)) for norms in self.part_norms if len(norms) == total_blocks]
        return found if found and 2 * len(found) >= len(self.part_norms) else None

    def reject(self, peer: str, reason: str, action: Literal["refused", "left out", "limited"] = "refused") -> None:
        """Note what ``peer`` sent wrong and what we did: "refused" its average, "left out" its part, or "limited" its
        part (cut to a limit, still counted: an honest peer's part is cut now and then, design.md §7)."""
        if action == "left out":
            self.left_out.add(peer)
        if peer not in self.rejected:
            logger.warning("%s %s: %s", action, peer, reason)
            self.rejected[peer] = reason
