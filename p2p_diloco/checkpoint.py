"""Atomic checkpoints: write to a temporary file, fsync, rename; never overwrite a good file in place.

A checkpoint holds the global params, outer momentum, local params, inner optimizer state, data
position, outer step and the resolved config. Loading a corrupt file raises ``ValueError`` naming it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

_NAME = "outer_step_{:08d}.pt"


def save_atomic(directory: str | Path, outer_step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` as ``outer_step_XXXXXXXX.pt`` atomically and keep only the newest ``keep`` files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / _NAME.format(outer_step)
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    for old in sorted(directory.glob("outer_step_*.pt"))[: -max(1, keep)]:
        old.unlink(missing_ok=True)
    return target


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint {path} is unreadable or corrupt: {type(e).__name__}") from None
    if not isinstance(state, dict) or "outer_step" not in state:
        raise ValueError(f"checkpoint {path} is not a p2p-diloco checkpoint")
    return state


def newest(directory: str | Path) -> Path | None:
    files = candidates(directory)
    return files[0] if files else None


def candidates(directory: str | Path) -> list[Path]:
    """The checkpoints in ``directory``, newest first (temporary files of an interrupted save are not ones)."""
    return sorted(Path(directory).glob("outer_step_*.pt"), reverse=True)
