"""The learning study (experiments/learning.py and its learning_* modules): the shared lr schedule, its two methods'
arithmetic, the byte accounting, the phases' plan, resuming, the report, bad input."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

from experiments.learning import load, main, run_probes, run_study
from experiments.learning_floor import probe_runs
from experiments.learning_grids import (
    FLOOR_CARRIED,
    FLOOR_CLIP_CARRIED,
    FLOOR_CLIP_DP_FACTORS,
    FLOOR_CLIP_FACTORS,
    FLOOR_CLIP_ISLAND_NORMS,
    FLOOR_ISLAND_FACTORS,
    FLOOR_LENGTH_DP_LRS,
    FLOOR_LENGTH_FACTORS,
    FLOOR_LENGTHS,
    FLOOR_MORE_PROBES,
    FLOOR_NESTEROV,
    FLOOR_POINTS,
    FLOOR_PROBES,
    IID_INNER_LR_FACTORS,
    ISLAND_BATCH,
    ISLAND_STEPS,
    LOW_BIT_POINTS,
    MUON_DP_LRS,
    MUON_INNER_LRS,
    MUON_OUTER_GRID,
    MUON_POINTS,
    MUON_SEEDED,
    OUTER_WARMUP_POINTS,
    OVERLAP_EAGER,
    OVERLAP_POINTS,
    OVERLAP_SEEDED,
    OVERLAP_WAITING,
    SEEDS,
    SIZE_DILOCO,
    SIZE_POINTS,
    SIZE_SEEDS,
    SPARSE_H,
    _standard,
)
from experiments.learning_plan import next_runs, plan
from experiments.learning_plot import curves
from experiments.learning_report import report, summarize
from experiments.learning_runs import CLIP, STEPS, Run, lr_factor, preview, train
from p2p_diloco.core.compression import make_codec


def tiny(method: str, **kwargs) -> Run:
    # half the default width: the same layers, heads and context, a quarter of the matmuls (Muon's bf16 Newton-Schulz
    # is slow on CPUs without bf16 instructions)
    return Run(method, kwargs.pop("inner_lr", 2e-3), steps=kwargs.pop("steps", 6), peers=kwargs.pop("peers", 1),
               batch_size=2, eval_batches=1, d_model=kwargs.pop("d_model", 64), **kwargs)


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_its_floor():
    assert lr_factor(0, 1000, warmup=10) == pytest.approx(0.1)
    assert lr_factor(9, 1000, warmup=10) == pytest.approx(1.0)  # the peak at the warm-up's last step
    assert lr_factor(10, 1000, warmup=10) == pytest.approx(1.0)
    assert lr_factor(505, 1000, warmup=10) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-3)  # half way: the mean
    assert lr_factor(1000, 1000, warmup=10, final=0.1) == pytest.approx(0.1)
    factors = [lr_factor(s, 1000, warmup=10) for s in range(10, 1000)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))


def test_one_island_with_a_plain_outer_step_is_sync_dp_of_one():
    # outer lr 1 without momentum and no codec sets the global params to the island's after every round: the same
    # AdamW on the same batches with the same schedule as sync DP over one shard (the broken-method check)
    dp = train(tiny("syncdp"))
    diloco = train(tiny("diloco", inner_steps=3))
    assert diloco["final_loss"] == pytest.approx(dp["final_loss"], abs=1e-4)
    assert diloco["outer_steps"] == 2 and dp["tokens"] == diloco["tokens"] == 6 * 2 * 128
    assert diloco["island_agreement_first_quarter"] == pytest.approx(1.0)  # one island agrees with itself
    assert dp["final_loss"] < dp["curve"][0][1]  # it learned


def test_momentum_and_the_codec_change_the_result():
    plain = train(tiny("diloco", inner_steps=2, peers=2))
    nesterov = train(tiny("diloco", inner_steps=2, peers=2, outer_lr=0.7, outer_momentum=0.9))
    int4 = train(tiny("diloco", inner_steps=2, peers=2, compression="int4"))
    topk = train(tiny("diloco", inner_steps=2, peers=2, compression="topk"))
    fed_back = train(tiny("diloco", inner_steps=2, peers=2, compression="topk", reducer_feedback=True))
    iid = train(tiny("diloco", inner_steps=2, peers=2, data="iid"))
    muon = train(tiny("diloco", inner_steps=2, peers=2, optimizer="muon"))
    warmed = train(tiny("diloco", inner_steps=2, peers=2, outer_lr=0.7, outer_momentum=0.9, outer_warmup=2))
    losses = [r["final_loss"] for r in (plain, nesterov, int4, topk, fed_back, iid, muon, warmed)]
    assert len(set(losses)) == len(losses), losses
    assert fed_back["key"].startswith("diloco H=2 reducer-feedback topk") and " data=iid" in iid["key"]
    assert muon["key"].endswith(" muon") and muon["optimizer"] == "muon"
    assert warmed["key"].endswith(" outer-warmup=2") and warmed["outer_warmup"] == 2
    # two islands on different data send different outer gradients: their mean is shorter than either (1/2 if orthogonal)
    assert all(0.5 <= r["island_agreement_first_quarter"] < 0.999 for r in (plain, iid, muon))


def test_muon_islands_and_muon_sync_dp_step_their_matrices_with_muon_and_learn():
    # one island, outer lr 1 and no momentum: Muon DiLoCo is Muon sync DP of one, as AdamW's is AdamW's
    dp = train(tiny("syncdp", optimizer="muon"))
    diloco = train(tiny("diloco", inner_steps=3, optimizer="muon"))
    assert diloco["final_loss"] == pytest.approx(dp["final_loss"], abs=1e-4)
    assert dp["final_loss"] < dp["curve"][0][1] and dp["final_loss"] != train(tiny("syncdp"))["final_loss"]
    with pytest.raises(ValueError, match="optimizer"):
        Run("syncdp", 1e-3, optimizer="sgd")


def test_wire_bytes_per_token_and_the_ratio_to_fp32_sync_dp():
    params, seq_len = 1000, 128
    dp = Run("syncdp", 1e-3, peers=4, batch_size=2)
    assert dp.wire_bytes_per_token(params, seq_len) == pytest.approx(2 * 3 / 4 * params * 4 / (2 * 128))
    int8 = Run("diloco", 1e-3, inner_steps=120, compression="int8", peers=4, batch_size=2)
    per_value = make_codec("int8").bytes_per_value()
    assert int8.wire_bytes_per_token(params, seq_len) == pytest.approx(2 * 3 / 4 * params * per_value / (120 * 2 * 128))
    assert int8.fewer_bytes_than_syncdp == pytest.approx(dp.wire_bytes_per_token(params, seq_len)
                                                          / int8.wire_bytes_per_token(params, seq_len))
    assert int8.fewer_bytes_than_syncdp > 400 and Run("diloco", 1e-3, inner_steps=160, compression="int4").fewer_bytes_than_syncdp > 1000


def test_every_h_of_the_study_divides_its_budget_and_bad_runs_are_refused():
    for h, codec in ((10, "int8"), (40, "int8"), (120, "int8"), (160, "int4")):
        assert STEPS // h >= 30 and Run("diloco", 1e-3, inner_steps=h, compression=codec).key
    with pytest.raises(ValueError, match="does not divide"):
        Run("diloco", 1e-3, inner_steps=7, steps=100)
    with pytest.raises(ValueError, match="method"):
        Run("adam", 1e-3)


def _result(method, lr, loss, seed=0, h=1, codec="none", outer=(1.0, 0.0), **fields):
    run = Run(method, lr, seed=seed, inner_steps=h, compression=codec, outer_lr=outer[0], outer_momentum=outer[1], **fields)
    return dict(asdict(run), key=run.key, final_loss=loss, seconds=1.0, outer_steps=STEPS // h if method == "diloco" else 0,
                tokens=run.steps * run.peers * run.batch_size * 128,
                wire_bytes_per_token=run.wire_bytes_per_token(842_496, 128), fewer_bytes_than_syncdp=run.fewer_bytes_than_syncdp)


def test_the_plan_builds_on_the_best_sync_dp_lr_and_the_best_outer_settings(tmp_path):
    assert plan("outer-grid", []) == []  # nothing to build on before sync DP is tuned
    results = [_result("syncdp", 1e-3, 2.10), _result("syncdp", 2e-3, 2.00), _result("syncdp", 4e-3, 2.05)]
    grid = plan("outer-grid", results)
    assert grid and {r.inner_lr for r in grid} == {2e-3} and all(r.method == "diloco" for r in grid)
    results += [_result("diloco", 2e-3, 2.3, h=10, codec="int8", outer=(0.7, 0.9)),
                _result("diloco", 2e-3, 2.1, h=10, codec="int8", outer=(1.0, 0.0))]
    # DiLoCo's own inner lr is tried below sync DP's with each point's best outer optimizer
    assert {(r.inner_lr, r.inner_steps, r.outer_lr) for r in plan("inner-lr", results)} == {(1e-3, 10, 1.0), (4e-3, 10, 1.0)}
    assert {(r.method, r.inner_steps, r.seed) for r in plan("seeds", results)} == {
        ("syncdp", 1, 1), ("syncdp", 1, 2), ("diloco", 10, 1), ("diloco", 10, 2)}  # no target point yet: the curve's
    results += [_result("diloco", 2e-3, 2.2, h=120, codec="int8", outer=(0.35, 0.9)),
                _result("diloco", 2e-3, 2.3, h=120, codec="int8", outer=(0.7, 0.9))]
    assert (1e-3, 120, 0.35) in {(r.inner_lr, r.inner_steps, r.outer_lr) for r in plan("inner-lr", results)}
    h120 = [r for r in plan("seeds", results) if r.method == "diloco"]
    assert {(r.seed, r.inner_steps, r.inner_lr, r.outer_lr) for r in h120[:2]} == {(1, 120, 2e-3, 0.35), (2, 120, 2e-3, 0.35)}
    assert {(r.seed, r.inner_steps, r.outer_lr) for r in h120[2:]} == {(1, 10, 1.0), (2, 10, 1.0)}  # the targets first
    # a lower inner lr that won is what the seeds, the schedule and the checks build on
    results.append(_result("diloco", 1e-3, 2.15, h=120, codec="int8", outer=(0.35, 0.9)))
    h120 = [r for r in plan("seeds", results) if r.method == "diloco" and r.inner_steps == 120]
    assert {(r.seed, r.inner_lr) for r in h120} == {(1, 1e-3), (2, 1e-3)}
    assert {(r.schedule, r.inner_steps, r.inner_lr, r.outer_lr) for r in plan("schedule", results)} == {
        ("grow", 10, 2e-3, 1.0), ("grow", 120, 1e-3, 0.35)}
    checks = plan("checks", results)
    assert {r.peers for r in checks} == {1} and {r.inner_lr for r in checks} == {1e-3}
    # the runner-up outer optimizer at sync DP's lr is tried again at the target point's own best inner lr
    assert [(r.inner_steps, r.inner_lr, r.outer_lr) for r in plan("outer-retune", results)] == [(120, 1e-3, 0.7)]
    # the inner lr grid grows past its edge while the best is there, and stops once it is inside
    lrs = lambda: {r.inner_lr for r in plan("inner-lr", results) if r.inner_steps == 120}  # noqa: E731
    assert lrs() == {1e-3, 4e-3}  # the first grid is not done yet: no edge
    results.append(_result("diloco", 4e-3, 2.4, h=120, codec="int8", outer=(0.35, 0.9)))
    assert lrs() == {1e-3, 4e-3, 5e-4}
    results.append(_result("diloco", 5e-4, 2.16, h=120, codec="int8", outer=(0.35, 0.9)))
    assert lrs() == {1e-3, 4e-3}
    results[-1]["final_loss"] = 2.14  # 5e-4 best: 2.5e-4 is sync DP's lr / 8, the last one tried
    assert lrs() == {1e-3, 4e-3, 2.5e-4}
    results.append(_result("diloco", 2.5e-4, 2.13, h=120, codec="int8", outer=(0.35, 0.9)))
    assert lrs() == {1e-3, 4e-3}
    assert {(r.method, r.outer_lr) for r in checks} == {("syncdp", 1.0), ("diloco", 0.35), ("diloco", 1.0)}
    # the codecs: sparse top-k at SPARSE_H on the smallest H's best settings, with and without the reducer's feedback;
    # the reducer's feedback at the int4 point
    codecs = plan("codecs", results)
    assert {(r.inner_steps, r.compression, r.reducer_feedback, r.inner_lr, r.outer_lr) for r in codecs} == {
        (h, "topk", f, 2e-3, 1.0) for h in SPARSE_H for f in (False, True)}  # H = 10's best is plain averaging here
    assert len(codecs) == 2 * len(SPARSE_H)
    results.append(_result("diloco", 2e-3, 2.3, h=160, codec="int4", outer=(0.8, 0.6)))
    assert (160, "int4", True, 0.8) in {(r.inner_steps, r.compression, r.reducer_feedback, r.outer_lr) for r in plan("codecs", results)}
    results.append(_result("diloco", 2e-3, 1.0, h=160, codec="int4", outer=(0.8, 0.6), reducer_feedback=True))
    assert all(not r.reducer_feedback for r in plan("seeds", results))  # a reducer-feedback run is never a point's best
    # the iid runs: sync DP and the >= 400x points with every island on the whole corpus, kept out of the main table
    iid = plan("iid", results)
    assert (iid[0].method, iid[0].data, iid[0].inner_lr) == ("syncdp", "iid", 2e-3)
    # then the first target (H = 120, its best inner lr 2.5e-4) again at smaller inner lrs: iid at each factor, on the
    # shards at the first (the islands' agreement measured on both)
    again = {(r.data, r.inner_lr) for r in iid if r.inner_steps == 120 and r.inner_lr < 2.5e-4}
    assert again == {("iid", 2.5e-4 * f) for f in IID_INNER_LR_FACTORS} | {("shards", 2.5e-4 * IID_INNER_LR_FACTORS[0])}
    assert {(r.inner_steps, r.inner_lr) for r in iid if r.method == "diloco" and r.inner_lr >= 2.5e-4} == {(120, 2.5e-4), (160, 2e-3)}
    assert all(r.key.endswith("data=iid") for r in iid if r.data == "iid") and len(iid) == 1 + 2 + len(IID_INNER_LR_FACTORS) + 1
    results += [_result("syncdp", 2e-3, 1.9, data="iid"), _result("diloco", 1e-3, 1.995, h=120, codec="int8", outer=(0.35, 0.9), data="iid")]
    summary = summarize(results)
    assert summary["iid"][0]["gap"] == pytest.approx(0.05) and summary["syncdp"]["loss_mean"] == 2.0
    # a shards run beside the iid ones, where the islands' agreement was measured at the same outer optimizer: its gap
    # to the shards' sync DP, and the agreement in the report
    shards = dict(_result("diloco", 5e-4, 2.2, h=120, codec="int8", outer=(0.35, 0.9)), island_agreement_first_quarter=0.41,
                  island_agreement_last_quarter=0.33)
    unmeasured = _result("diloco", 4e-4, 2.3, h=120, codec="int8", outer=(0.35, 0.9))
    iid_rows = summarize([*results, shards, unmeasured])["iid"]
    assert [(r["data"], r["inner_lr"]) for r in iid_rows] == [("iid", 1e-3), ("shards", 5e-4)]
    assert iid_rows[1]["gap"] == pytest.approx(0.1) and iid_rows[1]["syncdp_loss"] == 2.0
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*results, shards, unmeasured]))
    assert "| shards | 2.0000 | 2.2000 | **+10.0%** | 0.410 / 0.330 |" in report(tmp_path)
    with pytest.raises(ValueError, match="data"):
        Run("syncdp", 1e-3, data="mixed")
    with pytest.raises(ValueError, match="unknown phase"):
        plan("everything", results)


def test_a_growing_schedule_has_as_many_rounds_and_spends_them_early():
    fixed, grow = Run("diloco", 1e-3, inner_steps=160), Run("diloco", 1e-3, inner_steps=160, schedule="grow")
    assert fixed.round_ends() == list(range(160, STEPS + 1, 160))
    ends = grow.round_ends()
    lengths = [b - a for a, b in zip([0, *ends], ends)]
    assert len(ends) == len(fixed.round_ends()) and ends[-1] == STEPS and all(n > 0 for n in lengths)
    assert 75 <= lengths[0] <= 90 and 230 <= lengths[-1] <= 240 and lengths == sorted(lengths)
    assert "grow" in grow.key and "grow" not in fixed.key
    # and it trains: a tiny growing run ends at its budget
    assert train(tiny("diloco", inner_steps=2, steps=8, schedule="grow"))["tokens"] == 8 * 2 * 128


def test_the_gap_is_taken_seed_by_seed_and_the_report_is_written(tmp_path):
    results = [_result("syncdp", 2e-3, 2.0), _result("syncdp", 2e-3, 2.2, seed=1), _result("syncdp", 1e-3, 2.5),
               _result("diloco", 2e-3, 2.02, h=120, codec="int8"), _result("diloco", 2e-3, 2.2, seed=1, h=120, codec="int8")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    summary = summarize(load(tmp_path))
    assert summary["syncdp"]["inner_lr"] == 2e-3 and summary["syncdp"]["seeds"] == 2
    [point] = summary["points"]
    assert point["seeds"] == 2 and point["gap_mean"] == pytest.approx((0.01 + 0.0) / 2)
    assert point["gap_max"] == pytest.approx(0.01) and point["gap_min"] == pytest.approx(0.0, abs=1e-12)
    table = report(tmp_path)
    assert "| 120 | int8 | plain averaging (lr 1, momentum 0) | 40 |" in table and "**+0.5%**" in table
    assert (tmp_path / "study.md").read_text() == table and (tmp_path / "study.png").stat().st_size > 1000


def test_the_larger_islands_retune_sync_dp_at_their_size_then_compare_at_it(tmp_path):
    island = dict(batch_size=ISLAND_BATCH)
    results = [_result("syncdp", 4e-3, 1.3), _result("syncdp", 4e-3, 1.5, steps=ISLAND_STEPS[0], **island)]
    assert plan("islands", results) == []  # sync DP's grid at this size is not done
    results += [_result("syncdp", lr, loss, steps=ISLAND_STEPS[0], **island) for lr, loss in ((8e-3, 1.6), (16e-3, 1.7))]
    # its best is at the grid's low edge: one more below it, and still nothing for DiLoCo
    assert [r.inner_lr for r in plan("islands-syncdp", results)][-1] == 2e-3 and plan("islands", results) == []
    results.append(_result("syncdp", 2e-3, 1.55, steps=ISLAND_STEPS[0], **island))
    longer = [r for r in plan("islands-syncdp", results) if r.steps != ISLAND_STEPS[0]]
    assert [(r.inner_lr, r.steps, r.batch_size) for r in longer] == [(4e-3, ISLAND_STEPS[1], ISLAND_BATCH)]
    runs = plan("islands", results)
    assert {r.batch_size for r in runs} == {ISLAND_BATCH} and all(r.steps // r.inner_steps >= 30 for r in runs)
    assert {r.inner_lr for r in runs if r.steps == ISLAND_STEPS[0]} == {2e-3, 4e-3}  # 1/2 and 1x sync DP's at the size
    assert runs[0].steps == ISLAND_STEPS[1]  # the longest first
    results += [_result("diloco", 2e-3, 1.53, h=40, codec="int8", outer=(0.7, 0.9), steps=ISLAND_STEPS[0], **island),
                _result("diloco", 2e-3, 9.0, h=40, codec="int8", outer=(0.7, 0.9), seed=1, steps=ISLAND_STEPS[0], **island)]
    [row] = summarize(results)["islands"]  # the seed without its sync DP is left out
    assert row["gap"] == pytest.approx(0.02) and row["syncdp_lr"] == 4e-3 and row["syncdp_loss"] == 1.5
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    assert "| 1.5000 (0.004) | 1.5300 | **+2.0%** |" in report(tmp_path)
    assert summarize(results)["points"] == []  # the standard table keeps to the standard size


def test_the_model_sizes_compare_each_width_to_the_best_sync_dp_at_that_width(tmp_path):
    runs = plan("sizes", [])
    assert {r.d_model for r in runs} == {d for d, _ in SIZE_POINTS} and runs[0].d_model == SIZE_POINTS[0][0]
    h, codec, o, m = SIZE_DILOCO
    for d, lrs in SIZE_POINTS:  # DiLoCo's inner lr at 1/2 of each sync DP lr of the width's grid, at the 473x point
        assert {r.inner_lr for r in runs if r.d_model == d and r.method == "syncdp"} == set(lrs)
        assert {(r.inner_lr, r.inner_steps, r.compression, r.outer_lr, r.outer_momentum)
                for r in runs if r.d_model == d and r.method == "diloco"} == {(lr / 2, h, codec, o, m) for lr in lrs}
    assert "d=256" in Run("syncdp", 2e-3, d_model=256).key and Run("syncdp", 2e-3).key == "syncdp lr=0.002 seed=0"
    outer = (o, m)
    results = [_result("syncdp", 4e-3, 1.30), _result("diloco", 2e-3, 1.56, h=h, codec=codec, outer=outer),
               _result("diloco", 2e-3, 1.20, h=h, codec=codec, outer=(1.0, 0.0)),  # another outer optimizer: not this row
               _result("syncdp", 2e-3, 1.25, d_model=256), _result("syncdp", 4e-3, 1.20, d_model=256),
               _result("diloco", 1e-3, 1.32, h=h, codec=codec, outer=outer, d_model=256),
               _result("diloco", 2e-3, 1.26, h=h, codec=codec, outer=outer, d_model=256)]
    summary = summarize(results)
    assert [(r["d_model"], r["syncdp_lr"], r["inner_lr"]) for r in summary["sizes"]] == [(128, 4e-3, 2e-3), (256, 4e-3, 2e-3)]
    assert [round(r["gap"], 4) for r in summary["sizes"]] == [0.2, 0.05]
    assert summary["sizes"][1]["params"] > 3 * summary["sizes"][0]["params"]
    assert len(summary["points"]) == 2 and summary["syncdp"]["grid"] == {4e-3: 1.30}  # the other widths stay out
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    assert "| 256 | 3.26M | 0 | 1.2000 (0.004) | 1.2600 (0.002) | **+5.0%** |" in report(tmp_path)
    # a width whose grid is done runs its best sync DP lr and DiLoCo inner lr again at more seeds; another's does not
    grid = [r for r in runs if r.d_model == 256]
    done = [_result(r.method, r.inner_lr, 1.2 + (r.inner_lr != {"syncdp": 4e-3, "diloco": 1e-3}[r.method]),
                    h=r.inner_steps, codec=r.compression, outer=(r.outer_lr, r.outer_momentum), d_model=256) for r in grid]
    more = [r for r in plan("sizes", done) if r.seed != 0]
    assert {(r.method, r.inner_lr, r.d_model, r.seed) for r in more} == {
        (method, lr, 256, s) for method, lr in (("syncdp", 4e-3), ("diloco", 1e-3)) for s in SIZE_SEEDS}
    assert all(r.seed == 0 for r in plan("sizes", done[:-1]))


def test_the_low_bit_codecs_run_at_the_targets_bytes_then_their_best_at_more_seeds(tmp_path):
    assert plan("low-bit", []) == []  # the inner lr is half of sync DP's best: nothing to build on yet
    results = [_result("syncdp", 2e-3, 2.05), _result("syncdp", 4e-3, 2.0)]
    runs = plan("low-bit", results)
    assert len(runs) == sum(len(grid) for _, _, grid in LOW_BIT_POINTS) and all(r.seed == 0 for r in runs)
    assert {r.inner_lr for r in runs} == {2e-3} and all(r.reducer_feedback for r in runs)  # the peer's default
    assert {r.compression for r in runs} == {"int2", "int4"} and min(r.fewer_bytes_than_syncdp for r in runs) >= 400
    assert {r.inner_steps: round(r.fewer_bytes_than_syncdp) for r in runs if r.compression == "int2"} == {32: 410, 80: 1024}
    # once all are done: each codec's best at >= 400x (below 1000x) and at >= 1000x, each at seeds 1 and 2
    losses = {32: 2.2, 80: 2.5, 60: 2.4, 150: 2.45}
    done = results + [_result("diloco", r.inner_lr, losses[r.inner_steps], h=r.inner_steps, codec=r.compression,
                              outer=(r.outer_lr, r.outer_momentum), reducer_feedback=True) for r in runs]
    more = plan("low-bit", done)[len(runs) :]
    assert {(r.inner_steps, r.compression, r.outer_lr, r.seed) for r in more} == {
        (h, codec, outer, seed) for h, codec, outer in ((32, "int2", 0.7), (60, "int4", 0.7), (80, "int2", 0.8), (150, "int4", 0.8))
        for seed in (1, 2)}
    assert len(plan("low-bit", done[:-1])) == len(runs)  # the grid not done: no seeds yet
    done.append(_result("diloco", 2e-3, 2.1, h=32, codec="int2", outer=(0.35, 0.9), reducer_feedback=True))  # a one-off
    # int2's own curve in the picture: the best outer optimizer at each H
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    table = report(tmp_path)
    assert "| 32 | int2 | Nesterov lr 0.35, momentum 0.9, reducer's error feedback, inner lr 0.002 | 150 |" in table
    [int2] = [points for name, points in curves(summarize(done)).items() if name.startswith("int2")]
    assert [(p["inner_steps"], p["outer_lr"]) for p in int2] == [(80, 0.8), (32, 0.35)]  # by bytes per token, the best


def test_a_curve_compares_the_settings_at_one_h_at_seed_0_not_a_mean_of_3_seeds_with_one():
    results = [_result("syncdp", 4e-3, 2.0, seed=s) for s in SEEDS]
    results += [_result("diloco", 2e-3, loss, seed=s, h=32, codec="int2", outer=(0.7, 0.9), reducer_feedback=True)
                for s, loss in zip(SEEDS, (2.1, 2.5, 2.5))]  # +5% at seed 0, +18% over 3 seeds
    results.append(_result("diloco", 2e-3, 2.2, h=32, codec="int2", outer=(0.8, 0.6), reducer_feedback=True))  # +10%
    [int2] = [points for name, points in curves(summarize(results)).items() if name.startswith("int2")]
    assert [(p["outer_momentum"], p["seeds"]) for p in int2] == [(0.9, 3)]
    assert int2[0]["gap_seed0"] == pytest.approx(0.05) and int2[0]["gap_mean"] == pytest.approx(0.55 / 3)


def test_the_outer_warmup_runs_the_410x_points_of_both_inner_optimizers_with_a_warmup_and_reports_it(tmp_path):
    assert plan("outer-warmup", []) == []
    results = [_result("syncdp", 2e-3, 2.05), _result("syncdp", 4e-3, 2.0)]
    runs = plan("outer-warmup", results)
    assert {(r.optimizer, r.inner_steps, r.compression, r.inner_lr, r.outer_warmup) for r in runs} == {
        (opt, h, c, 4e-3 * f, w) for opt, h, c, _, _, f, warmups in OUTER_WARMUP_POINTS for w in warmups}
    assert all(r.outer_warmup > 0 and r.reducer_feedback and r.seed == 0 for r in runs)
    done = results + [_result("diloco", 2e-3, 2.2 - 0.1 * (w > 0), h=32, codec="int2", outer=(0.8, 0.6),
                              reducer_feedback=True, outer_warmup=w) for w in (0, 10)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    points = summarize(load(tmp_path))["points"]
    assert sorted(p["outer_warmup"] for p in points) == [0, 10]  # its own point, beside the one without
    assert "outer lr warm-up over 10 rounds" in report(tmp_path)
    assert [r for r in plan("outer-warmup", done) if r.key not in {d["key"] for d in done}] == runs[1:]  # done once


def test_the_floor_averages_every_step_in_fp32_grows_its_lr_grids_at_their_edge_then_seeds_its_best():
    assert plan("floor", []) == []
    dp = [_result("syncdp", 2e-3, 2.05), _result("syncdp", 4e-3, 2.0)]
    runs = plan("floor", dp)
    o, m, f = FLOOR_NESTEROV
    assert [(r.optimizer, r.inner_lr, r.outer_lr) for r in runs] == [
        *((opt, 4e-3 * f, 1.0) for opt, factors in FLOOR_POINTS for f in factors), ("adamw", 4e-3 * f, o)]
    assert all((r.inner_steps, r.compression, r.seed, r.batch_size) == (1, "none", 0, 2) for r in runs)
    assert {r.fewer_bytes_than_syncdp for r in runs} == {1.0}  # fp32 every step: sync DP's bytes
    # larger islands too, once sync DP at their global batch is tuned: at its best lr's multiples, the same tokens
    islands_dp = [_result("syncdp", lr, loss, batch_size=ISLAND_BATCH, steps=ISLAND_STEPS[0])
                  for lr, loss in ((4e-3, 2.1), (8e-3, 2.0), (16e-3, 2.2))]
    larger = [r for r in plan("floor", dp + islands_dp) if r.batch_size == ISLAND_BATCH]
    assert [(r.inner_lr, r.steps, r.inner_steps, r.compression) for r in larger] == [
        (8e-3 * f, ISLAND_STEPS[0], 1, "none") for f in FLOOR_ISLAND_FACTORS]
    # AdamW's best at the top of its grid: one more doubling; Muon's at the bottom of its: one halving
    done = dp + [_result("diloco", 2e-3, 2.2), _result("diloco", 4e-3, 2.1), _result("diloco", 2e-3, 2.15, outer=(o, m)),
                 _result("diloco", 4e-3, 2.0, optimizer="muon"), _result("diloco", 8e-3, 2.1, optimizer="muon")]
    keys = {r["key"] for r in done}
    assert [(r.optimizer, r.inner_lr) for r in plan("floor", done) if r.key not in keys] == [("adamw", 8e-3), ("muon", 2e-3)]
    # once AdamW's grid brackets its best, that one at the other seeds
    done.append(_result("diloco", 8e-3, 2.12))
    seeds = [r for r in plan("floor", done) if r.key not in keys | {done[-1]["key"]}]
    assert [(r.optimizer, r.inner_lr, r.seed, r.inner_steps) for r in seeds] == [
        ("muon", 2e-3, 0, 1), *(("adamw", 4e-3, s, 1) for s in SEEDS[1:]), *(("adamw", 4e-3, 0, h) for h, _ in FLOOR_CARRIED)]
    assert all(r.outer_lr == 1.0 and r.outer_momentum == 0.0 for r in seeds)
    # the larger islands' grid, once it brackets its best: that one at the other seeds, and sync DP at theirs
    done += islands_dp + [_result("diloco", lr, loss, batch_size=ISLAND_BATCH, steps=ISLAND_STEPS[0])
                          for lr, loss in ((4e-3, 2.2), (8e-3, 2.05), (16e-3, 2.3))]
    larger = [(r.method, r.inner_lr, r.seed) for r in plan("floor", done) if r.batch_size == ISLAND_BATCH and r.seed]
    assert larger == [*(("diloco", 8e-3, s) for s in SEEDS[1:]), *(("syncdp", 8e-3, s) for s in SEEDS[1:])]
    # the islands' optimizers step on their own batches: the mean of two AdamW steps is not one of the mean gradient
    sync = train(tiny("syncdp", peers=2))
    floor = train(tiny("diloco", peers=2, inner_steps=1))
    assert floor["outer_steps"] == 6 and floor["tokens"] == sync["tokens"]
    assert abs(floor["final_loss"] - sync["final_loss"]) > 1e-4


def test_the_floor_at_each_length_tunes_its_own_sync_dp_then_diloco_at_h_1_from_its_best_then_seeds_both(tmp_path):
    # every length's sync DP grid at once: one length's grids do not wait for another's
    assert [(r.method, r.inner_lr, r.steps) for r in plan("floor-length", [])] == [
        ("syncdp", lr, steps) for steps in FLOOR_LENGTHS for lr in FLOOR_LENGTH_DP_LRS]
    assert STEPS not in FLOOR_LENGTHS  # STEPS is phase floor's

    def todo(done, steps):
        keys = {r["key"] for r in done}
        return [r for r in plan("floor-length", done) if r.key not in keys and r.steps == steps]

    for steps in FLOOR_LENGTHS:
        short = dict(steps=steps)
        # sync DP's best at the top of its grid: one doubling, nothing of DiLoCo's yet
        done = [_result("syncdp", lr, 2.3 - 10 * lr, **short) for lr in FLOOR_LENGTH_DP_LRS]
        done.append(_result("diloco", 4e-3, 2.0))  # the standard floor's run: not this phase's
        assert [(r.method, r.inner_lr) for r in todo(done, steps)] == [("syncdp", 16e-3)]
        done.append(_result("syncdp", 16e-3, 2.3, **short))  # bracketed at 8e-3: DiLoCo at its multiples
        assert [(r.method, r.inner_lr, r.inner_steps, r.compression, r.outer_lr, r.outer_momentum, r.steps)
                for r in todo(done, steps)] == [("diloco", 8e-3 * f, 1, "none", 1.0, 0.0, steps) for f in FLOOR_LENGTH_FACTORS]
        done += [_result("diloco", 8e-3, 2.25, **short), _result("diloco", 16e-3, 2.3, **short)]
        assert [(r.method, r.inner_lr) for r in todo(done, steps)] == [("diloco", 4e-3)]  # its best at the bottom edge: halved
        done.append(_result("diloco", 4e-3, 2.28, **short))
        seeds = [(r.method, r.inner_lr, r.seed) for r in todo(done, steps)]
        assert seeds == [(method, 8e-3, s) for s in SEEDS[1:] for method in ("syncdp", "diloco")]  # pair by pair
        # the other lengths still plan their own sync DP grids from the start
        assert [(r.method, r.steps) for r in plan("floor-length", done) if r.steps != steps and r.key not in {d["key"] for d in done}] == [
            ("syncdp", other) for other in FLOOR_LENGTHS if other != steps for _ in FLOOR_LENGTH_DP_LRS]
    short = dict(steps=FLOOR_LENGTHS[0])
    done = [_result("syncdp", lr, 2.3 - 10 * lr, **short) for lr in (*FLOOR_LENGTH_DP_LRS, 16e-3)]
    done[-1] = _result("syncdp", 16e-3, 2.3, **short)
    done += [_result("diloco", 8e-3, 2.25, **short), _result("diloco", 16e-3, 2.3, **short), _result("diloco", 4e-3, 2.28, **short)]
    done += [_result("syncdp", 4e-3, 2.0), _result("syncdp", 8e-3, 2.2, seed=1, **short), _result("diloco", 8e-3, 2.31, seed=1, **short)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    table = report(tmp_path)
    # each DiLoCo run against sync DP's best lr at its own seed: 2.25 / 2.22 at seed 0, 2.31 / 2.2 at seed 1
    assert f"The floor over {FLOOR_LENGTHS[0]} steps" in table
    assert "| 0.008 | 1 | 0 | 2.2500 | **+1.4%** |" in table and "| 0.008 | 1 | 1 | 2.3100 | **+5.0%** |" in table
    assert "| 0.004 | 0.5 | 0 | 2.2800 | **+2.7%** |" in table and "| 0.004 | 0.5 | 1 |" not in table
    assert all(f"The floor over {steps} steps" not in table for steps in FLOOR_LENGTHS[1:])


def test_the_floor_probe_leaves_the_run_as_it_was_and_finds_the_mean_of_adamw_steps_off_sync_dps(monkeypatch):
    run = tiny("diloco", peers=2, steps=8)  # H = 1, fp32, plain averaging: the floor
    probed = train(run, shadow_lr=run.inner_lr)
    assert probed["final_loss"] == train(run)["final_loss"] and probed["shadow_lr"] == run.inner_lr
    quarters = probed["floor_probe"]["quarters"]
    assert len(quarters) == 4
    # two AdamW islands on their own batches: the mean of their steps is shorter than sync DP's and points elsewhere,
    # and each island divides by a larger sqrt(v) than sync DP does on the mean gradient
    assert all(q["length"] < 0.95 and q["cosine"] < 0.995 and q["across"] > 0.05 and q["divisor"] > 1.0 for q in quarters)
    # the control: an optimizer linear in the gradient (SGD, no clipping) makes the mean of the islands' steps sync DP's
    monkeypatch.setattr("experiments.learning_runs.build_inner_optimizer",
                        lambda kind, model, lr, wd: torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd))
    linear = train(replace(run, clip=0.0), shadow_lr=run.inner_lr)["floor_probe"]["quarters"]
    assert all(q["length"] == pytest.approx(1.0, abs=1e-3) and q["cosine"] > 0.9999 and q["across"] < 0.01
               and q["divisor"] is None and q["island_clipped"] == 0.0 for q in linear)
    with pytest.raises(ValueError, match="H = 1"):
        train(tiny("diloco", peers=2, inner_steps=2), shadow_lr=1e-3)
    with pytest.raises(ValueError, match="DiLoCo"):
        train(tiny("syncdp"), shadow_lr=1e-3)


def test_the_probe_runs_the_tuned_floor_runs_once_each_and_reports_them(tmp_path, monkeypatch, capsys):
    dp = [_result("syncdp", lr, loss) for lr, loss in ((2e-3, 2.05), (4e-3, 2.0), (8e-3, 2.1))]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dp))
    runs = probe_runs(load(tmp_path))  # only AdamW's sync DP at 2 sequences is tuned
    assert [(r.optimizer, r.batch_size, r.inner_lr, lr) for r, lr in runs] == [
        ("adamw", 2, 4e-3 * f, 4e-3) for opt, batch, f in FLOOR_PROBES if (opt, batch) == ("adamw", 2)]
    assert all((r.inner_steps, r.compression, r.outer_lr, r.outer_momentum, r.seed) == (1, "none", 1.0, 0.0, 0) for r, _ in runs)
    # the unclipped floor and the shorter floor, against the sync DP of their own clip and length, once it is bracketed
    clip0 = [_result("syncdp", lr, loss, clip=0.0) for lr, loss in ((1e-3, 2.2), (2e-3, 2.1))]
    short = [_result("syncdp", lr, loss, steps=FLOOR_LENGTHS[0]) for lr, loss in ((4e-3, 2.4), (8e-3, 2.3), (16e-3, 2.5))]
    more = [(r.steps, r.clip, r.inner_lr, lr) for r, lr in probe_runs(load(tmp_path) + clip0 + short)[len(runs):]]
    # the unclipped grid's best at its edge (2e-3): not yet
    assert more == [(steps, clip, 8e-3 * f, 8e-3) for steps, clip, f in FLOOR_MORE_PROBES if clip]
    clip0.append(_result("syncdp", 4e-3, 2.15, clip=0.0))
    more = [(r.steps, r.clip, r.inner_lr, lr) for r, lr in probe_runs(load(tmp_path) + clip0 + short)[len(runs):]]
    assert more == [(steps, clip, (8e-3 if clip else 2e-3) * f, 8e-3 if clip else 2e-3) for steps, clip, f in FLOOR_MORE_PROBES]
    assert any(clip == 0 and steps == STEPS for steps, clip, _ in FLOOR_MORE_PROBES)
    ran = []

    def fake_train(run, shadow_lr):
        ran.append(run.key)
        quarter = dict(length=0.5, along=0.4, across=0.3, cosine=0.8, island_length=1.1, island_clipped=0.25,
                       shadow_clipped=0.0, divisor=1.7)
        return dict(asdict(run), key=run.key, final_loss=2.01, shadow_lr=shadow_lr, seconds=1.0,
                    floor_probe=dict(quarters=[quarter] * 4))

    monkeypatch.setattr("experiments.learning.train", fake_train)
    monkeypatch.setattr("experiments.learning.ProcessPoolExecutor", _InlinePool)
    run_probes(tmp_path, jobs=1)
    run_probes(tmp_path, jobs=1)  # done: nothing again
    assert ran == [r.key for r, _ in runs] and "probe: done" in capsys.readouterr().out
    table = report(tmp_path)
    assert "| AdamW, 2 sequences, inner lr 0.008 (2× sync DP's) | 1 | 0.500 | 0.400 | 0.300 | 0.800 | 1.100 | 0.25 / 0.00 | 1.700 |" in table
    assert main(["probe", "--out", str(tmp_path), "--jobs", "0"]) == 2
    assert capsys.readouterr().err == "learning_study.py: error: --jobs must be >= 1, got 0\n"


def test_muon_runs_its_points_and_its_own_sync_dp_grid_then_more_seeds_and_gaps_to_both_baselines(tmp_path):
    assert plan("muon", []) == []  # DiLoCo's inner lr is half of AdamW sync DP's best: nothing to build on yet
    adamw = [_result("syncdp", 2e-3, 2.05), _result("syncdp", 4e-3, 2.0), _result("syncdp", 4e-3, 2.02, seed=1)]
    runs = plan("muon", adamw)
    diloco = [r for r in runs if r.method == "diloco"]
    assert all(r.optimizer == "muon" and r.seed == 0 for r in runs) and runs[: len(diloco)] == diloco  # the longer first
    assert {(r.inner_steps, r.compression, r.outer_lr, r.outer_momentum, r.inner_lr, r.reducer_feedback)
            for r in diloco} == {(h, c, o, m, 2e-3, True) for h, c, grid in MUON_POINTS for o, m in grid} | {
        (h, c, o, m, 4e-3 * f, True) for h, c, o, m, factors in MUON_INNER_LRS for f in factors} | {
        (h, c, o, m, 4e-3 * f, True) for h, c, f, grid in MUON_OUTER_GRID for o, m in grid}
    assert len(diloco) == sum(len(grid) for *_, grid in MUON_POINTS + MUON_OUTER_GRID) + sum(
        len(f) for *_, f in MUON_INNER_LRS)
    assert sorted(r.inner_lr for r in runs if r.method == "syncdp") == sorted(MUON_DP_LRS)
    assert {round(r.fewer_bytes_than_syncdp) for r in diloco} == {39, 410, 427, 1024}
    results = adamw + [_result("syncdp", r.inner_lr, 1.9 if r.inner_lr == MUON_DP_LRS[-1] else 2.1, optimizer="muon")
                       for r in runs if r.method == "syncdp"]
    # Muon sync DP's best at the grid's edge: the grid grows past it, and no seeds until it brackets its best
    grown = [r for r in plan("muon", results) if r.method == "syncdp"]
    assert {r.inner_lr for r in grown} == {*MUON_DP_LRS, 2 * MUON_DP_LRS[-1]} and all(r.seed == 0 for r in grown)
    results.append(_result("syncdp", 2 * MUON_DP_LRS[-1], 2.3, optimizer="muon"))
    # bracketed: Muon sync DP's best at more seeds, and the points again at 1/2 of it (the study's rule), first
    bracketed = plan("muon", results)
    assert {(r.method, r.inner_steps, r.inner_lr, r.seed) for r in bracketed if r.seed} == {
        ("syncdp", 1, MUON_DP_LRS[-1], s) for s in (1, 2)} | {  # and the seeded points off the targets' bytes
        ("diloco", h, 4e-3 * f, s) for h, *_, f in MUON_SEEDED for s in (1, 2)}
    own = [r for r in bracketed if r.method == "diloco" and r.inner_lr == MUON_DP_LRS[-1] / 2
           and (r.inner_steps, r.compression, (r.outer_lr, r.outer_momentum)) in {
               (h, c, om) for h, c, grid in MUON_POINTS for om in grid}]
    assert bracketed[: len(own)] == own and len(own) == sum(len(grid) for *_, grid in MUON_POINTS)
    # every point done at both inner lrs: each codec's best at >= 400x (below 1000x) and at >= 1000x, at seeds 1 and 2
    losses = {(32, 2e-3): 2.2, (60, 2e-3): 2.3, (80, 2e-3): 2.45, (32, 4e-3): 2.25, (60, 4e-3): 2.35, (80, 4e-3): 2.4,
              (10, 4e-3): 2.1, (32, 8e-3): 2.28, (32, 1e-3): 2.3}
    done = [_result("diloco", r.inner_lr, losses[r.inner_steps, r.inner_lr] + (r.outer_momentum == 0.6) * 0.01,
                    h=r.inner_steps, codec=r.compression,
                    outer=(r.outer_lr, r.outer_momentum), reducer_feedback=True, optimizer="muon") for r in own + diloco]
    seeded = {(h, 4e-3 * f, s) for h, *_, f in MUON_SEEDED for s in (1, 2)}
    assert {(r.inner_steps, r.inner_lr, r.seed) for r in plan("muon", results + done[1:])
            if r.method == "diloco" and r.seed} == seeded  # not all done: no seeds for the targets' bytes yet
    results += done
    assert {(r.inner_steps, r.inner_lr, r.seed) for r in plan("muon", results) if r.method == "diloco" and r.seed} == {
        (32, 2e-3, 1), (32, 2e-3, 2), (60, 2e-3, 1), (60, 2e-3, 2), (80, 4e-3, 1), (80, 4e-3, 2)} | seeded  # each codec's best
    # Muon runs stay out of the AdamW study's table; their gaps are to AdamW sync DP and to the better of the two
    results += [_result("syncdp", MUON_DP_LRS[-1], 2.1, seed=1, optimizer="muon"),
                _result("diloco", 2e-3, 2.323, seed=1, h=32, codec="int2", outer=(0.7, 0.9), reducer_feedback=True, optimizer="muon")]
    summary = summarize(results)
    assert summary["syncdp"]["grid"] == {2e-3: 2.05, 4e-3: 2.0} and summary["points"] == []
    [h32] = [p for p in summary["muon"]["points"] if (p["inner_steps"], p["inner_lr"], p["outer_momentum"]) == (32, 2e-3, 0.9)]
    assert h32["seeds"] == 2 and h32["gap_adamw_min"] == pytest.approx(0.1) and h32["gap_adamw_max"] == pytest.approx(0.15)
    assert h32["gap_min"] == pytest.approx(0.15) and h32["gap_max"] == pytest.approx(2.2 / 1.9 - 1)  # seed 0: Muon's 1.9
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in results))
    table = report(tmp_path)
    assert "| 32 | int2 | Muon islands, Nesterov lr 0.7, momentum 0.9, reducer's error feedback, inner lr 0.002 | 150 |" in table
    assert "its best (0.008) over 2 seed(s): 1.9000, 2.1000" in table
    assert "+12.5% (+10.0 … +15.0) | **+15.4% (+15.0 … +15.8)** |" in table
    [muon] = [points for name, points in curves(summarize(results)).items() if name.startswith("Muon")]
    assert [(p["inner_steps"], p["inner_lr"]) for p in muon] == [(80, 4e-3), (60, 2e-3), (32, 2e-3), (10, 4e-3)]


def test_a_run_already_in_the_results_is_not_run_again(tmp_path, monkeypatch):
    done = [_result("syncdp", lr, 2.0 + lr) for lr in (1e-3, 2e-3)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    ran = []

    def fake_train(run):
        ran.append(run.key)
        return _result(run.method, run.inner_lr, 2.5)

    monkeypatch.setattr("experiments.learning.train", fake_train)
    monkeypatch.setattr("experiments.learning.ProcessPoolExecutor", _InlinePool)
    run_study(tmp_path, ["tune-syncdp"], jobs=1)
    assert ran == ["syncdp lr=0.004 seed=0", "syncdp lr=0.008 seed=0"] and len(load(tmp_path)) == 4


def test_a_phase_waits_for_what_it_builds_on_and_siblings_run_side_by_side():
    assert next_runs(["outer-grid"], [], set()) == []  # sync DP not tuned
    tuned = [_result("syncdp", lr, 2.0 + lr) for lr in (1e-3, 2e-3, 4e-3)]
    first = next_runs(["tune-syncdp", "outer-grid"], tuned, set())
    assert [r.key for r in first] == ["syncdp lr=0.008 seed=0"]  # the grid waits for the last lr
    assert next_runs(["tune-syncdp", "outer-grid"], tuned, {"syncdp lr=0.008 seed=0"}) == []
    tuned.append(_result("syncdp", 8e-3, 3.0))
    grid = next_runs(["tune-syncdp", "outer-grid", "seeds"], tuned, set())
    assert grid and {r.method for r in grid} == {"diloco"} and {r.inner_lr for r in grid} == {1e-3}


class _InlinePool:
    """A stand-in for ProcessPoolExecutor that runs each job at once, in this process (no subprocesses here)."""

    def __init__(self, max_workers):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        future.set_result(fn(*args))
        return future


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["report", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("learning_study.py: error: no sync DP run") and err.count("\n") == 1
    (tmp_path / "results.jsonl").write_text("{not json\n")
    assert main(["report", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_clip_0_trains_unclipped_on_both_sides_and_keeps_the_run_out_of_the_study_s_curves():
    for method, extra in (("syncdp", {}), ("diloco", dict(peers=2, inner_steps=1))):
        unclipped, huge, clipped = (train(tiny(method, clip=c, **extra)) for c in (0.0, 1e9, CLIP))
        assert unclipped["final_loss"] == huge["final_loss"]  # a clip that never acts is no clip at all
        assert unclipped["final_loss"] != clipped["final_loss"]  # the default clips these steps
        assert unclipped["key"].endswith(" clip=0") and "clip" not in clipped["key"]
    assert not _standard(_result("syncdp", 4e-3, 1.0, clip=0.0)) and _standard(_result("syncdp", 4e-3, 1.0))
    with pytest.raises(ValueError, match="clip"):
        Run("syncdp", 1e-3, clip=-1.0)


def test_the_unclipped_floor_tunes_both_grids_then_seeds_its_best_and_carries_to_the_410x_point(tmp_path):
    assert plan("floor-clip", []) == []  # it builds on the clipped sync DP's best lr
    done = [_result("syncdp", lr, 2.0 + abs(lr - 4e-3)) for lr in (2e-3, 4e-3, 8e-3)]  # clipped: best 4e-3, 2.0
    keys = {r["key"] for r in done}
    first = [(r.method, r.inner_lr, r.inner_steps, r.clip) for r in plan("floor-clip", done) if r.key not in keys]
    (norm,) = FLOOR_CLIP_ISLAND_NORMS
    assert norm == 2 * CLIP  # sqrt(4 islands) x sync DP's clip
    assert first == [*(("diloco", 4e-3 * x, 1, 0.0) for x in FLOOR_CLIP_FACTORS),
                     *(("syncdp", 4e-3 * x, 1, 0.0) for x in FLOOR_CLIP_DP_FACTORS),
                     *(("diloco", 4e-3 * x, 1, norm) for x in FLOOR_CLIP_FACTORS)]
    # DiLoCo's best at its grid's top: doubled; unclipped sync DP bracketed at 4e-3 and worse than the clipped one
    done += [_result("diloco", 4e-3, 2.10, clip=0.0), _result("diloco", 8e-3, 2.05, clip=0.0)]
    done += [_result("syncdp", lr, 2.01 + abs(lr - 4e-3), clip=0.0) for lr in (2e-3, 4e-3, 8e-3)]
    keys = {r["key"] for r in done}
    assert [(r.method, r.inner_lr, r.clip) for r in plan("floor-clip", done) if r.key not in keys] == [
        ("diloco", 16e-3, 0.0), *(("diloco", 4e-3 * x, norm) for x in FLOOR_CLIP_FACTORS)]
    done.append(_result("diloco", 16e-3, 2.2, clip=0.0))
    keys = {r["key"] for r in done}
    # both bests at the other seeds: the unclipped pair is compared like for like, and each with the clipped sync DP;
    # then the 410x point with unclipped islands
    h, codec, o, m, f = FLOOR_CLIP_CARRIED[0]
    assert [(r.method, r.inner_lr, r.seed, r.inner_steps) for r in plan("floor-clip", done) if r.key not in keys and not r.clip] == [
        *(("diloco", 8e-3, s, 1) for s in SEEDS[1:]), *(("syncdp", 4e-3, s, 1) for s in SEEDS[1:]), ("diloco", 4e-3 * f, 0, h)]
    carried = [r for r in plan("floor-clip", done) if r.inner_steps == h][0]
    assert (carried.compression, carried.outer_lr, carried.outer_momentum, carried.reducer_feedback) == (codec, o, m, True)
    # the islands clipped at the higher norm: best at 4e-3, the grid's bottom, so halved; then bracketed: its seeds
    done += [_result("diloco", 4e-3, 2.04, clip=norm), _result("diloco", 8e-3, 2.06, clip=norm)]
    keys = {r["key"] for r in done}
    assert [(r.inner_lr, r.seed) for r in plan("floor-clip", done) if r.key not in keys and r.clip == norm] == [(2e-3, 0)]
    done.append(_result("diloco", 2e-3, 2.08, clip=norm))
    keys = {r["key"] for r in done}
    assert [(r.inner_lr, r.seed) for r in plan("floor-clip", done) if r.key not in keys and r.clip == norm] == [
        (4e-3, s) for s in SEEDS[1:]]
    done += [_result("diloco", 8e-3, 2.02, seed=1, clip=0.0), _result("syncdp", 4e-3, 2.1, seed=1),
             _result("diloco", 8e-3, 2.03)]  # the same floor run clipped, beside
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    table = report(tmp_path)
    # unclipped sync DP's best 2.01 at seed 0 (none at seed 1), the clipped one's 2.0 and 2.1
    assert "| H = 1, fp32, plain averaging, unclipped | 0.008 (2) | 0 | 2.0500 | 2.0300 | +2.0% | +2.5% | **+2.5%** |" in table
    assert "| H = 1, fp32, plain averaging, unclipped | 0.008 (2) | 1 | 2.0200 | – | – | -3.8% | **-3.8%** |" in table
    assert "| H = 1, fp32, plain averaging, islands clipped at 2 | 0.004 (1) | 0 | 2.0400 | – | – | +2.0% | **+2.0%** |" in table


def test_an_island_that_trains_while_its_average_is_on_the_wire_keeps_that_work_as_a_peer_does():
    # one island, outer lr 1, no momentum, no codec: the outer step sets global to the snapshot, and local <- global +
    # (local - snapshot) gives the island back the steps it took meanwhile; so it is still plain AdamW on the same
    # batches, whatever the overlap. Dropping those steps, or training them twice, would not be
    dp = train(tiny("syncdp"))
    for overlap, eager in ((3, False), (2, True)):
        run = train(tiny("diloco", inner_steps=3, overlap=overlap, eager=eager))
        assert run["final_loss"] == pytest.approx(dp["final_loss"], abs=1e-4) and run["tokens"] == dp["tokens"]
        assert run["key"].endswith(f" overlap={overlap}" + " eager" * eager)
    # with two islands the late outer step changes the run, at the same tokens; an overlapped run is not on the curve
    nesterov = dict(inner_steps=3, outer_lr=0.7, outer_momentum=0.9)
    now, late = (train(tiny("diloco", peers=2, overlap=t, **nesterov)) for t in (0, 2))
    assert now["final_loss"] != late["final_loss"] and now["tokens"] == late["tokens"]
    assert not _standard(_result("diloco", 2e-3, 1.0, h=32, codec="int2", overlap=8))
    # one island with momentum: its own outer gradient is the average, so the eager steps start where the outer step
    # lands and the run is the one with no overlap (to the rounding); the plain overlap's is not
    alone = [train(tiny("diloco", overlap=t, eager=e, **nesterov))["final_loss"] for t, e in ((0, False), (2, True), (2, False))]
    assert alone[1] == pytest.approx(alone[0], abs=1e-4) and abs(alone[2] - alone[0]) > 1e-3
    for bad in (dict(inner_steps=3, overlap=4), dict(inner_steps=3, overlap=-1), dict(inner_steps=3, eager=True)):
        with pytest.raises(ValueError, match="overlap"):
            Run("diloco", 1e-3, steps=6, **bad)
    with pytest.raises(ValueError, match="overlap"):
        Run("syncdp", 1e-3, overlap=1)


def test_the_overlap_phase_runs_the_targets_points_late_then_a_quarter_round_at_more_seeds_and_reports_them(tmp_path):
    assert plan("overlap", []) == []  # it builds on sync DP's best lr
    done = [_result("syncdp", lr, 2.0 + abs(lr - 4e-3)) for lr in (2e-3, 4e-3, 8e-3)] + [_result("syncdp", 4e-3, 2.1, seed=1)]
    runs = plan("overlap", done)
    seed_0 = [(r.inner_steps, r.compression, r.outer_lr, r.outer_momentum, r.inner_lr, r.overlap) for r in runs
              if not r.seed and not r.eager and r.overlap]
    # waiting instead, in the overlapped run's wall time: H / (H + overlap) of the steps, every round whole
    assert [(r.inner_steps, r.steps, r.seed) for r in runs if not r.overlap] == [
        (h, STEPS * h // (h + t), 0) for h, t in OVERLAP_WAITING]
    assert all(r.steps % r.inner_steps == 0 for r in runs)
    assert seed_0 == [(h, c, o, m, 4e-3 * f, t) for h, c, o, m, f, overlaps in OVERLAP_POINTS for t in overlaps]
    assert {(r.inner_steps, r.overlap) for r in runs if r.eager and not r.seed} == set(OVERLAP_EAGER)
    assert sorted((r.inner_steps, r.overlap, r.eager, r.seed) for r in runs if r.seed) == sorted(
        (h, t, False, s) for h, t in OVERLAP_SEEDED for s in SEEDS[1:])
    assert all(r.reducer_feedback and 0 <= r.overlap <= r.inner_steps for r in runs) and len(set(runs)) == len(runs)
    done += [_result("diloco", 2e-3, 2.2, h=32, codec="int2", outer=(0.8, 0.6), reducer_feedback=True, overlap=8),
             _result("diloco", 2e-3, 2.31, h=32, codec="int2", outer=(0.8, 0.6), reducer_feedback=True, overlap=8, seed=1),
             _result("diloco", 2e-3, 2.15, h=32, codec="int2", outer=(0.8, 0.6), reducer_feedback=True)]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    table = report(tmp_path)
    assert "| H = 32, int2, Nesterov 0.8 / 0.6, inner lr 0.002 | 8 (25%) | 0 | 2.2000 | **+10.0%** | 2.1500, +7.5% |" in table
    assert "| H = 32, int2, Nesterov 0.8 / 0.6, inner lr 0.002 | 8 (25%) | 1 | 2.3100 | **+10.0%** | – |" in table
    done.append(_result("diloco", 2e-3, 2.16, h=32, codec="int2", outer=(0.8, 0.6), reducer_feedback=True, overlap=8, eager=True))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    assert ("| H = 32, int2, Nesterov 0.8 / 0.6, inner lr 0.002, eager | 8 (25%) | 0 | 2.1600 | **+8.0%** | 2.1500, +7.5% |"
            in report(tmp_path))
    done.append(_result("diloco", 2e-3, 2.3, h=32, codec="int2", outer=(0.8, 0.6), reducer_feedback=True, steps=3840))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    table = report(tmp_path)
    assert "| H = 32, int2, Nesterov 0.8 / 0.6 | 8 (25%) | 0 | 3,932,160 | 2.3000 | 2.2000 |" in table
    assert "| 8 (25%) | 1 |" not in table.split("Waiting for the average")[1]  # seed 1 waited nowhere
    # the overlapped runs stay out of the curve's points: only the run without overlap is one
    assert [(p["inner_steps"], p["seeds"]) for p in summarize(load(tmp_path))["points"]] == [(32, 1)]


@pytest.mark.parametrize(("lr", "momentum", "warmup"), [(0.7, 0.9, 0), (1.0, 0.0, 0), (0.8, 0.6, 3)])
def test_the_eager_runs_preview_of_the_outer_step_is_that_step_to_the_byte_and_changes_nothing(lr, momentum, warmup):
    from p2p_diloco.core.config import OuterConfig
    from p2p_diloco.core.outer import OuterOptimizer, params_sha256

    generator = torch.Generator().manual_seed(1)
    params = [torch.randn(shape, generator=generator) for shape in ((7, 5), (13,))]
    outer = OuterOptimizer(params, OuterConfig(lr=lr, momentum=momentum, warmup_steps=warmup))
    for _ in range(3):  # a momentum and a warm-up under way
        before = params_sha256([*params, *outer.state_tensors()]), outer.steps_taken
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        ahead = preview(outer, grads)
        assert (params_sha256([*params, *outer.state_tensors()]), outer.steps_taken) == before
        outer.step(grads)
        assert params_sha256(ahead) == params_sha256(params)
