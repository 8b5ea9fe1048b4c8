"""The ``bare`` baseline worker (no network): its records, limits and bad-input handling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.baselines import main

_TINY_FLAGS = ["--n-layers", "1", "--d-model", "32", "--n-heads", "2", "--seq-len", "16", "--batch-size", "4"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_bare_writes_growing_records(tiny_corpus: str, tmp_path: Path) -> None:
    metrics = tmp_path / "bare.jsonl"
    flags = ["--method", "bare", "--corpus-dir", tiny_corpus, *_TINY_FLAGS, "--max-time-s", "3",
             "--record-every-s", "0.5", "--eval-every-s", "1", "--metrics-file", str(metrics)]
    assert main(flags) == 0
    records = _records(metrics)
    assert len(records) >= 4
    assert [r["final"] for r in records] == [False] * (len(records) - 1) + [True]
    assert records[0]["steps"] == 0 and math.isfinite(records[0]["eval_loss"])  # the initial params, evaluated
    tokens = [r["tokens"] for r in records]
    assert tokens == sorted(tokens) and tokens[-1] > tokens[1] > 0
    final = records[-1]
    assert final["tokens"] == final["steps"] * 4 * 16
    assert math.isfinite(final["eval_loss"]) and final["eval_loss"] < records[0]["eval_loss"]
    assert sum(r["eval_loss"] is not None for r in records) >= 3  # start, at least one on schedule, end
    for record in records:
        assert record["method"] == "bare" and record["group_size"] == 1 and record["comm_s"] == 0.0
        assert record["compute_s"] + record["eval_s"] <= record["time_s"] + 1e-3
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in records[1:])
    assert 3.0 <= final["time_s"] < 30.0  # stopped by the clock (loosely: a loaded machine runs each step slowly)


def test_bare_stops_at_max_tokens(tiny_corpus: str, tmp_path: Path) -> None:
    metrics = tmp_path / "bare.jsonl"
    flags = ["--method", "bare", "--corpus-dir", tiny_corpus, *_TINY_FLAGS, "--max-tokens", "640",
             "--eval-every-s", "0", "--metrics-file", str(metrics)]
    assert main(flags) == 0
    final = _records(metrics)[-1]
    assert final["final"] and final["tokens"] == 640 and final["steps"] == 10


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--method", "nope"], "invalid choice"),
        (["--method", "bare", "--expected-peers", "0"], "--expected-peers must be >= 1"),
        (["--method", "bare", "--record-every-s", "0"], "--record-every-s must be > 0"),
        (["--method", "bare", "--batch-size", "0"], "inner.batch_size must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(flags: list[str], reason: str, capsys: pytest.CaptureFixture) -> None:
    try:
        code = main(flags)
    except SystemExit as e:  # argparse's own errors exit from inside the parser
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert reason in err and len(err.splitlines()) == 1
