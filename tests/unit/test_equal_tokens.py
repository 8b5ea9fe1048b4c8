"""The in-process equal-tokens study (equal_tokens.py): its two methods' arithmetic, the comparison, bad input."""

from __future__ import annotations

import json

import pytest

from experiments.equal_tokens import compare, diloco_curve, loss_at, main, sync_dp_curve, warm_start
from p2p_diloco.core.config import InnerConfig, OuterConfig

TINY = InnerConfig(batch_size=2)
BATCH_TOKENS = 2 * 128


def test_one_island_with_a_plain_outer_step_is_one_model_training_as_sync_dp_of_one():
    # outer lr 1 without momentum sets the global params to the island's: DiLoCo of one island is plain training,
    # and so is sync DP over one shard. The two curves must agree at every outer step
    dp = sync_dp_curve(peers=1, tokens=6 * BATCH_TOKENS, eval_every=3, inner=TINY)
    diloco = diloco_curve(1, 6 * BATCH_TOKENS, 3, TINY, OuterConfig(lr=1.0, momentum=0.0), "none")
    assert [t for t, _ in diloco] == [0, 3 * BATCH_TOKENS, 6 * BATCH_TOKENS] == [t for t, _ in dp]
    for (_, a), (_, b) in zip(dp, diloco):
        assert a == pytest.approx(b, abs=1e-5)
    assert dp[-1][1] < dp[0][1]  # it learned something


def test_the_outer_step_averages_the_islands():
    # two islands on different shards, outer lr 1, no momentum: the global params are the mean of theirs, so
    # their loss differs from one island's training alone
    alone = diloco_curve(1, 2 * BATCH_TOKENS, 2, TINY, OuterConfig(lr=1.0, momentum=0.0), "none")
    pair = diloco_curve(2, 4 * BATCH_TOKENS, 2, TINY, OuterConfig(lr=1.0, momentum=0.0), "none")
    assert [t for t, _ in pair] == [0, 4 * BATCH_TOKENS]
    assert pair[1][1] != pytest.approx(alone[1][1], abs=1e-6)


def test_loss_at_interpolates_and_compare_gives_the_gap():
    dp = [(0, 5.0), (100, 3.0), (200, 2.0)]
    assert loss_at(dp, 150) == pytest.approx(2.5) and loss_at(dp, 100) == 3.0 and loss_at(dp, 201) is None
    rows = compare(dp, [(0, 5.0), (150, 2.75), (300, 1.0)])
    assert rows == [dict(tokens=150, diloco=2.75, syncdp=2.5, gap=0.1)]  # the start and points beyond DP left out


def test_main_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "study"
    assert main(["--out", str(out), "--tokens", str(4 * BATCH_TOKENS), "--inner-steps", "1", "2", "--peers", "2",
                 "--batch-size", "2", "--eval-every", "1", "--jobs", "1"]) == 0
    results = json.loads((out / "equal_tokens.json").read_text())
    assert set(results["diloco"]) == {"diloco-H1", "diloco-H2"}
    assert len(results["diloco"]["diloco-H1"]["vs_syncdp"]) == 2 and len(results["diloco"]["diloco-H2"]["vs_syncdp"]) == 1
    assert "| diloco-H2 | 1 | 1,024 |" in (out / "equal_tokens.md").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [(["--tokens", "0"], "--tokens must be > 0"), (["--inner-steps", "x"], "--inner-steps must be a number"),
     (["--outer-momentum", "1.5"], "outer.momentum"), (["--warm-start-tokens", "-1"], "--warm-start-tokens must be >= 0")],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error


def test_a_warm_start_is_where_both_methods_begin_and_sync_dp_goes_on_as_if_never_stopped():
    # sync DP warm-started at 2 steps and run 2 more is the same arithmetic as 4 steps in one go (params, AdamW
    # state and data position all carried); DiLoCo starts from the same point: its first evaluation is that model
    start = warm_start(peers=2, tokens=2 * 2 * BATCH_TOKENS, inner=TINY)
    assert (start.tokens, start.steps) == (4 * BATCH_TOKENS, 2)
    straight = sync_dp_curve(peers=2, tokens=8 * BATCH_TOKENS, eval_every=2, inner=TINY)
    resumed = sync_dp_curve(peers=2, tokens=4 * BATCH_TOKENS, eval_every=2, inner=TINY, start=start)
    assert [t for t, _ in resumed] == [4 * BATCH_TOKENS, 8 * BATCH_TOKENS] == [t for t, _ in straight[1:]]
    for (_, a), (_, b) in zip(straight[1:], resumed):
        assert a == pytest.approx(b, abs=1e-5)
    diloco = diloco_curve(2, 4 * BATCH_TOKENS, 2, TINY, OuterConfig(), "none", start=start)
    assert diloco[0] == resumed[0] and [t for t, _ in diloco] == [4 * BATCH_TOKENS, 8 * BATCH_TOKENS]
    again = diloco_curve(2, 4 * BATCH_TOKENS, 2, TINY, OuterConfig(), "none", start=start)
    assert again == diloco  # the islands got copies: the warm start itself was not trained on


def test_main_with_a_warm_start_labels_the_table(tmp_path):
    out = tmp_path / "warm"
    assert main(["--out", str(out), "--tokens", str(4 * BATCH_TOKENS), "--inner-steps", "2", "--peers", "2",
                 "--batch-size", "2", "--eval-every", "1", "--jobs", "1", "--warm-start-tokens", "1"]) == 0
    results = json.loads((out / "equal_tokens.json").read_text())
    assert results["warm_start_tokens"] == 2 * BATCH_TOKENS  # rounded up to one whole step of 2 peers
    assert results["syncdp"][0][0] == 2 * BATCH_TOKENS
    assert (out / "equal_tokens.md").read_text().startswith("From a warm start: sync DP's model after 512 swarm tokens")
