"""A ``PeerConfig`` from ``{section: {field: value}}`` (a TOML file, flags), and back to TOML.

Every value is type-checked against its field's default and bounded before a section validates it, so that a typo
in a file or a flag is one line naming the key, never a value that overflows somewhere deep inside a running peer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from p2p_diloco.core.config import SECTION_CLASSES, PeerConfig, show

# Bounds on any value from a file or a flag: larger numbers are typos, and overflow the int64, float timer and
# msgpack fields they end up in (e.g. threading's TIMEOUT_MAX is ~9.2e9 s) somewhere deep inside a running peer.
_MAX_NUMBER = 2**53
_MAX_SECONDS = 1e8  # about 3 years: bound on every *_s duration
_MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; this bounds what a wrong path (/dev/zero) reads


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def build_config(overrides: dict[str, dict[str, Any]]) -> PeerConfig:
    """Build a PeerConfig from ``{section: {field: value}}``; unknown names raise ValueError."""
    sections = {}
    for name, cls in SECTION_CLASSES.items():
        section = overrides.get(name, {})
        _require(isinstance(section, dict), f"config section [{name}] must be a table, got {type(section).__name__}")
        values = dict(section)
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(str(key) for key in set(values) - set(known))
        _require(not unknown, f"unknown key(s) in [{name}]: {', '.join(unknown)}")
        for key, value in values.items():
            if isinstance(value, list):
                values[key] = tuple(value)
            _check_type(name, key, known[key], values[key])
        sections[name] = cls(**values)
    unknown_sections = sorted(str(key) for key in set(overrides) - set(SECTION_CLASSES))
    _require(not unknown_sections, f"unknown config section(s): {', '.join(unknown_sections)}")
    return PeerConfig(**sections)


def _check_type(section: str, key: str, spec: dataclasses.Field, value: Any) -> None:
    default = spec.default if spec.default is not dataclasses.MISSING else None
    if default is None:  # optional fields (paths) take None or a string
        _require(
            value is None or (isinstance(value, str) and "\x00" not in value),
            f"{section}.{key} must be a path (a string), got {show(value)}",
        )
        return
    _require(value is not None, f"{section}.{key} must be set (got no value)")
    expected: tuple[type, ...] = (type(default),)
    if isinstance(default, float):
        expected = (float, int)
    if isinstance(default, bool) or isinstance(value, bool):
        expected = (bool,) if isinstance(default, bool) else expected
        _require(isinstance(value, bool) == isinstance(default, bool), f"{section}.{key} has the wrong type")
    _require(
        isinstance(value, expected),
        f"{section}.{key} must be of type {type(default).__name__}, got {type(value).__name__} ({show(value)})",
    )
    if isinstance(value, tuple):
        _require(all(isinstance(v, str) for v in value), f"{section}.{key} must be a list of strings, got {show(value)}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        # NaN fails the sections' range checks anyway, but inf passes "> 0" and then sleeps, times out or trains forever
        _require(
            _is_finite(value) and abs(value) <= _MAX_NUMBER,
            f"{section}.{key} must be a finite number within +-2**53, got {show(value)}",
        )
        _require(not key.endswith("_s") or value <= _MAX_SECONDS, f"{section}.{key} must be <= {_MAX_SECONDS:.0e} s, got {value}")


def _is_finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a TOML config file into ``{section: {field: value}}``; raises ValueError with the reason."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror or e}") from None
    _require(len(raw) <= _MAX_CONFIG_BYTES, f"config file {path} is larger than {_MAX_CONFIG_BYTES >> 20} MiB: not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"config file {path} is not UTF-8 text") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ValueError(f"config file {path} nests arrays or tables too deeply") from None
    for section, values in data.items():
        _require(isinstance(values, dict), f"config file {path}: '{section}' must be a [table]")
    return data


def dump_toml(config: PeerConfig) -> str:
    """The whole config as a TOML file, every field with its help as a comment; ``load_toml`` reads it back to
    the same config (an unset path is a commented-out line: TOML has no null)."""
    lines: list[str] = []
    for name in SECTION_CLASSES:
        section = getattr(config, name)
        lines += ["", f"[{name}]"] if lines else [f"[{name}]"]
        for spec in fields(section):
            lines.append(f"# {spec.metadata['help']}")
            value = getattr(section, spec.name)
            lines.append(f"# {spec.name} = \"\"" if value is None else f"{spec.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: the same escapes as JSON's
    return repr(value)
