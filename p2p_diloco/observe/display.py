"""A peer's progress for the person who started it: a live table in a terminal, plain lines elsewhere.

``TerminalProgress`` is a metrics sink (it sees every metrics record of this peer). On a terminal it redraws,
twice a second, a table of the swarm as this peer sees it (``SwarmWatch``: outer step, loss, held-out loss,
tokens/s, group size and bytes of every peer, this one first) under the log lines, which go on scrolling above
it. When stdout is not a terminal (a log file, a pipe, the local swarm launcher) it prints one line per metrics
record instead. It never touches the training loop: the live table is drawn by rich's own daemon thread, and a
failure to draw shows as a line of text, never as an exception in the peer.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

from p2p_diloco.observe.watch import SwarmWatch

logger = logging.getLogger(__name__)


def human_bytes(count: float | None) -> str:
    if count is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def progress_line(record: dict, live_peers: int | None) -> str:
    """One metrics record as a line a person reads."""
    busy = (record.get("compute_s") or 0.0) + (record.get("blocked_s") or 0.0)
    blocked = 100 * (record.get("blocked_s") or 0.0) / busy if busy > 0 else 0.0
    parts = [
        f"loss {_number(record.get('loss'), '.3f')}",
        f"held-out {_number(record.get('eval_loss'), '.3f')}",
        f"{_number(record.get('tokens_per_s'), ',.0f')} tokens/s",
        f"group {record.get('group_size', 0)}",
        f"{live_peers if live_peers is not None else '?'} live peer{'' if live_peers == 1 else 's'}",
        f"sent {human_bytes(record.get('bytes_sent_total'))}",
        f"received {human_bytes(record.get('bytes_received_total'))}",
        f"blocked {blocked:.1f}%",
    ]
    return f"outer step {record.get('outer_step')} [{record.get('status')}]: " + ", ".join(parts)


def render_table(snapshot: dict[str, Any], last_record: dict | None) -> Any:
    """The live view: a header, one row per peer (this one first, in bold; gone peers dimmed), this peer's last round."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    swarm = snapshot["swarm"]
    agree = {True: "peers at one step: same global params", False: "global params DIFFER at one step", None: ""}[swarm["agree"]]
    header = Text.assemble(
        ("p2p-diloco ", "bold"),
        f"run {snapshot['run_id']} · {swarm['live_peers']} live peer{'' if swarm['live_peers'] == 1 else 's'} · outer step {_number(swarm['outer_step'], 'd')}"
        f" · swarm {_number(swarm['tokens_per_s'], ',.0f')} tokens/s · {agree}",
    )
    table = Table(box=None, padding=(0, 2), header_style="bold dim")
    for name in ("peer", "outer step", "loss", "held-out", "tokens/s", "group", "sent", "received", "record age"):
        table.add_column(name, justify="left" if name == "peer" else "right")
    for peer in snapshot["peers"]:
        style = "bold" if peer["is_self"] else ("" if peer["live"] else "dim")
        table.add_row(
            f"{'▶ ' if peer['is_self'] else '  '}…{peer['short_id']}" + ("" if peer["live"] else " (gone)"),
            _number(peer["outer_step"], "d"),
            _number(peer["loss"], ".3f"),
            _number(peer["eval_loss"], ".3f"),
            _number(peer["tokens_per_s"], ",.0f"),
            _number(peer["group_size"], "d"),
            human_bytes(peer["bytes_sent"]),
            human_bytes(peer["bytes_received"]),
            f"{_number(peer['age_s'], '.0f')} s",
            style=style,
        )
    footer = Text("waiting for the first outer step ...", style="dim")
    if last_record is not None:
        footer = Text(f"last record: {progress_line(last_record, swarm['live_peers'])}", style="dim")
    return Group(header, table, footer)


class TerminalProgress:
    """A metrics sink that shows this peer's progress; ``start`` begins the live table (on a terminal only)."""

    def __init__(self, watch: SwarmWatch, stream: TextIO | None = None, live: bool | None = None):
        self._watch = watch
        self._stream: TextIO | None = stream or sys.stdout
        self.live = bool(self._stream and self._stream.isatty()) if live is None else live
        self._last: dict | None = None
        self._view: Any = None
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []  # log handlers moved above the table

    def start(self) -> None:
        if not self.live:
            return
        from rich.console import Console
        from rich.live import Live

        errors_here = sys.stderr.isatty()  # log lines on the same terminal must print above the table
        original_stderr = sys.stderr
        self._view = Live(
            console=Console(file=self._stream),
            get_renderable=self._render,
            refresh_per_second=2,
            redirect_stdout=True,
            redirect_stderr=errors_here,
        )
        self._view.start()
        if errors_here:  # logging's handlers hold the real stderr; hand them rich's proxy while the table lives
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is original_stderr:
                    self._handlers.append((handler, handler.setStream(sys.stderr)))

    def _render(self) -> Any:
        try:
            return render_table(self._watch.snapshot(), self._last)
        except Exception as e:  # never an exception in rich's refresh thread
            return f"(progress display failed: {type(e).__name__}: {e})"

    def write(self, record: dict) -> None:
        self._last = record
        if not self.live and self._stream is not None:
            live_peers = self._watch.snapshot()["swarm"]["live_peers"] or None
            try:
                print(progress_line(record, live_peers), file=self._stream, flush=True)
            except (OSError, ValueError):  # stdout closed (a pipe's reader gone): training goes on without lines
                self._stream = None

    def close(self) -> None:
        if self._view is not None:
            for handler, stream in self._handlers:
                handler.setStream(stream)
            self._handlers.clear()
            try:
                self._view.stop()
            except Exception as e:
                logger.debug("stopping the progress display failed: %r", e)
            self._view = None
