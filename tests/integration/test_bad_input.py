"""Bad input to peer.py ends within seconds with one clear error line and a non-zero exit, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PEER = Path(__file__).resolve().parents[2] / "peers" / "peer.py"
UNREACHABLE = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"

CASES = {
    "unknown flag": (["--no-such-flag"], "unrecognized arguments"),
    "bad multiaddr": (["--initial-peers", "not-an-address"], "bad multiaddr"),
    "multiaddr without peer id": (["--initial-peers", "/ip4/127.0.0.1/tcp/9"], "/p2p/"),
    "negative steps": (["--inner-steps", "-5"], "inner_steps"),
    "negative max outer steps": (["--max-outer-steps", "-1"], "max_outer_steps"),
    "bad compression": (["--compression", "zip"], "invalid choice"),
    "unreadable config": (["--config", "/nonexistent/peer.toml"], "cannot read config file"),
    "unreachable initial peer": (["--initial-peers", UNREACHABLE, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "could not join"),
    "missing corpus": (["--corpus-dir", "/nonexistent/corpus"], "corpus folder"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_line_and_nonzero_exit(case, reaper, tmp_path):
    argv, expected = CASES[case]
    process = subprocess.Popen(
        [sys.executable, str(PEER), *argv, "--metrics-file", str(tmp_path / "m.jsonl")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    reaper.append(process.pid)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "Traceback" not in stderr + stdout
    errors = [line for line in stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and expected in errors[0], stderr


def test_bad_toml_and_unknown_key_are_named(tmp_path, reaper):
    broken = tmp_path / "broken.toml"
    broken.write_text("[inner\nlr = 1")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[inner]\nlearning_rate = 0.1\n")
    for path, expected in ((broken, "not valid TOML"), (unknown, "unknown key(s) in [inner]: learning_rate")):
        result = subprocess.run([sys.executable, str(PEER), "--config", str(path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and expected in result.stderr and "Traceback" not in result.stderr
