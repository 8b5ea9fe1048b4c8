"""scripts/dht_traffic.py's input checks: bad settings get a one-line error and exit 2 before anything is made."""

from __future__ import annotations

import pytest

from p2p_diloco.dht_traffic import main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--members", "1"], "--members must be 2 to 16, got 1"),
        (["--period-s", "0"], "--period-s and --measure-s must be > 0"),
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
