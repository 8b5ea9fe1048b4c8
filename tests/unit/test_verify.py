"""A downloaded state is checked whole (verify.state_problem), and a next step that no majority backs is taken only
if it recomputes from our own state and its average passes a reducer result's checks (verify.next_step_problem)."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.core.config import OuterConfig
from p2p_diloco.core.history import Target
from p2p_diloco.core.link import SwarmState
from p2p_diloco.core.outer import OuterOptimizer, Segment, state_sha256
from p2p_diloco.core.portable import seeded_normal
from p2p_diloco.core.verify import next_step_problem, state_problem, tie_problem, verified_state

SHAPES = [(6, 4), (5,)]


def _tensors(key: str, scale: float = 1.0) -> list[torch.Tensor]:
    return [seeded_normal(int(torch.Size(shape).numel()), f"{key} {i}").mul_(scale).view(shape) for i, shape in enumerate(SHAPES)]


def _metadata(**changes) -> dict:
    return dict(outer_step=7, outer_steps_taken=7, steps_into_round=3, round_history={"6": ["a", "b"]}) | changes


def test_a_whole_honest_state_passes():
    assert state_problem(_metadata(), _tensors("p"), _tensors("m", 0.1), SHAPES) is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda p, m, md: (p[:1], m, md), "serves 1 params"),
        (lambda p, m, md: ([p[0].double(), p[1]], m, md), "not float32"),
        (lambda p, m, md: ([p[0].view(4, 6), p[1]], m, md), "not float32 (6, 4)"),
        (lambda p, m, md: (p, [m[0], torch.full((5,), float("nan"))], md), "non-finite"),
        (lambda p, m, md: (p, [m[0] * 1e4, m[1]], md), "momentum's norm"),
        (lambda p, m, md: (p, m, _metadata(outer_steps_taken=3)), "took 3 outer steps to reach outer step 7"),
        (lambda p, m, md: (p, m, _metadata(outer_step=-1)), "counters"),
        (lambda p, m, md: (p, m, _metadata(steps_into_round=True)), "counters"),
        (lambda p, m, md: (p, m, _metadata(round_history={"9": ["a"]})), "round history"),
        (lambda p, m, md: (p, m, _metadata(round_history={"6": ["a"] * 2000})), "round history"),
    ],
)
def test_a_state_that_is_not_whole_is_refused_with_the_reason(change, expected):
    params, momentum, metadata = change(_tensors("p"), _tensors("m", 0.1), _metadata())
    problem = state_problem(metadata, params, momentum, SHAPES)
    assert problem is not None and expected in problem


def _next_state(params, momentum, average, steps_taken: int, step: int, parent: str, segments) -> SwarmState:
    new_params, new_momentum = [p.clone() for p in params], [m.clone() for m in momentum]
    optimizer = OuterOptimizer(new_params, OuterConfig())
    optimizer.load_state(new_momentum, steps_taken)
    optimizer.step(average, segments)
    sha = state_sha256(new_params, optimizer.momentum_buffers)
    return SwarmState(step + 1, new_params, new_momentum, steps_taken + 1, 0, sha, "donor", parent_sha256=parent)


def test_a_next_step_is_taken_only_if_it_recomputes_and_its_average_is_plausible():
    params, momentum = _tensors("p"), _tensors("m", 0.01)
    own_sha, segments = state_sha256(params, momentum), [Segment(0, 0, 24), Segment(1, 0, 5)]
    sent = [piece.reshape(-1) for piece in _tensors("sent", 0.01)]
    honest = [piece.reshape(-1) for piece in _tensors("avg", 0.01)]
    state = _next_state(params, momentum, honest, 7, 7, own_sha, segments)
    check = dict(own_step=7, global_params=params, momentum=momentum, steps_taken=7, own_sha256=own_sha,
                 outer=OuterConfig(), segments=segments, sent=sent)
    assert next_step_problem(state, averaged=honest, **check) is None
    # served with another average than the one that made it: does not recompute
    other = [piece + 1e-3 for piece in honest]
    assert "does not give its bytes" in next_step_problem(state, averaged=other, **check)
    # a consistent step from an average far larger than anything we sent: a reducer's result would be refused
    huge = [piece * 1e5 for piece in honest]
    assert "checks of a reducer's result" in next_step_problem(_next_state(params, momentum, huge, 7, 7, own_sha, segments),
                                                                averaged=huge, **check)
    # a group that colluders dominated: its average passes a reducer result's checks (under 100x what we sent) but is
    # 40x the swarm's reference norm, the step its honest member refused; served as the next step, refused again
    pushed = [piece * 40 for piece in sent]
    dominated = _next_state(params, momentum, pushed, 7, 7, own_sha, segments)
    reference = float(torch.cat(sent).norm())
    assert next_step_problem(dominated, averaged=pushed, **check) is None  # no reference known: the old checks only
    assert "swarm's check of a group average" in next_step_problem(dominated, averaged=pushed, reference=reference, **check)
    assert next_step_problem(state, averaged=honest, reference=reference, **check) is None
    # made from another state than ours, or with no average at all
    assert "no average made from our state" in next_step_problem(
        _next_state(params, momentum, honest, 7, 7, "0" * 64, segments), averaged=honest, **check)
    assert "no average made from our state" in next_step_problem(state, averaged=None, **check)


def _served(average: list[torch.Tensor] | None = None) -> tuple[dict, list[torch.Tensor], Target]:
    params, momentum = _tensors("p"), _tensors("m", 0.1)
    digest = state_sha256(params, momentum)
    metadata = _metadata(global_sha256=digest, parent_sha256="ab" * 32, recent=[[6, "cd" * 32]])
    return metadata, params + momentum + (average or []), Target(7, digest, "majority")


def test_a_served_state_that_hashes_to_the_vouched_target_is_taken_with_its_average():
    average = [torch.ones(6, 4), torch.ones(5)]
    metadata, tensors, target = _served(average)
    state = verified_state(metadata, tensors, SHAPES, SHAPES, "donor", target)
    assert isinstance(state, SwarmState)
    assert (state.outer_step, state.global_sha256, state.donor, state.how) == (7, target.sha256, "donor", "majority")
    assert state.round_history == {6: ("a", "b")} and state.chain[-1] == (7, target.sha256)
    assert state.last_average is not None and all(torch.equal(a, b) for a, b in zip(state.last_average, average))


def test_a_served_state_is_refused_when_it_is_not_the_vouched_one_or_malformed():
    metadata, tensors, target = _served()
    other = Target(7, "00" * 32, "majority")
    assert "not outer step 7 with the sha256" in verified_state(metadata, tensors, SHAPES, SHAPES, "d", other)
    lying = dict(metadata, global_sha256="00" * 32)  # the bytes hash to the target, the metadata says otherwise
    assert "not outer step 7" in verified_state(lying, tensors, SHAPES, SHAPES, "d", target)
    assert verified_state("not a dict", tensors, SHAPES, SHAPES, "d", target) == "malformed state"
    assert verified_state(metadata, tensors[:3], SHAPES, SHAPES, "d", target) == "malformed state"
    garbage = dict(metadata, round_history={"x": 5, "3": ["a"]})
    assert isinstance(verified_state(garbage, tensors, SHAPES, SHAPES, "d", target), str)


def test_an_average_of_other_shapes_leaves_the_state_but_no_next_step_to_recompute():
    metadata, tensors, target = _served([torch.ones(4, 6), torch.ones(5)])
    state = verified_state(metadata, tensors, SHAPES, SHAPES, "d", target)
    assert isinstance(state, SwarmState) and state.last_average is None


def test_a_fork_won_on_a_tie_is_taken_only_within_one_honest_round_of_ours():
    """verify.tie_problem: two steps from one parent differ by their averages' difference dg (momentum dg, params
    lr (1 + momentum) dg); an honest group's average is at most swarm_norm_ratio reference norms."""
    params, momentum = _tensors("p"), _tensors("m", 0.01)
    segments = [Segment(0, 0, 24), Segment(1, 0, 5)]
    ours_avg = [piece.reshape(-1) for piece in _tensors("ours", 0.01)]
    theirs_avg = [piece.reshape(-1) for piece in _tensors("theirs", 0.01)]
    reference = float(torch.cat(ours_avg).norm())

    def step(average):
        new_params, new_momentum = [p.clone() for p in params], [m.clone() for m in momentum]
        optimizer = OuterOptimizer(new_params, OuterConfig())
        optimizer.load_state(new_momentum, 7)
        optimizer.step(average, segments)
        return new_params, optimizer.momentum_buffers

    own_params, own_momentum = step(ours_avg)
    honest_params, honest_momentum = step(theirs_avg)  # another honest group's step from the same parent
    assert tie_problem(honest_params, honest_momentum, own_params, own_momentum, reference, OuterConfig()) is None
    pushed_params, pushed_momentum = step([piece * 40 for piece in theirs_avg])  # colluders' pushed step
    problem = tie_problem(pushed_params, pushed_momentum, own_params, own_momentum, reference, OuterConfig())
    assert problem is not None and "more than one honest round" in problem
    # params alone moved (momentum left as ours): refused all the same
    assert tie_problem(pushed_params, own_momentum, own_params, own_momentum, reference, OuterConfig()) is not None
    assert tie_problem(pushed_params, pushed_momentum, own_params, own_momentum, None, OuterConfig()) is None  # no bound
