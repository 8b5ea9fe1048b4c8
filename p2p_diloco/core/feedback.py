"""Error feedback for the lossiest codecs (docs/design.md §2): the sender's (``ErrorFeedback``: what its codec did not
send goes into its next outer gradient) and the reducer's (``ReducerFeedback``: what its re-encode of a part's average
dropped goes into that part's next average). Pure torch, no hivemind; the codecs are compression.py's.

Both rely on a property every codec in ``FEEDBACK_CODECS`` has: a decoded part encodes to itself (to the last bits),
because a peer's all-reduce encodes for the wire the values the feedback already rounded.
"""

from __future__ import annotations

import torch

from p2p_diloco.core.compression import Codec

# codecs whose sender keeps what the codec dropped and sends it in the next round
FEEDBACK_CODECS = ("int4", "int2", "topk")


class ErrorFeedback:
    """Carries what a lossy codec did not send into the next round (error feedback, docs/design.md §2).

    ``prepare`` returns the values to send, ``decoded(outer_grad + residual)``, and the candidate residual;
    ``commit`` keeps that residual once the round succeeded (a failed round sent nothing, so its residual
    is dropped: the next outer gradient already contains the unsent progress).
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self.residual: list[torch.Tensor] | None = None

    def prepare(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        corrected = [t + r for t, r in zip(tensors, self.residual)] if self.residual else list(tensors)
        sent = [self.codec.decode(self.codec.encode(c.reshape(-1)), c.numel()).reshape(c.shape) for c in corrected]
        return sent, [c - s for c, s in zip(corrected, sent)]

    def commit(self, residual: list[torch.Tensor]) -> None:
        self.residual = residual


class ReducerFeedback:
    """The reducer's error feedback (docs/design.md §2): what its re-encode of a part's average dropped, added to that
    part's average the next time it reduces it, in the next round of the same fragment.

    A residual is kept per part (its index among all the parts of one averaging) with the outer step it was made
    at, and used only at outer step + ``stride`` (the fragments: the next round of the same tensors); a peer that
    did not reduce that part then, or a round that failed in between, leaves it unused (the plain re-encode: never
    worse than no feedback). ``begin`` starts a round, ``encode`` replaces the codec's encode for each part,
    ``commit`` keeps the round's residuals once its all-reduce succeeded and ``abandon`` drops them.
    """

    def __init__(self, codec: Codec, stride: int = 1):
        self.codec, self.stride = codec, stride
        self._kept: dict[int, tuple[int, torch.Tensor]] = {}
        self._pending: dict[int, torch.Tensor] = {}
        self._outer_step: int | None = None

    def begin(self, outer_step: int) -> None:
        self._outer_step, self._pending = outer_step, {}

    def encode(self, part: int, averaged: torch.Tensor) -> bytes:
        flat = averaged.detach().to(torch.float32).reshape(-1)
        kept = self._kept.get(part)
        if kept is not None and self._outer_step is not None and kept[0] == self._outer_step - self.stride \
                and kept[1].numel() == flat.numel():
            flat = flat + kept[1]
        data = self.codec.encode(flat)
        self._pending[part] = flat - self.codec.decode(data, flat.numel())
        return data

    def commit(self) -> None:
        if self._outer_step is None:
            return
        fragment = self._outer_step % self.stride
        self._kept = {part: kept for part, kept in self._kept.items() if kept[0] % self.stride != fragment}
        self._kept.update({part: (self._outer_step, residual) for part, residual in self._pending.items()})
        self._pending = {}

    def abandon(self) -> None:
        self._pending = {}
