"""Atomic checkpoints: write to a temporary file, fsync, rename; never overwrite a good file in place.

A checkpoint holds the global params, outer momentum, local params, inner optimizer state, data
position, outer step and the resolved config. Loading a corrupt file raises ``ValueError`` naming it.

A file in the checkpoint folder is untrusted input: ``load`` reads only plain torch zip archives, through
``torch.load(weights_only=True)`` (tensors and plain containers, never arbitrary pickled objects), and checks
the types, ranges and finiteness of what a learner restores. Whether the tensors fit *this* model is the
learner's check. ``check_folder`` stops a run that would write over another run's checkpoints.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

_NAME = "outer_step_{:08d}.pt"
_STARTED = time.time()  # temporary files last written before this process began are a killed writer's leftovers
_COUNTERS = ("outer_step", "outer_steps_taken", "data_position", "tokens_total")
# data order seeds are seed * 1_000_003 + data_position (data.py): counters this small keep them within int64
_MAX_COUNTER = 2**53
_MAX_NESTING = 8  # an optimizer state is a dict of dicts of tensors: deeper nesting is not ours
_MAX_NS_STEPS = 20  # Muon's Newton–Schulz steps in a checkpoint: 5 by default; more would only cost time


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
    remove_leftovers(directory)
    return target


def remove_leftovers(directory: Path, before: float | None = None) -> int:
    """Delete the temporary files of writes that never finished (a writer killed between its first byte and its
    rename leaves one the size of a checkpoint, at every kill) last written before ``before`` (default: when this
    process started: none of them is a write of ours in progress); how many."""
    removed = 0
    for leftover in directory.glob(".tmp-*.pt"):
        try:
            if leftover.stat().st_mtime < (_STARTED if before is None else before):
                leftover.unlink()
                removed += 1
        except OSError:  # gone meanwhile
            continue
    return removed


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint; any damaged, foreign or hostile file raises ValueError naming it and why."""
    path = Path(path)
    if not path.is_file():  # a named pipe would block the read, a device never end
        raise ValueError(f"checkpoint {path} is not a regular file")
    try:
        _check_archive(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint {path} is unreadable or corrupt: {type(e).__name__}") from None
    if not isinstance(state, dict) or "outer_step" not in state:
        raise ValueError(f"checkpoint {path} is not a p2p-diloco checkpoint")
    problem = _contents_problem(state)
    if problem:
        raise ValueError(f"checkpoint {path} is damaged: {problem}")
    return state


def _check_archive(path: Path) -> None:
    """torch.save writes a zip of uncompressed entries. Refuse anything else before torch reads it: the legacy
    (pre-zip) format allocates whatever storage size the file declares, and a compressed entry can declare far
    more bytes than the file holds."""
    with zipfile.ZipFile(path) as archive:
        entries = archive.infolist()
    if any(e.compress_type != zipfile.ZIP_STORED for e in entries) or sum(e.file_size for e in entries) > path.stat().st_size:
        raise ValueError("not a plain torch archive")


def _contents_problem(state: dict) -> str | None:
    """What is wrong with the fields a learner restores (those present; missing ones are the learner's to
    report), or None. Catches a file with the right keys but wrong contents here, with its name, instead of as
    an AttributeError at resume or a NaN or shape error at the first inner step."""
    for key in _COUNTERS:
        value = state.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_COUNTER:
            return f"{key} is {str(value)[:40]!r}, not a count"
    sha = state.get("global_sha256", "0" * 64)
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        return "global_sha256 is not a sha256 hex digest"
    for key in ("global_params", "momentum"):
        tensors = state.get(key, [])
        if not isinstance(tensors, list | tuple) or not all(isinstance(t, torch.Tensor) for t in tensors):
            return f"{key} is not a list of tensors"
    unsynced = state.get("unsynced_by_fragment", [])
    if not isinstance(unsynced, list | tuple) or not all(isinstance(t, int) and 0 <= t <= _MAX_COUNTER for t in unsynced):
        return "unsynced_by_fragment is not a list of counts"
    local = state.get("local_model", {})
    if not isinstance(local, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in local.items()):
        return "local_model is not a dict of named tensors"
    problem = _optimizer_problem(state["inner_optimizer"], list(local.values())) if "inner_optimizer" in state else None
    if problem:
        return problem
    if not all(_finite(state.get(key)) for key in ("global_params", "momentum", "local_model", "inner_optimizer")):
        return "it holds non-finite values"
    return None


def _optimizer_problem(inner: Any, local: list[torch.Tensor]) -> str | None:
    """torch's Optimizer.load_state_dict checks only how many groups and params there are; what a group or a
    param's state holds is first used at the next step (a string lr, a missing exp_avg, an exp_avg of another
    shape, capturable=True on a CPU all raise there). Checked against what the learner's inner optimizer writes
    (train/inner_optimizer.py): AdamW with torch's defaults but lr and weight_decay, or MuonAdamW's one group per
    param; one state per local param (state i belongs to local param i)."""
    if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) or not isinstance(inner.get("param_groups"), list):
        return "inner_optimizer is not an optimizer state"
    if not all(_adamw_group_ok(group) or _muon_group_ok(group) for group in inner["param_groups"]):
        return "inner_optimizer has a parameter group that the learner's optimizer does not write"
    indices = sorted(i for group in inner["param_groups"] for i in group["params"])
    if local and indices != list(range(len(local))):
        return "inner_optimizer covers other parameters than the local model's"
    marked = [isinstance(group, dict) and "use_muon" in group for group in inner["param_groups"]]
    if any(marked) and not all(marked):  # MuonAdamW marks every group; AdamW none
        return "inner_optimizer mixes the groups of two optimizers"
    muon = {i for group in inner["param_groups"] if group.get("use_muon") is True for i in group["params"]}
    if local and any(local[i].ndim != 2 for i in muon):
        return "inner_optimizer steps a parameter that is not a matrix with Muon"
    for index, param_state in inner["state"].items():
        if not isinstance(index, int) or index not in indices or not isinstance(param_state, dict) or not _number(param_state.get("step"), 0):
            return f"inner_optimizer holds a bad state for parameter {str(index)[:20]}"
        for name in ("momentum_buffer",) if index in muon else ("exp_avg", "exp_avg_sq"):
            value = param_state.get(name)
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or (local and value.shape != local[index].shape):
                return f"inner_optimizer {name} of parameter {index} does not match the local model"
            if index in muon and value.ndim != 2:
                return f"inner_optimizer {name} of parameter {index} is not a matrix"
    return None


def _adamw_group_ok(group: Any) -> bool:
    if not isinstance(group, dict) or not isinstance(group.get("params"), list) or group.get("use_muon", False) is not False:
        return False
    betas = group.get("betas")
    return (
        _indices_ok(group["params"])
        and _number(group.get("lr"), 0, strict=True) and _number(group.get("eps"), 0) and _number(group.get("weight_decay"), 0)
        and isinstance(betas, list | tuple) and len(betas) == 2 and all(_number(b, 0) and b < 1 for b in betas)
        # other code paths than ours (amsgrad needs state we never write; capturable fails on a CPU)
        and all(group.get(flag, False) is False for flag in ("amsgrad", "maximize", "capturable", "differentiable"))
        and all(group.get(flag) in (None, True, False) for flag in ("foreach", "fused", "decoupled_weight_decay"))
    )


def _muon_group_ok(group: Any) -> bool:
    """A MuonAdamW group of a Muon param: the Newton–Schulz steps bounded (each is a few matrix products)."""
    if not isinstance(group, dict) or not isinstance(group.get("params"), list) or group.get("use_muon") is not True:
        return False
    steps = group.get("ns_steps")
    return (
        _indices_ok(group["params"]) and _number(group.get("lr"), 0, strict=True)
        and _number(group.get("weight_decay"), 0) and _number(group.get("momentum"), 0) and group["momentum"] < 1
        and group.get("nesterov") in (True, False)
        and isinstance(steps, int) and not isinstance(steps, bool) and 1 <= steps <= _MAX_NS_STEPS
    )


def _indices_ok(params: list) -> bool:
    return all(isinstance(i, int) and not isinstance(i, bool) for i in params)


def _number(value: Any, minimum: float, strict: bool = False) -> bool:
    """A finite real number (or one-value tensor) >= ``minimum`` (> if ``strict``)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            return False
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value > minimum if strict else value >= minimum


def _finite(value: Any, depth: int = 0) -> bool:
    """Every float and floating-point tensor in ``value`` (nested containers included) is finite."""
    if depth > _MAX_NESTING:
        return False
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_finite(v, depth + 1) for v in value)
    return True


def check_folder(directory: str | Path, resume: bool) -> None:
    """Before a run starts: checkpoints can be written to ``directory``, and a run that does not resume would
    not write over checkpoints already there (its outer steps restart at 0, and save_atomic keeps only the
    newest few, so another run's files would be replaced or deleted). Raises ValueError saying how to fix it."""
    path = Path(directory)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "it is not a folder" if existing == path else f"{existing} is not a folder"
        raise ValueError(f"checkpoint folder {path} cannot be used: {where}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"checkpoint folder {path}: no permission to write in {existing}")
    found = candidates(path) if existing == path else []
    if found and not resume:
        raise ValueError(
            f"checkpoint folder {path} already holds checkpoints (newest {found[0].name}): "
            "pass --resume to continue from them, or choose another --checkpoint-dir"
        )


def newest(directory: str | Path) -> Path | None:
    files = candidates(directory)
    return files[0] if files else None


def candidates(directory: str | Path) -> list[Path]:
    """The checkpoints in ``directory``, newest first (temporary files of an interrupted save are not ones)."""
    return sorted(Path(directory).glob("outer_step_*.pt"), reverse=True)
