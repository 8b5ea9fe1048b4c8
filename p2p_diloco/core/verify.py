"""Checks of a state downloaded from another peer, whose every byte and number is that peer's word
(docs/design.md §7): the whole state's form, and a next step recomputed from our own state. Pure torch.

- ``state_problem``: every tensor of the shapes and dtype this model has, params and momentum finite, the momentum
  bounded (10 times the params' norm, far above any honest momentum: an outer step adds at most a few times an
  outer gradient to it), counters that agree with the outer step, a well-formed round history and chain.
- ``tie_problem``: a same-step fork decided by the smaller sha256 alone (as many vouch for each side: a hostile side
  can grind its hash to win) is taken only if its state lies within what another honest group could have made from
  the parent both sides share: its momentum within ``swarm_norm_ratio`` reference norms of ours, its params within
  outer lr (1 + momentum) times that.
- ``verified_state``: a downloaded state, whole and hashing to what the swarm vouches for, or why not.
- ``next_step_problem``: a state one step past ours that no majority vouches for (a swarm of two) is taken only if
  our own state plus the average its donor serves gives exactly its bytes (the portable arithmetic makes this a
  byte comparison, docs/design.md §5), and that average passes the checks a reducer's result passes against the
  outer gradient we sent for that step (robust.result_problem), and the swarm's reference norm
  (robust.swarm_problem): its donor can move us no further than a reducer, or a group, could.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from p2p_diloco.core import history
from p2p_diloco.core.config import OuterConfig
from p2p_diloco.core.link import SwarmState
from p2p_diloco.core.outer import OuterOptimizer, Segment, state_sha256
from p2p_diloco.core.robust import RobustPolicy, result_problem, swarm_problem

MOMENTUM_BOUND = 10.0  # a served momentum's norm may be at most this times its params' norm (or 1, if larger)
MAX_HISTORY_PEERS = 1024  # peers one served round may name


def state_problem(
    metadata: Mapping, params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]],
) -> str | None:
    """Why the served state cannot be ours to take (its form, numbers and counters), or None."""
    if len(params) != len(shapes) or len(momentum) != len(shapes):
        return f"it serves {len(params)} params and {len(momentum)} momentum tensors, this model has {len(shapes)}"
    for name, tensors in (("params", params), ("momentum", momentum)):
        for index, (tensor, shape) in enumerate(zip(tensors, shapes)):
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != torch.float32:
                return f"its {name} tensor {index} is {tensor.dtype} {tuple(tensor.shape)}, not float32 {tuple(shape)}"
            if not bool(torch.isfinite(tensor).all()):
                return f"its {name} tensor {index} holds non-finite values"
    params_norm = math.sqrt(sum(float(t.double().square().sum()) for t in params))
    momentum_norm = math.sqrt(sum(float(t.double().square().sum()) for t in momentum))
    if momentum_norm > MOMENTUM_BOUND * max(1.0, params_norm):
        return f"its momentum's norm {momentum_norm:.3g} is over {MOMENTUM_BOUND:g}x its params' ({params_norm:.3g})"
    step, taken, into = (metadata.get(key) for key in ("outer_step", "outer_steps_taken", "steps_into_round"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**53 for v in (step, taken, into)):
        return "its counters are not integers in range"
    if taken != step:  # every outer step is one step of the outer optimizer, on every peer
        return f"it took {taken} outer steps to reach outer step {step}"
    history = metadata.get("round_history", {})
    if not isinstance(history, Mapping) or not all(
        str(key).isdigit() and int(key) < step and isinstance(peers, list | tuple) and len(peers) <= MAX_HISTORY_PEERS
        for key, peers in history.items()
    ):
        return "its round history names steps it has not made, or too many peers"
    return None


def next_step_problem(
    state: SwarmState, own_step: int, global_params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor],
    steps_taken: int, own_sha256: str, outer: OuterConfig, segments: Sequence[Segment],
    averaged: Sequence[torch.Tensor] | None, sent: Sequence[torch.Tensor], policy: RobustPolicy | None = None,
    reference: float | None = None,
) -> str | None:
    """Why ``state`` is not the step after ours: ``averaged``, the donor's average as one 1-D piece per segment of
    the fragment that step averaged, applied to our params and momentum, must give its sha256; and it must pass a
    reducer result's checks against ``sent``, the outer gradient we sent for that step (one piece per segment), and
    a group average's against ``reference``, the reference norm for that step (the swarm's, or in a run's first
    rounds our own scaled to a round's tokens: swarm_view.OuterNorms; a group that colluders dominated computed a
    step that its honest member refused: served as the next step, it must be refused again)."""
    if state.outer_step != own_step + 1 or averaged is None or state.parent_sha256 != own_sha256:
        return "it serves no average made from our state"
    params, buffers = [p.clone() for p in global_params], [m.clone() for m in momentum]
    optimizer = OuterOptimizer(params, outer)
    optimizer.load_state(buffers, steps_taken)
    try:
        optimizer.step(list(averaged), list(segments))
    except (RuntimeError, ValueError) as e:  # pieces of the wrong size
        return f"its average does not fit our params ({type(e).__name__})"
    if state_sha256(params, optimizer.momentum_buffers) != state.global_sha256:
        return "our state plus the average it serves does not give its bytes"
    policy = policy or RobustPolicy()
    flat = torch.cat([piece.reshape(-1) for piece in averaged])
    problem = result_problem(flat, torch.cat([piece.reshape(-1) for piece in sent]), policy, policy.result_weight_scale_cap)
    if problem:
        return f"its average fails the checks of a reducer's result: {problem}"
    problem = swarm_problem(float(flat.norm()), reference, policy)
    return f"its average fails the swarm's check of a group average: {problem}" if problem else None


def tie_problem(
    params: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor], own_params: Sequence[torch.Tensor],
    own_momentum: Sequence[torch.Tensor], reference: float | None, outer: OuterConfig, policy: RobustPolicy | None = None,
) -> str | None:
    """Why a fork won on a tie must not be taken: two steps from one parent differ by the difference of their
    averages, dg (momentum: dg; params: lr (1 + momentum) dg, docs/design.md §2), and an honest group's average is at
    most ``swarm_norm_ratio`` times ``reference`` (an honest outer-gradient norm: the average that made our head).
    None (taken) within that, or with no reference. Forks that split several steps ago lie further apart and stay
    apart on a tie, as equal halves of a partition do (§4)."""
    if reference is None or not reference > 0:
        return None
    policy = policy or RobustPolicy()
    limit = policy.swarm_norm_ratio * reference
    momentum_apart = _distance(momentum, own_momentum)
    params_apart = _distance(params, own_params)
    params_limit = outer.lr * (1 + outer.momentum) * limit
    if momentum_apart > limit or params_apart > params_limit:
        return (f"it lies {params_apart:.3g} from our params (limit {params_limit:.3g}) and {momentum_apart:.3g} from our "
                f"momentum (limit {limit:.3g}): more than one honest round from the parent we share")
    return None


def _distance(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float((a.double() - b.double().to(a.device)).square().sum()) for a, b in zip(tensors, others, strict=True)))


def verified_state(
    metadata: object, tensors: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]],
    template_shapes: Sequence[tuple[int, ...]], donor: str, target: history.Target,
) -> SwarmState | str:
    """The donor's state if it is whole (``state_problem``) and hashes to ``target``'s sha256 at its outer step,
    otherwise why not. ``tensors``: its params, momentum and (optionally) the average that made its state, of the
    averaging template's ``template_shapes``."""
    count = len(shapes)
    if not isinstance(metadata, dict) or len(tensors) not in (2 * count, 2 * count + len(template_shapes)):
        return "malformed state"
    params, momentum = list(tensors[:count]), list(tensors[count : 2 * count])
    problem = state_problem(metadata, params, momentum, shapes)
    if problem is not None:
        return problem
    digest = state_sha256(params, momentum)
    if (metadata["outer_step"], digest) != target.node or digest != metadata.get("global_sha256"):
        return f"its state is not outer step {target.step} with the sha256 the swarm vouches for ({target.how})"
    average = list(tensors[2 * count :]) or None
    if average is not None and [tuple(t.shape) for t in average] != list(template_shapes):
        average = None  # not an average of ours: the state stands, no next step can be recomputed from it
    parent = metadata.get("parent_sha256")
    chain = history.chain_of(dict(outer_step=metadata["outer_step"], global_sha256=digest, recent=metadata.get("recent")))
    return SwarmState(
        outer_step=metadata["outer_step"],
        global_params=params,
        momentum=momentum,
        outer_steps_taken=metadata["outer_steps_taken"],
        steps_into_round=metadata["steps_into_round"],
        global_sha256=digest,
        donor=donor,
        round_history=parse_history(metadata.get("round_history")),
        chain=chain,
        parent_sha256=parent if isinstance(parent, str) else None,
        last_average=[t.float() for t in average] if average is not None else None,
        how=target.how,
    )


def parse_history(value: object) -> dict[int, tuple[str, ...]]:
    """A donor's round history, keeping only well-formed entries (it is a hint, never trusted for bytes)."""
    history: dict[int, tuple[str, ...]] = {}
    if isinstance(value, dict):
        for step, peers in value.items():
            if isinstance(step, int | str) and str(step).isdigit() and isinstance(peers, list | tuple):
                history[int(step)] = tuple(str(p) for p in peers)
    return history
