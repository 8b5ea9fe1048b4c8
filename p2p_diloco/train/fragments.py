"""Streaming fragments (Streaming DiLoCo, docs/design.md §1): outer step r averages fragment r % P of the params only,
so that each burst on the wire is about P times smaller. How the params are split, and how a fragment's pieces travel
in the one template every averaging carries."""

from __future__ import annotations

import torch

from p2p_diloco.core.outer import Segment


def partition_fragments(params: list[torch.Tensor], count: int) -> list[list[Segment]]:
    """Split the params into ``count`` fragments of whole tensors, balanced by size (largest first into the
    least-filled fragment; ties by position, so every peer computes the same split).

    Whole tensors, because a fragment's outer step moves its tensors at once while the others wait: rows of
    one matrix synced at different times (the tied embedding/output matrix above all, whose rows are the
    logits of different tokens) made the global params inconsistent, and the swarm learned measurably slower
    at equal tokens than with one fragment. Only a tensor larger than one fragment's share (total / count) is
    cut, into contiguous flat slices of at most that share."""
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    if not 1 <= count <= total:
        raise ValueError(f"cannot split params of {total} values into {count} fragments")
    share = total // count  # pieces no larger than this are at least `count` many, so no fragment is empty
    pieces = []
    for index, size in enumerate(sizes):
        cuts = -(-size // share)
        pieces += [Segment(index, size * j // cuts, size * (j + 1) // cuts) for j in range(cuts)]
    loads, fragments = [0] * count, [[] for _ in range(count)]
    for piece in sorted(pieces, key=lambda s: (s.start - s.stop, s.index, s.start)):
        k = min(range(count), key=lambda k: (loads[k], k))
        fragments[k].append(piece)
        loads[k] += piece.stop - piece.start
    return [sorted(fragment) for fragment in fragments]


class Fragments:
    """The params split into P fragments: outer step r averages fragment ``r % P``. Also counts, per fragment, the
    tokens of local progress not yet synced into it (what its next outer gradient carries), and packs a fragment's
    1-D pieces into the one template every averaging carries. With P = 1 the template is the params' own shapes."""

    def __init__(self, params: list[torch.Tensor], count: int):
        self._params = params
        self.parts = partition_fragments(params, count)
        self.unsynced = [0] * count  # tokens of local progress not yet in each fragment

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, index: int) -> list[Segment]:
        return self.parts[index]

    def __iter__(self):
        return iter(self.parts)

    def at(self, outer_step: int) -> tuple[int, list[Segment]]:
        """The fragment outer step ``outer_step`` averages: its index and segments."""
        index = outer_step % len(self.parts)
        return index, self.parts[index]

    def trained(self, tokens: int) -> None:
        self.unsynced = [count + tokens for count in self.unsynced]

    def synced(self, index: int, tokens: int) -> None:
        self.unsynced[index] -= tokens

    def template(self) -> list[torch.Tensor]:
        """The tensors one averaging carries: the params themselves, or one flat buffer that fits any fragment."""
        if len(self.parts) == 1:
            return [torch.zeros_like(p) for p in self._params]
        return [torch.zeros(max(sum(s.stop - s.start for s in f) for f in self.parts))]

    def pack(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """1-D pieces of one fragment -> the averaging template's tensors."""
        if len(self.parts) == 1:  # whole tensors: keep their shapes
            return [piece.view(param.shape) for piece, param in zip(pieces, self._params)]
        (template,) = self.template()
        flat = torch.cat(pieces)
        return [torch.cat([flat, template[flat.numel() :]])]  # zero padding: fragments differ by a few values at most

    def unpack(self, averaged: list[torch.Tensor], segments: list[Segment]) -> list[torch.Tensor]:
        """The averaging template's tensors -> 1-D pieces, one per segment of the fragment."""
        if len(self.parts) == 1:
            return [tensor.reshape(-1) for tensor in averaged]
        sizes = [s.stop - s.start for s in segments]
        return list(averaged[0][: sum(sizes)].split(sizes))
