"""The all-reduce's part reducer: hivemind's, made safe for the senders of a part (docs/design.md §6).

hivemind 1.1.12's ``TensorPartReducer`` leaves a part's senders waiting until the round's timeout in two cases:
a sender cancelled while it waits cancels the part's shared future for all of them, and an error while the part
is averaged reaches only the sender that completed it. ``PartReducer`` fixes both; ``guarded_runner``'s robust
reducer inherits it.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from hivemind.averaging.partition import AllreduceException, TensorPartReducer

logger = logging.getLogger(__name__)


class _SharedPartFuture(asyncio.Future):
    """The future every sender of one part awaits: a sender whose wait is cancelled leaves it to the others."""

    def __await__(self):
        if self.done():
            return (yield from super().__await__())
        return (yield from asyncio.shield(self).__await__())


class PartReducer(TensorPartReducer):
    """hivemind's reducer, except that a sender cancelled while it waits for a part does not cancel the part.

    hivemind's ``accumulate_part`` ends in ``await current_part_future``, shared by all the part's senders; when a
    sender's RPC is cancelled (its peer gave up on the round) asyncio cancels that shared future too, every other
    sender of the part gets ``CancelledError``, the last one's ``set_result`` raises ``InvalidStateError``, and the
    round hangs until its timeout (docs/design.md §6; seen in CI with a peer that left a round after one part).
    Only ``finalize`` cancels a part now. The sender that left is dropped as before (``_ban_sender``).
    """

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():  # nothing refers to the part's new future yet: replace it
            self.current_part_future = _SharedPartFuture()

    def check_current_part_finished(self) -> None:
        """hivemind's, except that a part whose average cannot be computed fails every sender of the round at once.

        Raised from here, the error reached only the sender (or the ``on_sender_failed``) that completed the part:
        the part's future was never set, and every other sender, our own part included, waited for it until the
        round's timeout (docs/design.md §6; seen in CI: a group of two whose other member never sent)."""
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from != self.num_current_senders:
            return
        try:
            result = self._average_current_part()
        except Exception as e:
            logger.error("reducer: part %d could not be averaged", self.current_part_index, exc_info=True)
            self.current_part_future.set_exception(
                AllreduceException(f"part {self.current_part_index} could not be averaged: {type(e).__name__}: {e}"))
            self.finalize()  # the senders waiting for a later part end too
            return
        self.current_part_future.set_result(result)
        self.reset_accumulators()

    def _average_current_part(self) -> torch.Tensor:
        return self.accumulator.div_(self.denominator)
