"""scripts/attack.py's reading of a run: the held-out loss at equal honest tokens, each run against the calm run of
its seed and peer flags, and the summary over seeds."""

from __future__ import annotations

import pytest

from experiments.attack import compare, eval_curve, loss_interpolated, markdown_table, plan, summarise


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


def test_the_interpolated_loss_lies_between_the_evaluations_around_the_tokens():
    curve = [(1, 3.0, 100), (2, 2.5, 300), (3, 2.0, 700)]
    assert loss_interpolated(curve, 200) == pytest.approx(2.75)
    assert loss_interpolated(curve, 600) == pytest.approx(2.125)  # a quarter of the way back from 2.0 to 2.5
    assert loss_interpolated(curve, 300) == pytest.approx(2.5) and loss_interpolated(curve, 700) == pytest.approx(2.0)
    assert loss_interpolated(curve, 99) is None and loss_interpolated(curve, 701) is None
    assert loss_interpolated([(4, 2.2, 500)], 500) == 2.2 and loss_interpolated([], 500) is None


def _result(scenario: str, run: str, loss: float, tokens: int, curve: list, seed: int = 0, column: str = "",
            chosen: int = 0) -> dict:
    return dict(
        scenario=scenario, run=run, seed=seed, column=column, final_outer_step=curve[-1][0], final_eval_loss=loss,
        honest_non_finite=False, invariant_1=dict(held=True), honest_finish_s=100.0, honest_failed_rounds=0,
        honest_stale_rounds=0, adversary_named_in_metrics_by=["honest0"] if scenario != "calm" else [],
        adversary_refused_in_logs_of=[], adversary_in_honest_group=True, honest_tokens=tokens, eval_curve=curve,
        attacker_chosen_states=["x"] * chosen,
    )


def test_each_run_is_compared_with_the_calm_run_of_its_seed_and_flags():
    results = [
        _result("calm", "calm-s0", 2.0, 1000, [(9, 2.2, 800), (10, 2.0, 1000)]),
        _result("nan", "nan-s0", 2.1, 900, [(9, 2.4, 700), (10, 2.1, 900)]),
        _result("calm", "calm-s1", 2.5, 1200, [(9, 2.6, 900), (10, 2.5, 1200)], seed=1),
        _result("nan", "nan-s1", 2.5, 1200, [(9, 2.6, 900), (10, 2.5, 1200)], seed=1, chosen=2),
        _result("calm", "calm-s0-f1", 3.0, 1000, [(10, 3.0, 1000)], column="--no-cross-check"),
        _result("nan", "nan-s0-f1", 3.3, 1000, [(10, 3.3, 1000)], column="--no-cross-check"),
    ]
    rows = {row["run"]: row for row in compare(results)}
    assert rows["nan-s0"]["paired_with"] == "calm-s0" and rows["nan-s1"]["paired_with"] == "calm-s1"
    assert rows["nan-s0-f1"]["paired_with"] == "calm-s0-f1"
    assert rows["nan-s0"]["vs_paired_at_last_step"] == pytest.approx(0.05)  # 2.1 against its own calm run's 2.0
    # equal tokens: 900, the fewer of the two runs' last evaluations; calm interpolated 2.2 + (2.0 - 2.2) / 2 = 2.1
    assert rows["nan-s0"]["equal_tokens"] == 900
    assert rows["nan-s0"]["vs_paired_at_equal_tokens"] == pytest.approx(0.0)
    assert rows["nan-s0"]["honest_tokens"] == 900 and rows["nan-s0"]["paired_honest_tokens"] == 1000
    assert rows["nan-s1"]["vs_paired_at_last_step"] == 0.0 and rows["nan-s0-f1"]["vs_paired_at_last_step"] == pytest.approx(0.1)
    # a calm run against the calm run of the next seed: the noise of the measure
    assert rows["calm-s0"]["paired_with"] == "calm-s1" and rows["calm-s0"]["vs_paired_at_last_step"] == pytest.approx(-0.2)
    summary = {(line["scenario"], line["column"]): line for line in summarise(list(rows.values()))}
    nan = summary[("nan", "")]
    assert nan["seeds"] == 2 and nan["vs_paired_at_last_step"] == dict(median=pytest.approx(0.025), min=0.0, max=0.05)
    assert nan["attacker_chosen_states"] == 2 and nan["named"] == "2/2" and nan["honest_tokens_vs_paired"] == [0.9, 1.0]
    assert summary[("nan", "--no-cross-check")]["seeds"] == 1
    table = markdown_table(list(rows.values()))
    assert "| nan | defaults | 2 | +2.50% (+0.00% ... +5.00%) |" in table and "| nan-s0 | calm-s0 | 10 (10) |" in table


def test_runs_are_planned_seed_by_seed_each_calm_run_before_its_attacks():
    runs = plan(["weight", "calm", "nan"], [3, 4], [("", []), ("--no-cross-check", ["--no-cross-check"])])
    assert [run for _, run, *_ in runs] == [
        "calm-s3", "weight-s3", "nan-s3", "calm-s3-f1", "weight-s3-f1", "nan-s3-f1",
        "calm-s4", "weight-s4", "nan-s4", "calm-s4-f1", "weight-s4-f1", "nan-s4-f1",
    ]
    assert runs[3][2:] == (3, "--no-cross-check", ["--no-cross-check"])
