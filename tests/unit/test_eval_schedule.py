"""When a peer evaluates the held-out loss (train/recorder.py ``eval_due``): by default as often as keeps the
evaluations within 1% of the training compute, always at a run's last outer step; or every N outer steps."""

from __future__ import annotations

from p2p_diloco.train.recorder import EVAL_BUDGET, eval_due


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
