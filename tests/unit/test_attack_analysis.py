"""scripts/attack.py's reading of a run: the held-out loss at equal honest tokens, and each row against the calm runs."""

from __future__ import annotations

import pytest

from experiments.attack import compare, eval_curve, loss_at_tokens, loss_interpolated


def _record(step: int, when: float, tokens: int, loss: float | None = None, status: str = "ok") -> dict:
    return dict(outer_step=step, unix_time=when, tokens=tokens, eval_loss=loss, status=status)


def test_the_eval_curve_sums_each_honest_peers_latest_tokens_at_each_evaluation():
    honest = {
        "a": [_record(0, 0.0, 0, 5.0, "init"), _record(1, 10.0, 100, 3.0), _record(2, 20.0, 250, 2.5)],
        "b": [_record(1, 11.0, 120, 3.0), _record(2, 19.0, 200, 2.5), _record(3, 30.0, 330, 2.0)],
        "c": [_record(2, 25.0, 90, None, "caught_up")],  # a catch-up is not an evaluation, but its tokens count
    }
    # step 1: a's evaluation at t=10 (b's first record comes later); step 2: b's at t=19 (a still at 100)
    assert eval_curve(honest) == [(1, 3.0, 100), (2, 2.5, 300), (3, 2.0, 250 + 330 + 90)]


def test_the_loss_at_equal_tokens_is_the_last_evaluation_within_them():
    curve = [(1, 3.0, 100), (2, 2.5, 300), (3, 2.0, 670)]
    assert loss_at_tokens(curve, 670) == (3, 2.0)
    assert loss_at_tokens(curve, 669) == (2, 2.5)
    assert loss_at_tokens(curve, 99) is None


def test_the_interpolated_loss_lies_between_the_evaluations_around_the_tokens():
    curve = [(1, 3.0, 100), (2, 2.5, 300), (3, 2.0, 700)]
    assert loss_interpolated(curve, 200) == pytest.approx(2.75)
    assert loss_interpolated(curve, 600) == pytest.approx(2.125)  # a quarter of the way back from 2.0 to 2.5
    assert loss_interpolated(curve, 300) == pytest.approx(2.5) and loss_interpolated(curve, 700) == pytest.approx(2.0)
    assert loss_interpolated(curve, 99) is None and loss_interpolated(curve, 701) is None
    assert loss_interpolated([(4, 2.2, 500)], 500) == 2.2 and loss_interpolated([], 500) is None


def _result(scenario: str, run: str, loss: float, tokens: int, curve: list) -> dict:
    return dict(
        scenario=scenario, run=run, final_outer_step=curve[-1][0], final_eval_loss=loss, honest_non_finite=False,
        invariant_1=dict(held=True), honest_finish_s=100.0, honest_failed_rounds=0, honest_stale_rounds=0,
        adversary_named_in_metrics_by=["honest0"], adversary_refused_in_logs_of=[], adversary_in_honest_group=True,
        honest_tokens=tokens, eval_curve=curve,
    )


def test_rows_compare_at_the_last_step_and_at_the_shortest_runs_honest_tokens():
    results = [
        _result("calm", "calm", 2.0, 1000, [(9, 2.2, 800), (10, 2.0, 1000)]),
        _result("calm", "calm2", 2.2, 1200, [(9, 2.2, 900), (10, 2.2, 1200)]),
        _result("nan", "nan", 2.205, 900, [(9, 2.4, 700), (10, 2.205, 900)]),  # fewest tokens: 900 is the point
    ]
    rows = {row["run"]: row for row in compare(results)}
    assert rows["nan"]["eval_loss_vs_calm"] == pytest.approx(0.05, abs=1e-4)  # 2.205 against the calm mean 2.1
    assert {row["equal_tokens"] for row in rows.values()} == {900}
    # at 900 tokens: calm at step 9 (2.2), calm2 at step 9 (2.2), nan at step 10 (2.205)
    assert rows["calm"]["outer_step_at_equal_tokens"] == 9 and rows["nan"]["outer_step_at_equal_tokens"] == 10
    assert rows["nan"]["vs_calm_at_equal_tokens"] == pytest.approx(0.005 / 2.2, abs=1e-4)
    assert rows["calm2"]["vs_calm_at_equal_tokens"] == 0.0
    # interpolated at 900 (the fewest tokens a run evaluated at): calm 2.2 + (2.0 - 2.2) * 100 / 200 = 2.1, calm2
    # 2.2 (both evaluations at 2.2), nan 2.205: against the calm mean 2.15
    assert {row["interpolated_tokens"] for row in rows.values()} == {900}
    assert rows["calm"]["vs_calm_interpolated"] == pytest.approx(-0.05 / 2.15, abs=1e-4)
    assert rows["nan"]["vs_calm_interpolated"] == pytest.approx(0.055 / 2.15, abs=1e-4)
