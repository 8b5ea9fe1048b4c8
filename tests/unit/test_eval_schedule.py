"""When a peer evaluates the held-out loss (train/recorder.py ``eval_due``): by default as often as keeps the
evaluations within 1% of the training compute, always at a run's last outer step; or every N outer steps."""

from __future__ import annotations

import pytest

from p2p_diloco.core.config import InnerConfig, RunConfig
from p2p_diloco.core.link import AveragingOutcome
from p2p_diloco.train import recorder
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.recorder import EVAL_BUDGET, eval_due, eval_turn

from .helpers import make_dataset, snapshot
from .test_learner_overlap import FakeLink, ListSink


def test_every_n_outer_steps_when_asked():
    assert [step for step in range(1, 10) if eval_due(step, 3, 0.0, 0.0, 1.0, final=False)] == [3, 6, 9]


def test_by_default_evaluations_stay_within_the_budget_of_the_training_compute():
    cost, round_s = 0.7, 25.0  # an evaluation of 0.7 s, rounds of 25 s of compute (the default model on a busy core)
    eval_s, compute_s, due = cost, 0.0, []  # the evaluation at start
    for step in range(1, 61):
        compute_s += round_s
        if eval_due(step, 0, eval_s, cost, compute_s, final=step == 60):
            eval_s += cost
            due.append(step)
    assert eval_s - cost <= EVAL_BUDGET * compute_s  # within the budget, but for the last step's, which is forced
    gaps = {b - a for a, b in zip(due, due[1:-1])}
    assert gaps == {2, 3}, due  # 0.7 s every 2.8 rounds of 25 s on average: 1%, the most the budget allows
    assert eval_s - cost > 0.9 * EVAL_BUDGET * compute_s  # and not much less often
    assert due[-1] == 60  # and at the last step


def test_a_cheap_evaluation_runs_every_round_and_the_last_step_always():
    assert eval_due(1, 0, eval_s=0.01, last_eval_s=0.01, compute_s=10.0, final=False)
    assert not eval_due(1, 0, eval_s=1.0, last_eval_s=1.0, compute_s=10.0, final=False)
    assert eval_due(1, 0, eval_s=1.0, last_eval_s=1.0, compute_s=10.0, final=True)
    assert eval_due(7, 5, 0.0, 0.0, 1.0, final=True)


def _swarm_schedule(group: list[str], steps: int, cost: float, round_s: float, limit: int) -> dict[str, list[int]]:
    """Which member of a group that stays together evaluates after each outer step, each deciding alone."""
    return {peer: [step for step in range(1, steps + 1)
                   if eval_turn(step, peer, group, cost, round_s, final=step == limit)] for peer in group}


def test_a_group_takes_turns_one_evaluation_per_step_as_often_as_one_peer_alone():
    group = ["12D3KooWc", "12D3KooWa", "12D3KooWb"]  # in the order the round gave them: the turn sorts them
    by_peer = _swarm_schedule(group, 60, cost=0.7, round_s=25.0, limit=60)
    steps = sorted(step for due in by_peer.values() for step in due)
    assert len(steps) == len(set(steps))  # never two members at one step: they hold the same params
    # 0.7 s per 25 s round at a 1% budget: every 3rd step (one peer alone evaluated every 2.8), and the last step
    assert steps == list(range(3, 61, 3))
    # each member took every third of them, in turn: a third of what it paid alone
    assert {peer[-1]: len(due) for peer, due in by_peer.items()} == {"a": 7, "b": 7, "c": 6}  # the last step: a's
    assert by_peer["12D3KooWb"][:2] == [3, 12] and by_peer["12D3KooWc"][:2] == [6, 15]
    alone = 0  # the evaluations of one peer that evaluates on its own, as above
    for step in range(1, 61):
        alone += eval_due(step, 0, 0.7 * (alone + 1), 0.7, 25.0 * step, final=step == 60)
    assert alone == 21 and all(len(due) <= 7 for due in by_peer.values())


def test_the_last_step_of_a_step_limit_is_one_members_and_a_peer_outside_the_group_never_evaluates():
    group = ["a", "b", "c", "d"]
    assert [eval_turn(7, peer, group, 100.0, 1.0, final=True) for peer in group] == [False, False, False, True]
    assert not eval_turn(3, "e", group, 0.0, 1.0, final=False)
    assert not eval_turn(3, "e", group, 0.0, 1.0, final=True)
    # a cheap evaluation: every step, member step mod k
    assert [[eval_turn(step, peer, group, 0.001, 10.0, final=False) for peer in group] for step in (1, 2, 5)] == [
        [False, True, False, False], [False, False, True, False], [False, True, False, False]]


class GroupOfThree(FakeLink):
    """Every round averages in a group of three (the result: our own tensors); sorted, this peer is the second."""

    learner: Learner | None = None

    def average(self, tensors, weight, outer_step):
        return AveragingOutcome(snapshot(tensors), ("z", self.peer_id, "a"), 3 * weight, "ok")

    def reported_sha256(self, outer_step):  # the groupmates made our step: the run's end need not wait for them
        return {peer: self.learner.global_sha256 for peer in ("a", "z")}


@pytest.mark.parametrize("shared, every, expected", [(True, 0, [0, 1, 4]), (False, 0, [0, 1, 2, 3, 4, 5, 6]),
                                                     (True, 2, [0, 2, 4, 6])])
def test_a_learner_in_a_group_evaluates_on_its_turns_only(make_config, monkeypatch, shared, every, expected):
    """Through the learner's records: with the budget no limit, the group evaluates every step, member step mod 3
    (this peer at 1 and 4; "a" at the last, the 6th); off, or on a fixed --eval-every, each peer on its own."""
    monkeypatch.setattr(recorder, "EVAL_BUDGET", 1e9)
    config = make_config(inner=InnerConfig(inner_steps=2, batch_size=2, lr=1e-2),
                         run=RunConfig(max_outer_steps=6, eval_batches=1, seed=3, eval_every=every, eval_shared=shared,
                                       straggler_wait_s=0.0))
    sink, link = ListSink(), GroupOfThree(complete_after=0)
    link.learner = Learner(config, make_dataset(config), metrics=sink)
    link.learner.run(link)
    assert [r["outer_step"] for r in sink.records if r["eval_loss"] is not None] == expected
    assert [r["outer_step"] for r in sink.records if r["status"] == "ok"] == [1, 2, 3, 4, 5, 6]
