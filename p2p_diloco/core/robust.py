"""Robust averaging of one all-reduce part: what a reducer accepts from its senders, and what a sender accepts
back from a reducer (docs/design.md §3, invariant 5: garbage in never spreads; §7).

A reducer averages one part of the outer gradient for its whole group. hivemind adds whatever arrives, with
whatever weight the sender declares: one NaN sender turns every result into NaN, a weight of 1e6 takes the
average over. Here every received part is checked before it counts:

- *form*: the part has the expected shape and dtype (float32) and only finite values;
- *weight*: finite and >= 0, and clamped to what the sender's published progress supports (``allowed``), and,
  in a group of three or more, to ``max_weight_ratio`` times the median weight;
- *size*: its L2 norm per unit of weight (tokens) is at most ``max_norm_ratio`` times the (lower) median of the
  senders' for that part (a small part can do no more harm than its clamped weight allows); a part whose norm is
  over ``norm_clip_ratio`` times both that median times its weight and the senders' median norm is scaled down to
  the larger of the two, and still counts.

A sender that fails the form or size check is left out of that part's average. The accepted ones are averaged
by *centered clipping*: around a robust centre c (the coordinate-wise median of the accepted parts, or, in a group
of two, the reducer's own part), each sender's deviation p_i - c is clipped to a radius tau (``clip_ratio`` times
the median deviation; in a group of two, ``pair_clip_ratio`` times the norm of the reducer's own part, times how
many more tokens the other declared, up to ``result_weight_scale_cap``), and the result is c plus the weighted mean
of the clipped deviations. So the adversaries among the senders move a part's average, against
the clipped mean of the honest senders around the same centre, by at most 2 (W_adv / W) tau, where W_adv / W is
their share of the clamped weights; with honest senders a majority, c lies coordinate by coordinate within the
honest values and tau is an honest peer's scale (docs/design.md §7). Each part has exactly one reducer, which
encodes its result once for everyone (averaging.py), so every honest peer still gets the same bytes (invariant 1).
With no acceptable sender a part averages to zeros: a zero step for those values, the same on every peer.

A sender checks what a reducer returns (``result_problem``): at most ``result_median_ratio`` times the upper
median of the norms that the group's members declared for that part (the bound above, with room for the codec),
or, where no norms were declared, ``result_norm_ratio`` times the norm of what it sent itself. Those limits hold
while honest members are a majority of the group; a group that adversaries dominate can only be told by the rest of
the swarm: ``swarm_reference`` is the upper median of the outer-gradient norms the live peers published, and a group
average over ``swarm_norm_ratio`` times it is refused whoever reduced it.

This module is pure torch: it does not know hivemind or who the senders are, only their index in the group.
It does not detect a reducer that returns a plausible but wrong average: cross_check.py does, with two reducers per
share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RobustPolicy:
    """Thresholds of the checks above (ratios are dimensionless)."""

    max_norm_ratio: float = 100.0  # a part's norm per token may be at most this times the senders' median (honest
    # peers differed up to ~30x per token in one group: catch-ups and token counts do not move together exactly)
    max_weight_ratio: float = 10.0  # with >= 3 senders, a weight may be at most this times the median weight
    weight_margin: float = 1.5  # a declared weight may exceed the tokens a sender published by this factor
    result_norm_ratio: float = 100.0  # an averaged part may be at most this times the norm of the part we sent...
    # ...times how many more tokens the group's largest sender trained than we did, up to this factor: a peer
    # that caught up a moment ago sends a tiny outer gradient, and honest averages were 100-190x its norm
    result_weight_scale_cap: float = 30.0
    # an average this many times over that limit is banned at once: honest ones seen over it were within 2x
    result_ban_excess: float = 10.0
    # centered clipping, 3 or more senders: a deviation from the centre is cut to this times the median one. 2 before:
    # a sender just under the 100x check, cut to that radius every round, lengthened every outer step along its own
    # outer gradient, and with the average in flight for most of a round (peers train on meanwhile) the outer steps
    # overshot. One-process study, 3 seeds, 90% of a round's steps taken while its average is in flight: +2.3 to +6.5%
    # held-out loss in a group of four at 2, +0.1 to +2.0% at 1; in a group of three, +11 to +18% at 2, +4 to +5% at 1;
    # calm and fast-island (4x the steps) runs within 1% of the plain mean at either (docs/security.md)
    clip_ratio: float = 1.0
    # a group of two: the other's deviation is cut to this times our own part's norm (times its token ratio). Not 1:
    # two honest reducers of a pair each clip around their own part, and under --cross-check the two averages of a
    # share then differed whenever the clipping bit, and the pair banned each other (docs/security.md)
    pair_clip_ratio: float = 2.0
    # before the centre is taken, a part whose norm is over this times both the senders' median norm per token times
    # its weight and their median norm is scaled down to the larger of the two (the sender still counts): a sender
    # that trains honestly and scales its outer gradient up is then an honest-sized sender along its own direction.
    # One-process study, 3 seeds, overlap 0.9, with clip_ratio 1: the x90 sender in a group of three +0.3 to +0.9%
    # held-out loss at 1 (+1.5 to +2.0% at 1.5, +4.3 to +5.4% without); in a group of four -2.3 to +1.9% (-0.8 to +2.0%
    # without); calm groups +0.3 to +0.8% against +0.3 to +0.6% without, fast-island groups as without it
    # (docs/security.md)
    norm_clip_ratio: float = 1.0
    # a reducer's result may be at most this times the upper median of the part norms the group declared: the
    # clipped mean lies within |c| + tau <= (1 + 2 clip_ratio) honest norms, and the codecs add up to ~10%
    result_median_ratio: float = 6.0
    # cross-checked averaging (cross_check.py): a share's two averages may differ by this fraction of their norm
    # (unlike CPUs sum in other orders, and the codec then rounds a few values to the next level)
    cross_check_tolerance: float = 0.05
    # a group's whole average may be at most this times the swarm's reference norm (swarm_reference): the limit that
    # holds when adversaries are a majority of the group (but not of the swarm), with room for honest peers that
    # trained more tokens than most
    swarm_norm_ratio: float = 6.0

    def __post_init__(self) -> None:
        for name in ("max_norm_ratio", "max_weight_ratio", "weight_margin", "result_norm_ratio", "result_weight_scale_cap",
                     "result_ban_excess", "clip_ratio", "pair_clip_ratio", "norm_clip_ratio", "result_median_ratio",
                     "swarm_norm_ratio"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"RobustPolicy.{name} must be >= 1, got {getattr(self, name)}")


def part_problem(part: torch.Tensor, shape: torch.Size) -> str | None:
    """Why a received part cannot be averaged (wrong shape, dtype or non-finite values), or None if it can."""
    if not isinstance(part, torch.Tensor):
        return f"not a tensor ({type(part).__name__})"
    if part.shape != shape:
        return f"shape {tuple(part.shape)} instead of {tuple(shape)}"
    if part.dtype != torch.float32:
        return f"dtype {part.dtype} instead of float32"
    if not bool(torch.isfinite(part).all()):
        return "non-finite values"
    return None


def clamp_weights(declared: list[float], allowed: list[float | None], policy: RobustPolicy) -> tuple[list[float], dict[int, str]]:
    """Weights the reducer will use, and a note per sender whose weight was rejected (NaN, < 0) or clamped.

    ``allowed[i]``: tokens sender i's published progress supports (None: nothing published, no clamp). Progress
    records are a period or two old, so the limit is never below the group's (lower) median declared weight: an
    honest peer whose last record lags is not cut below its groupmates. A rejected weight comes back as NaN; the
    caller leaves that sender out.
    """
    valid = sorted(w for w in declared if isinstance(w, int | float) and math.isfinite(w) and w >= 0)
    median = valid[(len(valid) - 1) // 2] if valid else 0.0
    weights, notes = [], {}
    for index, (weight, limit) in enumerate(zip(declared, allowed, strict=True)):
        if not (isinstance(weight, int | float) and math.isfinite(weight) and weight >= 0):
            weights.append(math.nan)
            notes[index] = f"weight {weight!r} rejected"
            continue
        if limit is not None and weight > max(policy.weight_margin * limit, median):
            limit = max(policy.weight_margin * limit, median)
            notes[index] = f"weight {weight:.4g} clamped to {limit:.4g} (published progress)"
            weight = limit
        weights.append(float(weight))
    valid = sorted(w for w in weights if not math.isnan(w))
    if len(valid) >= 3:
        cap = policy.max_weight_ratio * valid[(len(valid) - 1) // 2]
        for index, weight in enumerate(weights):
            if weight > cap:
                notes[index] = f"weight {weight:.4g} clamped to {cap:.4g} ({policy.max_weight_ratio:g}x the median)"
                weights[index] = cap
    return weights, notes


def robust_average(
    parts: list[torch.Tensor],
    declared_weights: list[float],
    allowed_weights: list[float | None],
    shape: torch.Size,
    policy: RobustPolicy,
    own: int | None = None,
) -> tuple[torch.Tensor, dict[int, str], frozenset[int]]:
    """The centered-clipped weighted mean of the acceptable parts (float32, ``shape``; see the module docstring);
    per sender index, why it was rejected, its weight clamped or its deviation cut by more than half; and the
    indices of the senders left out (a clamped or clipped sender still counts). ``own``: the index of the reducer's
    own part, the centre in a group of two. Deterministic: the same inputs in the same order give the same bytes."""
    weights, notes = clamp_weights(declared_weights, allowed_weights, policy)
    rejected: dict[int, str] = {i: note for i, note in notes.items() if math.isnan(weights[i])}
    candidates = []
    for index, part in enumerate(parts):
        problem = None if index in rejected else part_problem(part, shape)
        if problem is not None:
            rejected[index] = problem
        elif index not in rejected:
            candidates.append(index)
    # size per token: an honest outer gradient's norm grows with the tokens behind it (a peer that caught up a
    # moment ago sends a tiny one, a fast peer a large one: raw norms of honest senders differed 10-40x in one
    # group), so the norm per unit of (clamped) weight is what is compared; only the large side is rejected,
    # since a small part can do no more than its weight allows
    sizes = {i: float(parts[i].norm()) / weights[i] if weights[i] > 0 else 0.0 for i in candidates}
    if len(candidates) >= 2:
        ordered = sorted(sizes.values())
        median = ordered[(len(ordered) - 1) // 2]  # the lower median: with 2 senders, the smaller one
        for index in list(candidates):
            if median > 0 and sizes[index] > policy.max_norm_ratio * median:
                rejected[index] = (
                    f"norm per token {sizes[index]:.3g} > {policy.max_norm_ratio:g}x the median {median:.3g}"
                )
                candidates.remove(index)
    parts = _norm_clipped(parts, weights, candidates, policy.norm_clip_ratio, notes)
    result = _clipped_mean(parts, weights, candidates, own, shape, policy, notes)
    left_out = frozenset(rejected)
    for index, note in notes.items():
        rejected.setdefault(index, note)  # a clamped weight is reported too (the sender still counts)
    return result, rejected, left_out


def _norm_clipped(parts: list[torch.Tensor], weights: list[float], candidates: list[int], ratio: float,
                  notes: dict[int, str]) -> list[torch.Tensor]:
    """``parts`` with each candidate's norm cut to ``ratio`` times the larger of two honest sizes: the median norm per
    token times its weight, and the candidates' (lower) median norm. Over both only: an honest peer that trained
    fewer tokens than the others has a larger norm per token (an outer gradient's norm grows slower than its tokens)
    but not a larger norm, and one that trained more has a larger norm but not per token; a sender that scales its
    outer gradient up is over both."""
    if not (math.isfinite(ratio) and len(candidates) >= 2):
        return parts
    norms = {i: float(parts[i].norm()) for i in candidates}
    ordered = sorted(norms.values())
    median_norm = ordered[(len(ordered) - 1) // 2]  # the lower median: with 2 senders, the smaller
    ordered = sorted(norms[i] / weights[i] if weights[i] > 0 else 0.0 for i in candidates)
    median = ordered[(len(ordered) - 1) // 2]
    parts = list(parts)
    for index in candidates:
        limit = ratio * max(median * weights[index], median_norm)
        if norms[index] > limit:
            parts[index] = parts[index] * (limit / norms[index])
            if norms[index] > 2 * limit:
                notes.setdefault(index, f"norm {norms[index]:.3g} cut to {limit:.3g} ({ratio:g}x the median's)")
    return parts


def _clipped_mean(
    parts: list[torch.Tensor], weights: list[float], candidates: list[int], own: int | None, shape: torch.Size,
    policy: RobustPolicy, notes: dict[int, str],
) -> torch.Tensor:
    """c + sum_i w_i clip(p_i - c, tau) / sum_i w_i over the candidates, in sender order (see the module docstring);
    notes the senders whose deviation was cut to less than half. Zeros when there is no candidate."""
    if not candidates:
        return torch.zeros(shape, dtype=torch.float32)
    stacked = torch.stack([parts[i].reshape(-1) for i in candidates])
    count = len(candidates)
    if count >= 3:
        centre = coordinate_median(list(stacked.unbind(0)))
    elif own in candidates and count == 2:
        centre = parts[own].reshape(-1).clone()  # two senders: neither is a majority; we trust our own part
    else:  # one sender (its part, exactly), or two of which neither is ours
        return _weighted_mean(stacked, [weights[i] for i in candidates]).view(shape)
    deviations = stacked - centre
    distances = deviations.norm(dim=1)
    if count >= 3:
        ordered = distances.sort().values
        scale = float(ordered[(count - 1) // 2] + ordered[count // 2]) / 2  # the median deviation
    else:  # the other's deviation is bounded by our own part's norm, times how many more tokens it declared
        other = next(i for i in candidates if i != own)
        ratio = weights[other] / weights[own] if weights[own] > 0 else policy.result_weight_scale_cap
        scale = float(centre.norm()) * min(policy.result_weight_scale_cap, max(1.0, ratio))
    radius = (policy.clip_ratio if count >= 3 else policy.pair_clip_ratio) * scale
    for row, index in enumerate(candidates):
        distance = float(distances[row])
        if distance > radius:
            deviations[row].mul_(radius / distance if distance > 0 else 0.0)
            if distance > 2 * radius:
                notes.setdefault(index, f"deviation {distance:.3g} from the centre cut to {radius:.3g}")
    return (centre + _weighted_mean(deviations, [weights[i] for i in candidates])).view(shape)


def coordinate_median(rows: list[torch.Tensor]) -> torch.Tensor:
    """Each coordinate's median of ``rows`` (finite, of one shape): the mean of the middle two for an even count. The
    rows are put in order by an odd-even transposition network of element-wise minima and maxima, which selects exactly
    what ``torch.stack(rows).sort(dim=0)`` would, 8x faster on the CPU for 3 rows (a sort along the stacking dimension
    sorts each column apart: a third of a profile of the averager's process, docs/benchmarks.md "Where a peer's time
    goes")."""
    rows, count = list(rows), len(rows)
    for sweep in range(count):
        for j in range(sweep % 2, count - 1, 2):
            rows[j], rows[j + 1] = torch.minimum(rows[j], rows[j + 1]), torch.maximum(rows[j], rows[j + 1])
    return (rows[(count - 1) // 2] + rows[count // 2]) / 2


def _weighted_mean(rows: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """Rows averaged with ``weights`` (equal shares when they sum to 0), summed in row order."""
    total = sum(weights)
    result = torch.zeros(rows.shape[1], dtype=torch.float32)
    for row, weight in zip(rows, weights):
        result.add_(row, alpha=weight / total if total > 0 else 1.0 / len(weights))
    return result


def result_problem(
    result: torch.Tensor, sent: torch.Tensor, policy: RobustPolicy, weight_ratio: float = 1.0,
    declared_norms: Sequence[float] | None = None,
) -> str | None:
    """Why an averaged part returned by a reducer must not be applied, or None if it may.

    With ``declared_norms`` (the norms the group's members declared for this part, ours among them): a centered-clipped
    mean is at most about (1 + 2 ``clip_ratio``) honest norms, so a result over ``result_median_ratio`` times their
    upper median (an honest member's, when honest members are a majority) is refused. Without them: more than
    ``result_norm_ratio`` times our part's norm, times ``weight_ratio`` (the group's largest weight over ours, within
    [1, ``result_weight_scale_cap``]: a sender that trained more tokens sends a larger outer gradient). A wrong
    shape or a non-finite value is refused either way.
    """
    problem = part_problem(result, sent.shape)
    if problem is not None:
        return problem
    if declared_norms:
        # the upper median: a member that just caught up declares a tiny norm, a hostile one a huge one; with honest
        # members a majority, the upper median is an honest norm no smaller than the typical one
        median = sorted(declared_norms)[len(declared_norms) // 2]
        norm = float(result.norm())
        if median > 0 and norm > policy.result_median_ratio * median:
            return f"norm {norm:.3g} > {policy.result_median_ratio:g}x the median norm the group declared ({median:.3g})"
        return None
    if result_excess(result, sent, policy, weight_ratio) > 1.0:
        limit = _result_limit(policy, weight_ratio)
        return f"norm {float(result.norm()):.3g} > {limit:.3g}x the norm we sent ({float(sent.norm()):.3g})"
    return None


def total_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of several tensors taken as one vector."""
    return math.sqrt(sum(float(t.detach().float().norm()) ** 2 for t in tensors))


def swarm_reference(own_norm: float, published: Sequence[object], others: int) -> float | None:
    """The norm a group's average is measured against when its members may be mostly adversaries (docs/design.md §7):
    the upper median of the outer-gradient norms that the ``others`` live peers published for this fragment, with
    ours of this round among them, and never below ours. With honest peers a majority of the live peers, whatever
    norms a minority publishes, the upper median is an honest one. None (no check) while fewer than half of the
    others published a well-formed norm (a swarm's first round, an earlier version).
    """
    norms = [float(v) for v in published
             if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0]
    if not norms or 2 * len(norms) < others:
        return None
    own_norm = own_norm if math.isfinite(own_norm) and own_norm >= 0 else 0.0  # ours broken: the others' word only
    values = sorted([*norms, own_norm])
    return max(own_norm, values[len(values) // 2])


def own_reference(own_norm: float, own_tokens: float, published_tokens: Sequence[object],
                  typical_tokens: float = 0.0) -> float | None:
    """The reference before the swarm published norms (a run's first rounds, docs/design.md §7): our own outer
    gradient's norm, scaled from the ``own_tokens`` behind it to a round's typical tokens when those are more (never
    scaled down). Typical: the larger of ``typical_tokens`` (our own config's share of the round's budget) and the
    upper median of the tokens the live peers published for the rounds our outer gradient stands for
    (``published_tokens``, ours among them; records lag a period behind). An honest norm grows no faster than the
    tokens behind it (AdamW moves each value by about the lr per step at most, its first steps the most), and with
    honest peers a majority of the live peers both figures are an honest peer's, so the result is an honest peer's
    scale whatever a group's members declare. None without an outer gradient of ours to measure from."""
    if not (math.isfinite(own_norm) and own_norm > 0 and math.isfinite(own_tokens) and own_tokens > 0):
        return None
    tokens = sorted([float(own_tokens), *(float(t) for t in published_tokens if isinstance(t, int | float)
                                         and not isinstance(t, bool) and math.isfinite(t) and t >= 0)])
    typical = max(tokens[len(tokens) // 2], typical_tokens if math.isfinite(typical_tokens) else 0.0)
    return own_norm * max(1.0, typical / own_tokens)


def swarm_problem(result_norm: float, reference: float | None, policy: RobustPolicy,
                  what: str = "the swarm's reference norm") -> str | None:
    """Why a group's whole average must not be applied, judged against ``reference`` (the swarm's reference norm,
    or ``own_reference``), or None."""
    if reference is None or reference <= 0 or result_norm <= policy.swarm_norm_ratio * reference:
        return None
    return (f"the group's average (norm {result_norm:.3g}) is {result_norm / reference:.1f}x {what} "
            f"({reference:.3g}; limit {policy.swarm_norm_ratio:g}x)")


def result_excess(result: torch.Tensor, sent: torch.Tensor, policy: RobustPolicy, weight_ratio: float = 1.0) -> float:
    """How many times over ``result_problem``'s norm limit an averaged part is (0 when we sent zeros)."""
    sent_norm = float(sent.norm())
    return float(result.norm()) / (_result_limit(policy, weight_ratio) * sent_norm) if sent_norm > 0 else 0.0


def _result_limit(policy: RobustPolicy, weight_ratio: float) -> float:
    return policy.result_norm_ratio * min(policy.result_weight_scale_cap, max(1.0, weight_ratio))
