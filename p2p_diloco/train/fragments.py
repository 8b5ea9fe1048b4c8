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
    1-D pieces into the one flat template every averaging carries."""

    def __init__(self, params: list[torch.Tensor], count: int):
        self.parts = partition_fragments(params, count)
        self._size = max(sum(s.stop - s.start for s in f) for f in self.parts)  # the template's values
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
        """The tensors one averaging carries: one flat buffer that fits any fragment, with P = 1 too. hivemind cuts
        each tensor of an averaging into parts on its own, so the built-in model's 52 tensors (34 of them of 128 to
        512 values) made 73 parts, each a message to its reducer and one back; one buffer makes 32, and a peer's
        background spent ~12% less CPU (docs/benchmarks.md, "Where a peer's time goes")."""
        return [torch.zeros(self._size)]

    def pack(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """1-D pieces of one fragment -> the averaging template's tensors."""
        flat = torch.cat(pieces)
        if flat.numel() < self._size:  # zero padding: fragments differ by a few values at most
            flat = torch.cat([flat, flat.new_zeros(self._size - flat.numel())])
        return [flat]

    def unpack(self, averaged: list[torch.Tensor], segments: list[Segment]) -> list[torch.Tensor]:
        """The averaging template's tensors -> 1-D pieces, one per segment of the fragment."""
        sizes = [s.stop - s.start for s in segments]
        return list(averaged[0][: sum(sizes)].split(sizes))
