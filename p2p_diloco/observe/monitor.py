"""The swarm monitor: a small web page of a run's peers, served by a training peer or by a read-only watcher.

``MonitorServer`` serves, from the standard library's ``ThreadingHTTPServer`` in a daemon thread:

- ``/``: one self-contained page (``monitor_page.html``: HTML, CSS and JS inline, no outside resources) that
  polls the JSON below every 1.5 s and draws the peers' table and a loss chart (inline SVG);
- ``/api/swarm?since=T``: ``SwarmWatch.snapshot(since=T)``: every peer's latest values and its chart points newer
  than unix time T (the page asks only for what it does not have yet).

It only reads: nothing a browser sends changes the peer. A request is answered from the watch's last poll (the
swarm is never read on a request's behalf), so a busy page costs the training loop nothing but a little CPU in
another thread; a failing request is logged at DEBUG and answered 500, never raised into the peer.

The read-only monitor that serves this page without training is cli/monitor.py.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from p2p_diloco.observe.watch import SwarmWatch

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
