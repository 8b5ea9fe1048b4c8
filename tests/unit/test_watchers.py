"""What a person sees of a peer: plain progress lines, the live table, TensorBoard scalars."""

from __future__ import annotations

import io
import time

import pytest

from p2p_diloco.observe.display import TerminalProgress, human_bytes, render_table
from p2p_diloco.observe.metrics import FanOutSink, open_sink
from p2p_diloco.observe.watch import SwarmWatch, pack_stats


def _metrics_record(step: int, status: str = "ok", eval_loss: float | None = 2.25) -> dict:
    return dict(peer_id="12D3KooWpeerAAAAself", outer_step=step, status=status, loss=2.5, eval_loss=eval_loss,
                tokens_per_s=3612.4, group_size=3, bytes_sent=1_100_000, bytes_received=1_000_000,
                bytes_sent_total=13_200_000, bytes_received_total=13_100_000, compute_s=99.0, blocked_s=1.0,
                interval_blocked_s=0.5, averaging_s=1.25, unix_time=1_700_000_000.0 + step)


def test_human_bytes():
    assert [human_bytes(n) for n in (None, 0, 999, 1_000, 1_250_000, 7e12)] == ["-", "0 B", "999 B", "1.0 kB", "1.2 MB", "7000.0 GB"]


def test_plain_lines_when_not_a_terminal():
    watch = SwarmWatch("run", self_id="12D3KooWpeerAAAAself")
    out = io.StringIO()  # not a tty
    progress = TerminalProgress(watch, stream=out)
    assert not progress.live
    progress.start()
    progress.write(_metrics_record(12))
    progress.close()
    assert out.getvalue() == (
        "outer step 12 [ok]: loss 2.500, held-out 2.250, 3,612 tokens/s, group 3, ? live peers, sent 13.2 MB, "
        "received 13.1 MB, blocked 1.0%\n"
    )


def test_live_table_lists_every_peer_this_one_first():
    from rich.console import Console

    watch = SwarmWatch("myrun", self_id="12D3KooWpeerAAAAself")
    stats = pack_stats(_metrics_record(12))
    watch.observe({
        "12D3KooWpeerBBBBothr": dict(outer_step=12, tokens=5000, time=time.time(), stats=stats, global_sha256="s"),
        "12D3KooWpeerAAAAself": dict(outer_step=12, tokens=6000, time=time.time(), stats=stats, global_sha256="s"),
    })
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(render_table(watch.snapshot(), _metrics_record(12)))
    lines = console.export_text().splitlines()
    assert "run myrun · 2 live peers · outer step 12" in lines[0] and "same global params" in lines[0]
    rows = [line for line in lines if "…" in line]
    assert "▶ …AAAAself" in rows[0] and "…BBBBothr" in rows[1]
    assert "2.500" in rows[0] and "2.250" in rows[0] and "13.2 MB" in rows[0]
    assert lines[-1].startswith("last record: outer step 12 [ok]")


def test_a_live_display_on_a_terminal_draws_and_stops():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    watch = SwarmWatch("run", self_id="me")
    out = Terminal()
    progress = TerminalProgress(watch, stream=out)
    assert progress.live
    progress.start()
    progress.write(_metrics_record(1))
    progress.close()
    assert "outer step 1 [ok]" in out.getvalue()


def test_tensorboard_scalars_per_outer_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = open_sink(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"))
    assert isinstance(sink, FanOutSink)
    sink.write(dict(_metrics_record(0, status="init"), loss=None))
    sink.write(_metrics_record(1))
    sink.write(_metrics_record(2, eval_loss=None))
    sink.close()
    (run,) = (tmp_path / "tb").iterdir()
    assert run.name == "12D3KooWpeerAAAAself"
    events = EventAccumulator(str(run))
    events.Reload()
    scalars = {tag: [(e.step, round(e.value, 4)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["loss/train"] == [(1, 2.5), (2, 2.5)]
    assert scalars["loss/eval"] == [(0, 2.25), (1, 2.25)]
    assert scalars["swarm/group_size"] == [(1, 3), (2, 3)]  # not for the init record
    assert scalars["network/bytes_sent"] == [(1, 1_100_000), (2, 1_100_000)]
    assert scalars["network/bytes_received"][0] == (1, 1_000_000)
    assert scalars["time/blocked_s"][0] == (1, 0.5)
    assert scalars["time/blocked_fraction"][0] == (0, 0.01)
    assert scalars["throughput/tokens_per_s"][0] == (0, pytest.approx(3612.4))
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3


def test_monitor_and_tensorboard_settings_are_checked():
    from p2p_diloco.core.config_load import build_config

    config = build_config({"run": {"monitor_port": 8470, "monitor_host": "0.0.0.0", "tensorboard_dir": "runs/tb"}})
    assert (config.run.monitor_port, config.run.monitor_host, config.run.tensorboard_dir) == (8470, "0.0.0.0", "runs/tb")
    for bad in ({"monitor_port": 70000}, {"monitor_port": -1}, {"monitor_host": ""}, {"monitor_host": "a b"}):
        with pytest.raises(ValueError, match="monitor"):
            build_config({"run": bad})


def test_the_local_swarm_gives_the_monitor_flags_to_its_first_peer_only():
    from p2p_diloco.cli.launch import first_peer_only

    argv = ["--inner-steps", "20", "--monitor-port", "8470", "--monitor-host=0.0.0.0", "--tensorboard", "runs/tb"]
    assert first_peer_only(argv) == (
        ["--inner-steps", "20", "--tensorboard", "runs/tb"], ["--monitor-port", "8470", "--monitor-host=0.0.0.0"]
    )


def test_a_closed_stdout_stops_the_lines_not_the_peer():
    out = io.StringIO()
    progress = TerminalProgress(SwarmWatch("run"), stream=out)
    out.close()  # as when the reader of a pipe has gone
    progress.write(_metrics_record(1))
    progress.write(_metrics_record(2))
    progress.close()
