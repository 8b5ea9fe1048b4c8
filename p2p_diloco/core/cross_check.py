"""Cross-checked averaging: every part of the average reduced twice, by two different peers (docs/design.md §7).

A reducer sees every sender's part and returns one average for its share of the values. Centered clipping bounds
what *senders* can do to an average, and the result check bounds its *size*, but nothing in one all-reduce tells a
member whether its reducer returned the true average or another vector of the same size: the reducer that returns
the average turned around, just under the size limit, makes every member climb the loss on its share
(docs/security.md, "Attacks, measured"). So with ``--cross-check`` a group runs its all-reduce twice over the same
values: the second time each share is reduced by the next reducer of the group (``second_order``), and a member
applies the average only where both reducers of each share returned the same values, within ``tolerance`` (the
reducers' float sums may differ in the last bits on unlike CPUs, and their codecs then round a few values
differently). Where they differ the round fails on our side, and nobody applies an average that a single liar
chose.

Who lied is known for sure only by a member that reduced one of the two itself: the other one. A member that
reduced neither knows only that one of the two did; a liar that lies every time it reduces is in two of the
disagreeing pairs, the only peer they share. ``suspects`` names both cases; the averager counts them as strikes
(two strikes ban). The costs: twice the wire bytes and the time of one averaging, and a round that a lying reducer
is in fails until it is banned.

This module is pure torch: it sees reducers as names and values as flat vectors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def second_order(peers: Sequence[str], fractions: Sequence[float]) -> list[str]:
    """The group's order for the second all-reduce: each share (position) with a reducer (fraction > 0) goes to the
    next peer that reduces a share, cyclically; peers that reduce none (clients, demoted) keep their position. The
    fractions stay as they are, so each position holds the same values in both all-reduces."""
    reducing = [i for i, fraction in enumerate(fractions) if fraction > 0]
    order = list(peers)
    for k, position in enumerate(reducing):
        order[position] = peers[reducing[(k + 1) % len(reducing)]]
    return order


def disagreeing_shares(first: torch.Tensor, second: torch.Tensor, share_values: Sequence[int], tolerance: float) -> list[int]:
    """The positions whose share of the flat average differs between the two all-reduces by more than ``tolerance``
    times the larger of the two norms (``share_values``: how many values each position holds, in order)."""
    if first.shape != second.shape or sum(share_values) != first.numel():
        raise ValueError(f"shares of {sum(share_values)} values do not cover averages of {first.numel()} and {second.numel()}")
    found, start = [], 0
    for position, count in enumerate(share_values):
        a, b = first[start:start + count], second[start:start + count]
        start += count
        if count == 0:
            continue
        scale = max(float(a.norm()), float(b.norm()))
        if not bool(torch.isfinite(a).all() and torch.isfinite(b).all()) or float((a - b).norm()) > tolerance * scale:
            found.append(position)
    return found


def suspects(positions: Sequence[int], first: Sequence[str], second: Sequence[str], own: str) -> set[str]:
    """Who to count a strike against for the disagreeing ``positions`` (reducers by position: ``first``, ``second``).

    Where we reduced one side ourselves, the other side's reducer (we trust our own sums). Otherwise only a reducer
    that is the one peer common to every disagreeing pair we did not reduce, and in two or more of them (a liar that
    lied in both all-reduces is in exactly two, the shares it reduced and the ones before them). With only two
    reducers in the group their two pairs are the same two peers: a member that reduced neither names nobody.
    """
    pairs = [(first[p], second[p]) for p in positions if first[p] != second[p]]
    named = {b if a == own else a for a, b in pairs if own in (a, b)}
    others = [{a, b} for a, b in pairs if own not in (a, b)]
    if len(others) >= 2:
        common = set.intersection(*others)
        if len(common) == 1:
            named |= common
    return named


def agreed_limits(members: Sequence[str], views: Sequence[object]) -> dict[str, float]:
    """The weight limits (tokens a sender's published progress supports) that both reducers of a share apply.

    Each reducer bounds a sender's weight by the progress records it read itself, and two honest reducers read
    them at other moments: their averages then differ, and cross-checking would blame an honest reducer. So a
    cross-checking member declares its view (peer -> tokens) with its group request, and every member takes, per
    sender, the upper median of the *other* members' views of it (a sender's word on itself does not count; with
    honest members a majority it is an honest view, and the upper median of two is the larger, so one member alone
    cannot lower an honest sender's limit in a group of three or more). A sender nobody else has a view of has no
    limit. ``views[i]``: what member i declared (anything but a dict of finite numbers >= 0 counts as none).
    """
    limits: dict[str, float] = {}
    for sender in members:
        seen = sorted(
            float(view[sender]) for member, view in zip(members, views, strict=True)
            if member != sender and isinstance(view, dict) and _tokens(view.get(sender)) is not None
        )
        if seen:
            limits[sender] = seen[len(seen) // 2]
    return limits


def _tokens(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < float("inf") else None
