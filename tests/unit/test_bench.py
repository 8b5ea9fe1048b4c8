"""The benchmark's bookkeeping: per-method figures and the comparisons at equal tokens and equal wall time,
from synthetic metrics records (the runs themselves are scripts/bench.py's job)."""

from __future__ import annotations

import pytest

from experiments.bench import MethodRun, compare, loss_at, markdown_table, summarise


def _records(t0: float, rows: list[tuple[float, int, float | None]], compute_fraction: float) -> list[dict]:
    """(time_s, tokens, eval_loss) rows -> metrics records of one process."""
    return [
        dict(unix_time=t0 + t, time_s=t, tokens=tokens, eval_loss=loss, compute_s=compute_fraction * t, eval_s=0.0)
        for t, tokens, loss in rows
    ]


def _run(method: str, rows: list[tuple[float, int, float | None]], peers: int, wire_per_peer: int, fraction: float) -> MethodRun:
    records = {f"peer{i}": _records(1000.0, rows, fraction) for i in range(peers)}
    run = MethodRun(method, records)
    run.wire_sent = {name: wire_per_peer for name in records}
    run.wire_timeline = [(1000.0, 0), (1000.0 + rows[-1][0], wire_per_peer * peers)]
    return run


def test_summary_of_one_method():
    run = _run("syncdp", [(0, 0, 5.0), (10, 1000, 4.0), (20, 2000, 3.5)], peers=2, wire_per_peer=40_000, fraction=0.5)
    s = summarise(run)
    assert s["swarm_tokens"] == 4000
    assert s["swarm_tokens_per_s"] == pytest.approx(200.0)  # 2 peers x 2000 tokens / 20 s
    assert s["goodput"] == pytest.approx(0.5)
    assert s["wire_bytes_per_token"] == pytest.approx(80_000 / 4000)
    # syncdp: peer 0's evaluations only (every peer holds the same params), swarm tokens summed over peers
    assert [p["swarm_tokens"] for p in s["eval_curve"]] == [0, 2000, 4000]
    assert s["eval_curve"][-1]["bytes_sent"] == 80_000


def test_loss_at_takes_the_last_evaluation_at_or_before():
    curve = [dict(swarm_tokens=0, wall_s=0, eval_loss=5.0), dict(swarm_tokens=100, wall_s=10, eval_loss=4.0)]
    assert loss_at(curve, "swarm_tokens", 99) == 5.0  # the model at 99 tokens is still the one evaluated at 0
    assert loss_at(curve, "swarm_tokens", 100) == 4.0
    assert loss_at(curve, "wall_s", -1) is None


def test_comparison_at_equal_tokens_and_bytes_ratio():
    diloco = _run("diloco-int8", [(0, 0, 5.0), (10, 5000, 3.0), (20, 10000, 2.5)], 2, wire_per_peer=1000, fraction=0.99)
    sync = _run("syncdp", [(0, 0, 5.0), (40, 5000, 2.9)], 2, wire_per_peer=500_000, fraction=0.2)
    summaries = {"diloco-int8": summarise(diloco), "syncdp": summarise(sync)}
    result = compare(summaries)
    assert result["equal_tokens"] == 10000  # syncdp got to 2 x 5000 tokens, diloco further
    assert result["equal_wall_s"] == 20
    assert summaries["diloco-int8"]["eval_loss_at_equal_tokens"] == 3.0
    assert summaries["syncdp"]["eval_loss_at_equal_tokens"] == 2.9
    assert summaries["syncdp"]["eval_loss_at_equal_wall_s"] == 5.0  # it had not evaluated again by 20 s
    # bytes per token: syncdp 1e6 / 10000 = 100; diloco 2000 / 20000 = 0.1
    assert result["diloco-int8_fewer_bytes_per_token_than_syncdp"] == pytest.approx(1000.0)
    assert result["diloco-int8_eval_loss_vs_syncdp_at_equal_tokens"] == pytest.approx(3.0 / 2.9 - 1, abs=1e-4)
    table = markdown_table(summaries, result)
    assert "| diloco-int8 | 2 |" in table and "| syncdp | 2 |" in table


def test_pairs_are_compared_at_their_own_equal_points():
    diloco = _run("diloco-int8", [(0, 0, 5.0), (10, 5000, 3.0), (20, 10000, 2.5)], 2, wire_per_peer=1000, fraction=0.99)
    sync = _run("syncdp", [(0, 0, 5.0), (5, 1000, 4.0)], 2, wire_per_peer=500_000, fraction=0.2)
    hopt = _run("hivemind-opt", [(0, 0, 5.0), (10, 5000, 2.8), (30, 12000, 2.4)], 2, wire_per_peer=9000, fraction=0.9)
    summaries = {m: summarise(r) for m, r in (("diloco-int8", diloco), ("syncdp", sync), ("hivemind-opt", hopt))}
    result = compare(summaries)
    assert result["equal_wall_s"] == 5  # the shortest run sets the common point...
    pairs = {(p["method"], p["baseline"]): p for p in result["pairs"]}
    against_hopt = pairs[("diloco-int8", "hivemind-opt")]  # ...but not that of a pair it is not part of
    assert against_hopt["equal_wall_s"] == 20 and against_hopt["equal_swarm_tokens"] == 20000
    assert against_hopt["loss_at_equal_wall_s"] == {"diloco-int8": 2.5, "hivemind-opt": 2.8}
    assert against_hopt["vs_baseline_at_equal_wall_s"] == pytest.approx(2.5 / 2.8 - 1, abs=1e-4)
    assert pairs[("diloco-int8", "syncdp")]["loss_at_equal_swarm_tokens"] == {"diloco-int8": 5.0, "syncdp": 4.0}
    assert "| diloco-int8 | hivemind-opt | 20,000 tokens: 2.500 vs 2.800 (-10.7%)" in markdown_table(summaries, result)


def test_alone_against_bare():
    bare = _run("bare", [(0, 0, None), (10, 10_000, 3.0)], 1, wire_per_peer=0, fraction=1.0)
    alone = _run("alone", [(0, 0, 5.0), (10, 9_900, 3.0)], 1, wire_per_peer=0, fraction=0.98)
    result = compare({"bare": summarise(bare), "alone": summarise(alone)})
    assert result["alone_tokens_per_s_vs_bare"] == pytest.approx(0.99)


def test_launcher_flags_with_several_values_are_not_passed_to_peers():
    from p2p_diloco.cli.launch import peer_args_without

    argv = ["--peers", "4", "--bandwidth-mbit", "20", "20", "5", "5", "--inner-steps", "100", "--quick", "--batch-size=8"]
    own = {"--peers", "--bandwidth-mbit", "--quick"}
    assert peer_args_without(argv, own) == ["--inner-steps", "100", "--batch-size=8"]


def test_a_state_stream_cut_short_is_reported_not_misread():
    import torch
    from hivemind.compression import serialize_torch_tensor
    from hivemind.utils.streaming import split_for_streaming

    from p2p_diloco.swarm.averaging import whole_tensor

    tensor = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB: several streaming chunks
    parts = list(split_for_streaming(serialize_torch_tensor(tensor)))
    assert len(parts) > 1
    assert torch.equal(whole_tensor(parts), tensor)
    with pytest.raises(ConnectionError, match="ended after"):
        whole_tensor(parts[:-1])
