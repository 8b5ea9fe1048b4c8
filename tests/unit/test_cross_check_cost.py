"""scripts/bench_cross_check.py's reading of a phase's report and its summary per side."""

from __future__ import annotations

from experiments.cross_check_cost import phase_figures, summary


def _report(bytes_per_round: int, averaging_s: list[float], tokens_per_s: float, loss: float) -> dict:
    peers = {name: dict(bytes_sent_per_round=bytes_per_round + k, outer_step_lag=0.03 * (k + 1), blocked_fraction=0.0,
                        failed_rounds=k) for k, name in enumerate(("peer0", "peer1", "peer2"))}
    records = {"peer0": [dict(status="ok", averaging_s=s) for s in averaging_s] + [dict(status="partial", averaging_s=99)]}
    return dict(peers=peers, records=records, swarm_tokens_per_s=tokens_per_s, final_eval_loss=loss,
                invariant_1=dict(held=True))


def test_a_phase_reads_medians_over_peers_and_ok_rounds_only():
    figures = phase_figures(_report(1000, [1.0, 3.0, 2.0], 21000.0, 2.3))
    assert figures["bytes_sent_per_round"] == 1001 and figures["averaging_s_per_round"] == 2.0  # the partial round aside
    assert figures["outer_step_lag"] == 0.06 and figures["failed_rounds"] == 3 and figures["invariant_1"]


def test_the_summary_gives_each_side_its_median_and_range():
    phases = [
        dict(side="cross-check", figures=phase_figures(_report(2000, [2.0], 20000.0, 2.3))),
        dict(side="no-cross-check", figures=phase_figures(_report(1000, [1.0], 21000.0, 2.3))),
        dict(side="cross-check", figures=phase_figures(_report(2200, [2.4], 19000.0, 2.4))),
        dict(side="no-cross-check", error=["exit 1"]),
    ]
    found = summary(phases)
    assert found["cross-check"]["phases"] == 2 and found["no-cross-check"]["phases"] == 1
    assert found["cross-check"]["bytes_sent_per_round"] == dict(median=2101.0, min=2001, max=2201)
    assert found["cross-check"]["swarm_tokens_per_s"] == dict(median=19500.0, min=19000.0, max=20000.0)
    assert found["no-cross-check"]["averaging_s_per_round"]["median"] == 1.0
