"""The swarm monitor: a small web page of a run's peers, served by a training peer or by a read-only watcher.

``MonitorServer`` serves, from the standard library's ``ThreadingHTTPServer`` in a daemon thread:

- ``/``: one self-contained page (``monitor_page.html``: HTML, CSS and JS inline, no outside resources) that
  polls the JSON below every 1.5 s and draws the peers' table and a loss chart (inline SVG);
- ``/api/swarm?since=T``: ``SwarmWatch.snapshot(since=T)``: every peer's latest values and its chart points newer
  than unix time T (the page asks only for what it does not have yet).

It only reads: nothing a browser sends changes the peer. A request is answered from the watch's last poll (the
swarm is never read on a request's behalf), so a busy page costs the training loop nothing but a little CPU in
another thread; a failing request is logged at DEBUG and answered 500, never raised into the peer.

``monitor_main`` is the read-only monitor (``scripts/monitor.py``): it joins the run's DHT as a client node (it
stores nothing, holds nobody's records, publishes no progress record, so it is never counted as a peer or asked
to average), reads the progress records every second, and serves the same page until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from p2p_diloco.config import SwarmConfig
from p2p_diloco.watch import SwarmWatch

logger = logging.getLogger(__name__)
PAGE_PATH = Path(__file__).with_name("monitor_page.html")
_REQUEST_TIMEOUT_S = 10.0  # a client that stops reading or writing loses its connection after this long
_QUIET_WARNING_S = 15.0  # a read-only monitor that has found no peer after this long says what may be wrong


class _Handler(BaseHTTPRequestHandler):
    server: _MonitorHTTPServer
    timeout = _REQUEST_TIMEOUT_S
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        try:
            url = urlparse(self.path)
            if url.path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", self.server.page)
            elif url.path == "/api/swarm":
                since = _float_param(parse_qs(url.query).get("since", ["0"])[0])
                body = json.dumps(self.server.watch.snapshot(since=since), allow_nan=False, separators=(",", ":")).encode()
                self._send(200, "application/json", body)
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")
        except Exception as e:
            logger.debug("monitor request %r failed: %r", self.path, e)
            try:
                self._send(500, "text/plain; charset=utf-8", b"monitor error\n")
            except Exception:
                pass

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; "
                         "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        logger.debug("monitor %s: " + format, self.address_string(), *args)


def _float_param(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if 0.0 <= value < 1e11 else 0.0


class _MonitorHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never delays the peer's exit
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], watch: SwarmWatch, page: bytes):
        self.watch, self.page = watch, page
        if ":" in address[0]:  # an IPv6 address such as ::1
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class MonitorServer:
    """Serves the monitor page and ``/api/swarm`` for ``watch``; binds at once (raises OSError if it cannot)."""

    def __init__(self, watch: SwarmWatch, host: str = "127.0.0.1", port: int = 0):
        self._server = _MonitorHTTPServer((host, port), watch, PAGE_PATH.read_bytes())
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs=dict(poll_interval=0.5), name="monitor-http", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}/" if ":" in host else f"http://{host}:{self.port}/"

    def close(self) -> None:
        """Stop serving (within the poll interval), close the socket, wait for the serving thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def monitor_main(argv: list[str] | None = None, prog: str = "monitor.py") -> int:
    """The read-only monitor: join a run's DHT without training and serve its monitor page."""
    from p2p_diloco.cli import _configure_logging, _fail, _OneLineParser

    parser = _OneLineParser(prog=prog, description="Watch a p2p-diloco run in a web browser, without training: joins "
                            "the run's DHT as a client, reads the peers' progress records, serves a live page.")
    parser.add_argument("--run-id", required=True, help="the run to watch")
    parser.add_argument("--initial-peers", nargs="+", required=True, metavar="MULTIADDR", help="any peers of the run")
    parser.add_argument("--port", type=int, default=8470, help="TCP port of the page (default 8470; 0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="address the page listens on (default 127.0.0.1: this machine only)")
    parser.add_argument("--swarm-key-file", metavar="PATH", help="the run's swarm key, if it is a closed run (records are checked with it)")
    parser.add_argument("--allow-list", metavar="PATH", help="the run's allow-list, if it is closed by one (records are checked against it)")
    parser.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"], metavar="MULTIADDR", help="where the DHT client listens")
    parser.add_argument("--period-s", type=float, default=1.0, help="seconds between reads of the progress records (default 1)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    args = parser.parse_args(argv)
    try:
        config = SwarmConfig(run_id=args.run_id, initial_peers=tuple(args.initial_peers), host_maddrs=tuple(args.host_maddrs),
                             swarm_key_file=args.swarm_key_file, allow_list_file=args.allow_list)
        _check_monitor_args(config, args.port, args.period_s)
    except ValueError as e:
        return _fail(prog, str(e))
    _configure_logging(args.log_level)
    return _watch_run(config, args.host, args.port, args.period_s, prog)


def _check_monitor_args(config: SwarmConfig, port: int, period_s: float) -> None:
    from p2p_diloco.membership import RunMembership
    from p2p_diloco.swarm import check_multiaddr

    for address in config.initial_peers:
        check_multiaddr(address, need_peer_id=True)
    for address in config.host_maddrs:
        check_multiaddr(address, need_peer_id=False)
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be a TCP port in [0, 65535], got {port}")
    if not 0.1 <= period_s <= 3600:
        raise ValueError(f"--period-s must be in [0.1, 3600] seconds, got {period_s}")
    RunMembership.from_files(config.swarm_key_file, config.allow_list_file, None)  # the files can be read


def _watch_run(config: SwarmConfig, host: str, port: int, period_s: float, prog: str) -> int:
    from p2p_diloco.cli import _fail
    from p2p_diloco.membership import RunMembership
    from p2p_diloco.swarm import SwarmStartError, close_dht, read_progress, reap_descendants, start_dht

    watch = SwarmWatch(config.run_id, period_s=period_s)
    try:
        server = MonitorServer(watch, host, port)
    except OSError as e:
        return _fail(prog, f"cannot serve the monitor on {host}:{port}: {e.strerror or e}")
    stop = threading.Event()
    dht = None
    try:
        membership = RunMembership.from_files(config.swarm_key_file, config.allow_list_file, None)
        dht = start_dht(config, membership.validators, mode="client")
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        progress_key = f"{config.run_id}.progress"
        watch.start(lambda: read_progress(dht, progress_key))
        print(f"watching run '{config.run_id}': open {server.url}", flush=True)
        if not stop.wait(_QUIET_WARNING_S) and not watch.snapshot()["peers"]:
            logger.warning("no progress records of run '%s' after %.0f s: is the run id right? A closed run needs "
                           "its --swarm-key-file or --allow-list", config.run_id, _QUIET_WARNING_S)
        stop.wait()
    except SwarmStartError as e:
        return _fail(prog, f"could not join the swarm: {e}", code=1)
    finally:
        watch.close()
        server.close()
        if dht is not None:
            close_dht(dht)
        reap_descendants()  # the DHT process and its p2pd
    print("monitor stopped", flush=True)
    sys.stderr.flush()
    # as a peer does: everything is closed, and the interpreter's teardown is where this process died of SIGABRT
    # after "monitor stopped" in two full test runs ("terminate called after throwing an instance of
    # 'std::system_error' what(): Broken pipe"; which C++ object threw is not known)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(monitor_main())
