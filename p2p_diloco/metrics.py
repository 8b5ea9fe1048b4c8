"""Where per-round records go: a JSON-lines file, or nowhere (a null sink instead of ``if`` branches)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol


class MetricsSink(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


class NullSink:
    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class JsonLinesSink:
    """One JSON object per line, flushed after each record so a killed peer loses at most one line."""

    def __init__(self, path: str | Path):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def open_sink(path: str | None) -> MetricsSink:
    return JsonLinesSink(path) if path else NullSink()
