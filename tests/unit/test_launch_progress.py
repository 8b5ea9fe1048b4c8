"""The launcher's progress where stdout is not a terminal (a log file, CI, nohup): one line per peer per new
metrics record and when it starts or exits, never the whole table again; and a peer's own flags (--peer-flag)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from p2p_diloco.cli.launch import ProgressView, parse_peer_flags, peer_args_without, swarm_main
from p2p_diloco.cli.peer_processes import PeerProcess


class FakeProcess:
    pid = 0

    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


def _peer(tmp_path: Path, name: str) -> PeerProcess:
    return PeerProcess(name, FakeProcess(), tmp_path / f"{name}.jsonl", tmp_path / f"{name}.log")  # type: ignore[arg-type]


def _record(peer: PeerProcess, outer_step: int) -> None:
    record = dict(outer_step=outer_step, status="ok", loss=2.5, eval_loss=None, tokens_per_s=1000.0, group_size=2,
                  blocked_s=0.1, compute_s=9.9, global_sha256="ab" * 32)
    with peer.metrics_file.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def test_a_log_gets_one_line_per_peer_per_record_and_state_change(tmp_path):
    stream = io.StringIO()
    view = ProgressView(stream)
    first, second = _peer(tmp_path, "peer0"), _peer(tmp_path, "peer1")
    view.show([first, second])
    view.show([first, second])  # nothing new: nothing printed
    assert stream.getvalue().splitlines() == ["  peer0 running     starting", "  peer1 running     starting"]
    _record(first, 0)
    view.show([first, second])
    view.show([first, second])
    _record(first, 1)
    _record(second, 1)
    view.show([first, second])
    second.process.returncode = 0
    view.show([first, second])
    lines = stream.getvalue().splitlines()[2:]
    assert [line.split()[0] for line in lines] == ["peer0", "peer0", "peer1", "peer1"]
    assert "outer_step    0" in lines[0] and "outer_step    1" in lines[1] and "outer_step    1" in lines[2]
    assert "exited(0)" in lines[3]
    assert "\x1b" not in stream.getvalue()  # no cursor movement in a log


def test_a_terminal_redraws_the_same_lines_in_place(tmp_path):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    view = ProgressView(stream)
    peers = [_peer(tmp_path, "peer0"), _peer(tmp_path, "peer1")]
    view.show(peers)
    view.show(peers)
    assert stream.getvalue().count("\x1b[2F") == 1  # the second drawing moved up over the first two lines
    assert stream.getvalue().count("starting") == 4


def test_a_peers_own_flags_are_parsed_per_peer_and_checked_before_anything_starts(tmp_path, capsys):
    assert parse_peer_flags(["1:--inner-optimizer=muon", "1:--throttle=2", "0:--no-reducer-feedback"], 2) == {
        1: ["--inner-optimizer=muon", "--throttle=2"], 0: ["--no-reducer-feedback"]}
    for bad in ("2:--throttle=2", "x:--throttle=2", "1:throttle", "1:--"):
        with pytest.raises(ValueError, match="PEER:--FLAG=VALUE"):
            parse_peer_flags([bad], 2)
    # the launcher's own flag never reaches the peers
    assert peer_args_without(["--peer-flag", "1:--inner-optimizer=muon", "--inner-steps", "5"], {"--peer-flag"}) == [
        "--inner-steps", "5"]
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exited:  # argparse's one-line error for a peer's own bad flag
        swarm_main(["--peers", "2", "--out", str(out), "--peer-flag", "1:--inner-optimizer=lion"])
    assert exited.value.code == 2 and "invalid choice: 'lion'" in capsys.readouterr().err
    assert swarm_main(["--peers", "2", "--out", str(out), "--inner-optimizer", "muon",
                       "--peer-flag", "1:--island-sharding=fsdp"]) == 2
    assert "use --island-sharding ddp" in capsys.readouterr().err
    assert not out.exists()  # nothing started, nothing written
