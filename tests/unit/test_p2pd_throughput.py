"""scripts/p2pd_throughput.py's input checks: bad settings get a one-line error and exit 2 before any p2pd starts."""

from __future__ import annotations

import pytest

from experiments.p2pd_throughput import main


@pytest.mark.parametrize("argv", [["--threads", "-1"], ["--messages", "0"], ["--message-mib", "0"]])
def test_bad_settings_are_refused_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "--threads must be >= 0, --messages >= 1 and --message-mib > 0" in capsys.readouterr().err
