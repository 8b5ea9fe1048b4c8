"""The overhead benchmark's bookkeeping (scripts/bench_overhead.py): flags of each phase, figures from fake worker
records and metrics records, the sums and the ratio, the table; the runs themselves are the script's job."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pytest

from experiments.overhead import (
    WORKER_ENTRY,
    _check_peer_flags,
    _parser,
    bare_flags,
    split_argv,
    swarm_flags,
)
from experiments.overhead_figures import (
    bare_figures,
    bare_sum,
    bracket,
    concurrency,
    markdown_table,
    summarise,
    swarm_figures,
    together_window,
)
from p2p_diloco.swarm.processes import cpu_seconds


def _args(**changes) -> argparse.Namespace:
    values = dict(peers=3, inner_steps=50, outer_steps=6, threads=1, batch_size=16, seq_len=128, warmup_steps=2)
    return argparse.Namespace(**{**values, **changes})


def _bare_record(tokens_per_s: float, steps: int = 300, start: float = 1000.0, cpu_share: float = 0.6) -> dict:
    tokens = steps * 2048
    wall = tokens / tokens_per_s
    return dict(status="bare", steps=steps, warmup_steps=2, tokens_per_step=2048, tokens=tokens, wall_s=wall,
                compute_s=0.98 * wall, cpu_s=cpu_share * 0.98 * wall, warmup_s=1.0, unix_start=start,
                unix_end=start + wall)


def _peer_records(tokens: int, wall: float, compute: float, blocked: float, eval_s: float, init_eval: float = 0.5,
                  start: float = 1000.0, cpu: float = 0.0) -> list[dict]:
    """An init record (its evaluation before the clock starts), a middle record and the last one."""
    init = dict(status="init", outer_step=0, time_s=init_eval, unix_time=start - 2.0, tokens=0, inner_steps=0,
                compute_s=0.0, compute_cpu_s=0.0, blocked_s=0.0, eval_s=init_eval, background_cpu_s=3.0)
    middle = dict(status="ok", outer_step=1, time_s=wall / 2, unix_time=start + wall / 2, tokens=tokens // 2,
                  inner_steps=150, compute_s=compute / 2, compute_cpu_s=cpu / 2, blocked_s=blocked / 2,
                  eval_s=init_eval + eval_s / 2, background_cpu_s=3.0 + 1.0 + (wall / 2 + 2.0) / 30)
    last = dict(status="ok", outer_step=2, time_s=wall, unix_time=start + wall, tokens=tokens, inner_steps=160,
                compute_s=compute, compute_cpu_s=cpu, blocked_s=blocked, eval_s=init_eval + eval_s,
                background_cpu_s=3.0 + 1.0 + (wall + 2.0) / 30)  # 2 s per minute, and 1 s once in the first round
    return [init, middle, last]


def test_flags_of_the_two_phases_pair_up():
    args = _args()
    own, extra = split_argv(["--out", "x", "--peers", "3", "--", "--compression", "int4"])
    assert own == ["--out", "x", "--peers", "3"] and extra == ["--compression", "int4"]
    bare = bare_flags(args, extra, Path("go"))
    assert bare[bare.index("--steps") + 1] == "300"  # H x S steps, timed
    swarm = swarm_flags(args, extra)
    assert swarm[swarm.index("--max-outer-steps") + 1] == "6" and swarm[swarm.index("--wait-for-peers") + 1] == "3"
    for flag, value in (("--threads", "1"), ("--batch-size", "16"), ("--seq-len", "128"), ("--inner-steps", "50")):
        assert bare[bare.index(flag) + 1] == value == swarm[swarm.index(flag) + 1]
    assert "--compression" in bare and "--compression" in swarm
    with pytest.raises(ValueError, match="--batch-size"):
        split_argv(["--out", "x", "--", "--batch-size=8"])  # would break the pairing: refused


def test_bare_rate_is_tokens_of_the_timed_steps_over_their_wall_time():
    f = bare_figures(_bare_record(10_000.0))
    assert f["tokens"] == 300 * 2048
    assert f["tokens_per_s"] == pytest.approx(10_000.0)
    assert f["compute_tokens_per_s"] == pytest.approx(10_000.0 / 0.98)
    # the warm-up's 2 steps and 1 s, added back
    assert f["tokens_per_s_with_warmup"] == pytest.approx(302 * 2048 / (300 * 2048 / 10_000.0 + 1.0))


def test_swarm_rate_and_fractions_leave_the_init_evaluation_out():
    f = swarm_figures(_peer_records(tokens=640_000, wall=80.0, compute=64.0, blocked=8.0, eval_s=4.0))
    assert f["tokens_per_s"] == pytest.approx(8_000.0)  # 640k tokens / 80 s since training began
    assert f["compute_tokens_per_s"] == pytest.approx(10_000.0)
    assert f["blocked_fraction"] == pytest.approx(0.1)
    assert f["eval_fraction"] == pytest.approx(0.05)  # 4 s; the init record's 0.5 s ran before the clock
    assert f["other_fraction"] == pytest.approx(0.05)
    assert f["steps"] == 310 and f["outer_steps"] == 2 and f["rounds_ok"] == 2
    assert f["unix_start"] == pytest.approx(1000.0) and f["unix_end"] == pytest.approx(1080.0)
    # from the first round's record on: the 1 s of a start-up in the first round (the averager's) left out
    assert f["background_cpu_s_per_min"] == pytest.approx(2.0)
    one_round = _peer_records(tokens=640_000, wall=80.0, compute=64.0, blocked=8.0, eval_s=4.0)[::2]
    assert swarm_figures(one_round)["background_cpu_s_per_min"] == pytest.approx((1.0 + 82.0 / 30) / 82.0 * 60)
    with pytest.raises(ValueError):
        swarm_figures(_peer_records(1, 1.0, 1.0, 0.0, 0.0)[:1])  # the init record alone: nothing trained


def test_sums_and_ratio():
    bare = {f"bare{i}": bare_figures(_bare_record(rate)) for i, rate in enumerate([10_000.0, 10_000.0, 12_000.0])}
    swarm = {f"peer{i}": swarm_figures(_peer_records(tokens, 80.0, 64.0, 8.0, 4.0))
             for i, tokens in enumerate([640_000, 720_000, 800_000])}
    s = summarise(bare, swarm, peers=3)
    assert s["complete"]
    assert s["bare_tokens_per_s_sum"] == pytest.approx(32_000.0)
    assert s["swarm_tokens_per_s_sum"] == pytest.approx(27_000.0)  # 8k + 9k + 10k
    assert s["ratio"] == pytest.approx(27_000.0 / 32_000.0)
    assert [r["ratio"] for r in s["per_process"]] == pytest.approx([0.8, 0.9, 10_000 / 12_000])
    assert s["per_process"][0]["swarm_blocked_fraction"] == pytest.approx(0.1)
    table = markdown_table(s)
    assert "| **sum** | 32,000 | 27,000 | **0.844** |" in table
    assert "| 1 | 10,000 | 9,000 | 0.900 |" in table


def test_the_three_factors_multiply_to_the_ratio():
    """tokens/wall = tokens/CPU x CPU/compute x compute/wall, in each phase: the factors split a loss exactly."""
    bare = {"bare0": bare_figures(_bare_record(10_000.0, cpu_share=0.66))}
    # swarm: 8,000 tokens/s; steps 90% of the wall; a core share of 0.6; tokens per CPU s 720k / 43.2 s
    swarm = {"peer0": swarm_figures(_peer_records(720_000, 90.0, 81.0, 0.0, 4.0, cpu=0.6 * 81.0))}
    row = summarise(bare, swarm, peers=1)["per_process"][0]
    assert row["cpu_share_factor"] == pytest.approx(0.6 / 0.66)
    assert row["steps_share_factor"] == pytest.approx(0.9 / 0.98)
    assert row["cpu_cost_factor"] == pytest.approx((720_000 / (0.6 * 81.0)) / (10_000.0 / (0.98 * 0.66)))
    assert row["cpu_cost_factor"] * row["cpu_share_factor"] * row["steps_share_factor"] == pytest.approx(row["ratio"])
    assert "0.660 -> 0.600" in markdown_table(summarise(bare, swarm, peers=1))
    # a peer from before the CPU field: the factors are left out, not made up
    old = {"peer0": swarm_figures([{k: v for k, v in r.items() if k != "compute_cpu_s"}
                                   for r in _peer_records(720_000, 90.0, 81.0, 0.0, 4.0)])}
    old_row = summarise(bare, old, peers=1)["per_process"][0]
    assert old_row["cpu_cost_factor"] is None and old_row["cpu_share_factor"] is None
    assert old_row["ratio"] == pytest.approx(row["ratio"])


def test_the_ratio_at_equal_cpu_cost_leaves_out_only_the_tokens_per_cpu_second():
    """Two bare processes at 10,000 tokens/s; in the swarm one's tokens cost its CPU 10% more, the other's 10% less,
    each with the same core and steps' shares: the ratio at the bare loops' CPU cost is those shares' product."""
    bare = {f"bare{i}": bare_figures(_bare_record(10_000.0, cpu_share=0.66)) for i in range(2)}
    swarm = {f"peer{i}": swarm_figures(_peer_records(720_000 * cost, 90.0, 81.0, 0.0, 4.0, cpu=0.6 * 81.0))
             for i, cost in enumerate((1.1, 0.9))}
    s = summarise(bare, swarm, peers=2)
    rows = s["per_process"]
    assert rows[1]["cpu_cost_factor"] / rows[0]["cpu_cost_factor"] == pytest.approx(0.9 / 1.1)
    shares = rows[0]["cpu_share_factor"] * rows[0]["steps_share_factor"]
    assert s["ratio_at_equal_cpu_cost"] == pytest.approx(shares)
    mean_cost = (rows[0]["cpu_cost_factor"] + rows[1]["cpu_cost_factor"]) / 2
    assert s["ratio"] == pytest.approx(shares * mean_cost) and mean_cost != pytest.approx(1.0)  # the raw ratio keeps it
    without = {"peer0": swarm["peer0"], "peer1": {**swarm["peer1"], "cpu_tokens_per_s": None}}
    assert summarise(bare, without, peers=2)["ratio_at_equal_cpu_cost"] is None  # left out, not made up


def test_a_missing_process_leaves_the_sum_out_instead_of_understating_it():
    bare = {"bare0": bare_figures(_bare_record(10_000.0)), "bare1": bare_figures(_bare_record(10_000.0))}
    swarm = {"peer0": swarm_figures(_peer_records(640_000, 80.0, 64.0, 8.0, 4.0))}
    s = summarise(bare, swarm, peers=2)
    assert not s["complete"]
    assert s["swarm_tokens_per_s_sum"] is None and s["ratio"] is None
    assert s["per_process"][1]["swarm_tokens_per_s"] is None
    assert "| 1 | 10,000 | — | — |" in markdown_table(s)


def test_a_swarm_phase_is_compared_with_the_mean_of_the_bare_phases_around_it():
    before = {"bare0": bare_figures(_bare_record(10_000.0, cpu_share=0.6)), "bare1": bare_figures(_bare_record(8_000.0))}
    after = {"bare0": bare_figures(_bare_record(12_000.0, cpu_share=0.66))}  # the machine sped up; bare1 failed
    merged = bracket(before, after)
    assert merged["bare0"]["tokens_per_s"] == pytest.approx(11_000.0)
    assert merged["bare0"]["cpu_share"] == pytest.approx(0.63)
    assert merged["bare1"]["tokens_per_s"] == pytest.approx(8_000.0)  # one side only: that side's figure
    no_cpu = {"bare0": {**before["bare0"], "cpu_share": None, "cpu_tokens_per_s": None}}
    assert bracket(no_cpu, after)["bare0"]["cpu_share"] is None  # not half a figure
    assert bare_sum(before) == pytest.approx(18_000.0)
    assert bare_sum({}) is None and bare_sum({"bare0": {"tokens_per_s": None}}) is None
    swarm = {"peer0": swarm_figures(_peer_records(720_000, 90.0, 81.0, 0.0, 4.0))}  # 8,000 tokens/s
    assert summarise(bracket(before, after), swarm, peers=1)["ratio"] == pytest.approx(8_000.0 / 11_000.0)


def test_repeats_are_checked_before_anything_starts():
    args = _parser("bench_overhead.py").parse_args(["--out", "x", "--repeats", "0"])
    with pytest.raises(ValueError, match="--repeats"):
        _check_peer_flags(args, [])
    assert _parser("bench_overhead.py").parse_args(["--out", "x"]).repeats == 1


def _traced_record(step_s: list[float], start: float, cpu_share: float) -> dict:
    """A bare worker's record with its per-step trace: step k took ``step_s[k]`` s at ``cpu_share`` of a core."""
    ends = [sum(step_s[: k + 1]) for k in range(len(step_s))]
    wall = ends[-1]
    return dict(status="bare", steps=len(step_s), warmup_steps=2, tokens_per_step=2048, tokens=2048 * len(step_s),
                wall_s=wall, compute_s=wall, cpu_s=cpu_share * wall, warmup_s=1.0, unix_start=start,
                unix_end=start + wall, step_end_s=ends, step_cpu_s=[cpu_share * end for end in ends])


def test_bare_rates_are_taken_while_every_worker_ran():
    """Three workers on two cores: one finishes first and the two left run faster on its core. Over their own
    windows the three rates count that core twice (core shares summing to over 2); over the window all three ran
    they are the rates the swarm's peers, which all run to the end together, compete with."""
    fast = _traced_record([0.2] * 100, start=1000.0, cpu_share=2 / 3)  # ends at 1020
    # 0.3 s steps while three ran (2/3 of a core each would be 0.2 s: this one got less), then 0.15 s alone
    slow_steps = [0.3] * 67 + [0.15] * 40
    slow = _traced_record(slow_steps, start=1000.1, cpu_share=0.6)
    window = together_window([fast, slow])
    assert window == (1000.1, 1020.0)
    f, s = bare_figures(fast, window), bare_figures(slow, window)
    assert f["window"] == s["window"] == "together" and f["window_s"] == pytest.approx(19.9)
    assert f["tokens_per_s"] == pytest.approx(2048 / 0.2)  # its steady rate
    assert s["tokens_per_s"] == pytest.approx(2048 / 0.3)  # the rate it had while the other ran, not its tail's
    assert s["own_window_tokens_per_s"] == pytest.approx(2048 * 107 / sum(slow_steps))
    assert s["own_window_tokens_per_s"] > s["tokens_per_s"]  # the tail counted in its own window
    assert s["cpu_share"] == pytest.approx(0.6) and s["cpu_tokens_per_s"] == pytest.approx(2048 / 0.3 / 0.6)
    # a window that starts or ends inside a step counts the step's share of it
    mid = bare_figures(fast, (1000.1, 1000.5))
    assert mid["tokens_in_window"] == pytest.approx(2048 * 0.4 / 0.2)
    # no common window, or no trace (an older worker): each over its own window, as before
    assert together_window([fast, _traced_record([0.2] * 10, start=2000.0, cpu_share=0.5)]) is None
    assert bare_figures(fast, None)["window"] == "own"
    assert bare_figures(_bare_record(10_000.0), window)["tokens_per_s"] == pytest.approx(10_000.0)


def test_concurrency_of_the_windows():
    assert concurrency([(0.0, 10.0), (0.0, 10.0)]) == pytest.approx(1.0)
    assert concurrency([(0.0, 10.0), (5.0, 15.0)]) == pytest.approx(0.5)
    assert concurrency([(0.0, 1.0), (2.0, 3.0)]) == 0.0
    assert concurrency([]) is None


def test_cpu_seconds_of_a_process_grow_as_it_works():
    """swarm/processes.cpu_seconds, the figure a peer's records carry as background_cpu_s: this process alone, then with
    whatever children the test run has (a child gone between two reads takes its seconds with it: same mode both)."""
    if not sys.platform.startswith("linux"):
        assert cpu_seconds([os.getpid()]) is None
        return
    alone = [os.getpid()]
    before = cpu_seconds(alone, with_descendants=False)
    started = time.process_time()
    while time.process_time() - started < 0.3:
        pass
    after = cpu_seconds(alone, with_descendants=False)
    assert before is not None and after - before >= 0.2  # clock ticks: 10 ms steps
    # with its descendants (whatever this test run started): no less than the process alone
    assert cpu_seconds(alone) >= cpu_seconds(alone, with_descendants=False) - 0.05
    assert cpu_seconds([2**22 + 12345]) == 0.0  # no such process: nothing, not an error


def test_the_bare_worker_writes_the_record_the_figures_read(tmp_path: Path):
    """The module the bare phase starts (WORKER_ENTRY) trains its timed steps once the go file is there, and its record
    holds what bare_figures reads: a worker that moved or changed its record would fail here, not in a 12-minute run."""
    import importlib
    import json

    import torch

    worker = importlib.import_module(WORKER_ENTRY[-1])
    go, metrics = tmp_path / "go", tmp_path / "bare0.jsonl"
    go.write_text(f"{time.time():.3f}\n")
    threads = torch.get_num_threads()
    try:
        code = worker.worker_main(["--steps", "3", "--warmup-steps", "1", "--go-file", str(go), "--metrics-file",
                                   str(metrics), "--batch-size", "2", "--seq-len", "32", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)  # the worker sets its process's threads, as a peer does
    assert code == 0
    [record] = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert (record["status"], record["steps"], record["warmup_steps"], record["tokens"]) == ("bare", 3, 1, 3 * 2 * 32)
    assert len(record["step_end_s"]) == len(record["step_cpu_s"]) == 3
    figures = bare_figures(record)
    assert figures["tokens"] == 3 * 2 * 32 and figures["tokens_per_s"] > 0 and 0 < figures["cpu_share"] <= 1.05


def test_the_bare_worker_refuses_bad_steps_in_one_line(tmp_path: Path, capsys):
    from experiments.overhead_worker import worker_main

    assert worker_main(["--steps", "0", "--go-file", str(tmp_path / "go")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--steps must be >= 1" in err
