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
