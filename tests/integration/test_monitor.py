"""The swarm monitor end to end: its HTTP server, and its page in headless Chromium over a real local swarm
(served by a training peer and by the read-only monitor), with a screenshot in the test's folder."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from experiments.browser import chart_points, chromium_page, free_port, unavailable_reason
from p2p_diloco.observe.monitor import MonitorServer
from p2p_diloco.observe.watch import SwarmWatch, pack_stats

from .harness import FAST_PEER_FLAGS, PEER_SCRIPT, local_swarm, wait_for_log

pytestmark = pytest.mark.integration
MONITOR_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "monitor.py"
# predicates as functions, not expressions: the page's Content-Security-Policy forbids eval, which expressions need
LIVE_ROWS = "(n) => document.querySelectorAll('#peers tbody tr.live').length >= n"
CHART_POINTS = "(n) => Number(document.querySelector('#chart').dataset.points) >= n"


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_monitor_server_serves_the_page_and_the_swarm_as_json():
    watch = SwarmWatch("unit", self_id="peerA")
    stats = pack_stats(dict(outer_step=3, loss=2.5, eval_loss=2.75, group_size=2, bytes_sent_total=10, bytes_received_total=20))
    watch.observe({"peerA": dict(outer_step=3, tokens=100, time=time.time(), stats=stats), "peerB": dict(outer_step=float("nan"))})
    server = MonitorServer(watch, "127.0.0.1", 0)
    try:
        status, kind, page = _get(server.url)
        assert status == 200 and kind.startswith("text/html") and b'<svg id="chart"' in page
        assert b"http://" not in page.replace(b'"http://www.w3.org/2000/svg"', b"")  # nothing loaded from elsewhere
        status, kind, body = _get(server.url + "api/swarm")
        snapshot = json.loads(body)  # strict JSON: a NaN from a stranger's record must not break the page
        assert status == 200 and kind == "application/json"
        assert [p["peer_id"] for p in snapshot["peers"]] == ["peerA", "peerB"]
        assert snapshot["peers"][0]["loss"] == 2.5 and snapshot["peers"][1]["outer_step"] is None
        assert len(snapshot["peers"][0]["history"]) == 1
        later = json.loads(_get(server.url + f"api/swarm?since={time.time() + 1}")[2])
        assert later["peers"][0]["history"] == [] and later["peers"][0]["history_points"] == 1
        assert _get(server.url + "api/swarm?since=nonsense")[0] == 200
        assert _get(server.url + "nothing-here")[0] == 404
    finally:
        started = time.monotonic()
        server.close()
    assert time.monotonic() - started < 3
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)


def test_a_monitor_port_in_use_ends_the_peer_with_one_line(tmp_path, reaper):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), *FAST_PEER_FLAGS, "--monitor-port", str(port), "--max-time-s", "30",
             "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--metrics-file", str(tmp_path / "m.jsonl")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        reaper.append(process.pid)
        stdout, stderr = process.communicate(timeout=90)
    assert process.returncode == 2 and "Traceback" not in stdout + stderr
    errors = [line for line in stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and f"cannot serve the monitor on 127.0.0.1:{port}" in errors[0], stderr


def _row_ids(page) -> list[str]:
    return page.eval_on_selector_all("#peers tbody tr.live", "rows => rows.map(r => r.dataset.peerId)")


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"browser test: {unavailable_reason()}")
@pytest.mark.timeout(200)
def test_monitor_page_in_chromium_shows_a_live_swarm(tmp_path, reaper):
    port = free_port()
    swarm = local_swarm(tmp_path, reaper, ["--inner-steps", "10", "--max-time-s", "120"])
    swarm.start("peer0", shard=0, num_shards=2, extra=["--monitor-port", str(port)])
    swarm.start("peer1", shard=1, num_shards=2)
    readonly_port = free_port()
    with open(tmp_path / "monitor.log", "wb") as log:
        readonly = subprocess.Popen(
            [sys.executable, str(MONITOR_SCRIPT), "--run-id", "itest", "--initial-peers", str(swarm.address),
             "--port", str(readonly_port), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    reaper.append(readonly.pid)
    wait_for_log(swarm.peers["peer0"].log_file, rf"swarm monitor: http://127\.0\.0\.1:{port}/", 0, 60)
    swarm.wait_until(lambda: all(swarm.records(name) for name in swarm.peers), 60, "both peers' first records")
    peer_ids = {swarm.records(name)[0]["peer_id"] for name in swarm.peers}

    with chromium_page(tmp_path / "profile") as page:
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_function(LIVE_ROWS, arg=2, timeout=60_000)
        assert set(_row_ids(page)) == peer_ids
        assert page.inner_text("#run") == "· run itest"
        page.wait_for_function(CHART_POINTS, arg=2, timeout=60_000)
        first = chart_points(page)
        page.wait_for_function(CHART_POINTS, arg=first + 1, timeout=60_000)  # the chart grows by itself
        assert page.locator("#chart polyline.train").count() >= 1
        assert "live" in page.inner_text("#status")
        page.screenshot(path=str(tmp_path / "monitor.png"), full_page=True)

        # the read-only monitor, which trains nothing, shows the same peers from the DHT (once it serves its page)
        wait_for_log(tmp_path / "monitor.log", rf"open http://127\.0\.0\.1:{readonly_port}/", 0, 60)
        page.goto(f"http://127.0.0.1:{readonly_port}/")
        page.wait_for_function(LIVE_ROWS, arg=2, timeout=60_000)
        assert set(_row_ids(page)) == peer_ids
        assert "read-only monitor" in page.inner_text("#footer")
        page.screenshot(path=str(tmp_path / "monitor-readonly.png"), full_page=True)

    assert (tmp_path / "monitor.png").stat().st_size > 10_000
    readonly.send_signal(signal.SIGTERM)
    assert readonly.wait(timeout=30) == 0, (tmp_path / "monitor.log").read_text()
    assert all(code == 0 for code in swarm.stop_all().values()), swarm.log_tails()
    # the monitor never counted as a peer: nobody averaged with a third party
    assert all(r["group_size"] <= 2 for records in swarm.all_records().values() for r in records)
