"""scripts/dht_op_cost.py's input checks: bad settings get a one-line error and exit 2 before any DHT starts."""

from __future__ import annotations

import pytest

from experiments.dht_op_cost import _per_read, main

from .helpers import assert_out_file_refused_and_kept


@pytest.mark.parametrize("reads", ["0", "-5", "100001"])
def test_bad_read_counts_are_refused_in_one_line(tmp_path, capsys, reads):
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path / "out"), "--reads", reads])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip()
    assert f"--reads must be 1 to 100000, got {reads}" in error and len(error.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_refused_and_kept(tmp_path, capsys):
    assert_out_file_refused_and_kept(main, tmp_path / "results", capsys)


def test_per_read_figures_are_milliseconds_of_each_side():
    before, after = [1.0, 2.0, 0.5, 3.0, 0.25], [1.3, 2.6, 0.5, 3.03, 0.28]
    assert _per_read(before, after, 300) == {"caller": 1.0, "A dht": 2.0, "A p2pd": 0.0, "B dht": 0.1, "B p2pd": 0.1}
