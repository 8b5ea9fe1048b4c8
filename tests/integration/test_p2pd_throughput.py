"""scripts/p2pd_throughput.py end to end: two real p2pd daemons per setting, every byte counted on the far side."""

from __future__ import annotations

import json

from experiments.p2pd_throughput import main


def test_one_stream_carries_every_byte_at_each_thread_count(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert main(["--threads", "1", "0", "--messages", "4", "--message-mib", "0.25", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["threads"] for r in results] == [1, 0]
    for result in results:
        assert result["mib"] == 1.0 and result["mib_per_s"] > 0  # the receiver counted all 4 x 0.25 MiB
        assert result["sender_p2pd_cpu_s"] >= 0 and result["receiver_p2pd_cpu_s"] >= 0
    printed = capsys.readouterr().out
    assert "GOMAXPROCS=1: 1 MiB in" in printed and "Go's default: 1 MiB in" in printed
