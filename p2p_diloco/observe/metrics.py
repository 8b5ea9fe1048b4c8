"""Where per-round records go: a JSON-lines file, TensorBoard scalars, several of these, or nowhere (a null sink
instead of ``if`` branches). TensorBoard is imported only when a TensorBoard sink is opened."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from p2p_diloco.observe.report import ROUND_STATUSES


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


class FanOutSink:
    """Every record to each of several sinks, in order."""

    def __init__(self, sinks: Sequence[MetricsSink]):
        self.sinks = list(sinks)

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


# metrics record field -> TensorBoard tag; group size, bytes and blocked time only for averaging attempts
_ALWAYS = {"loss": "loss/train", "eval_loss": "loss/eval", "tokens_per_s": "throughput/tokens_per_s"}
_PER_ROUND = {
    "group_size": "swarm/group_size",
    "bytes_sent": "network/bytes_sent",
    "bytes_received": "network/bytes_received",
    "interval_blocked_s": "time/blocked_s",
    "averaging_s": "time/averaging_s",
}


class TensorBoardSink:
    """Scalars of each metrics record, against the outer step, in ``DIR/<peer id>`` (one run per peer in
    TensorBoard; the folder is made at the first record, which names the peer)."""

    def __init__(self, directory: str | Path):
        try:  # needs the tensorboard package: imported only when a peer writes TensorBoard scalars
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ValueError(f"--tensorboard needs the tensorboard package (pip install tensorboard): {e}") from None

        self._writer_class, self._directory = SummaryWriter, Path(directory)
        self._writer: Any = None

    def write(self, record: dict) -> None:
        if self._writer is None:
            self._writer = self._writer_class(str(self._directory / str(record.get("peer_id", "peer"))))
        step, walltime = int(record["outer_step"]), record.get("unix_time")
        tags = dict(_ALWAYS, **(_PER_ROUND if record.get("status") in ROUND_STATUSES else {}))
        for name, tag in tags.items():
            if isinstance(record.get(name), int | float):
                self._writer.add_scalar(tag, record[name], step, walltime=walltime)
        busy = record.get("compute_s", 0.0) + record.get("blocked_s", 0.0)
        if busy > 0:  # the share of the loop's time spent waiting on the network (invariant 2)
            self._writer.add_scalar("time/blocked_fraction", record.get("blocked_s", 0.0) / busy, step, walltime=walltime)
        self._writer.flush()  # a record every few seconds at most: a killed peer loses nothing

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def open_sink(path: str | None, tensorboard_dir: str | None = None) -> MetricsSink:
    sinks: list[MetricsSink] = [JsonLinesSink(path)] if path else []
    if tensorboard_dir:
        sinks.append(TensorBoardSink(tensorboard_dir))
    return sinks[0] if len(sinks) == 1 else FanOutSink(sinks) if sinks else NullSink()
