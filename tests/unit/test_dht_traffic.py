"""scripts/dht_traffic.py's input checks: bad settings get a one-line error and exit 2 before anything is made."""

from __future__ import annotations

import pytest

from experiments.dht_traffic import main

from .helpers import assert_out_file_refused_and_kept


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--members", "1"], "--members must be 2 to 16, got 1"),
        (["--period-s", "0"], "--period-s, --measure-s and --bandwidth-mbit must be > 0"),
        (["--measure-s", "nan"], "--period-s, --measure-s and --bandwidth-mbit must be > 0"),
        (["--bandwidth-mbit", "-3"], "--period-s, --measure-s and --bandwidth-mbit must be > 0"),
        (["--settle-s", "inf"], "--settle-s must be 0 to 3600"),
        (["--cases", "gossip"], "invalid choice: 'gossip'"),
    ],
)
def test_bad_settings_are_refused_in_one_line(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(tmp_path / "out"), *flags])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_refused_and_kept(tmp_path, capsys):
    assert_out_file_refused_and_kept(main, tmp_path / "results", capsys)
