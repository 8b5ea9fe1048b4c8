"""The peer's flags, generated from the config dataclasses (core/config.py): one flag per field, its help and
default from the field's declaration. ``resolve_config`` applies defaults -> ``--config`` TOML file -> flags."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from p2p_diloco.core.config import SECTION_CLASSES, PeerConfig, flag_of
from p2p_diloco.core.config_load import build_config, load_toml

_GROUP_TITLES = {
    "model": "model",
    "data": "data",
    "inner": "inner optimizer and rounds",
    "outer": "outer optimizer",
    "swarm": "swarm",
    "run": "run",
}


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints the whole usage; a person needs the reason
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def flag_fields() -> dict[str, tuple[str, str]]:
    """argparse destination -> (section, field), for every field of every section."""
    table = {}
    for section, cls in SECTION_CLASSES.items():
        for spec in dataclasses.fields(cls):
            table[flag_of(spec)[2:].replace("-", "_")] = (section, spec.name)
    return table


def _default_text(value: Any) -> str:
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return " ".join(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _metavar(name: str, default: Any) -> str | None:
    if isinstance(default, int):
        return "N"
    if isinstance(default, float):
        return "SECONDS" if name.endswith("_s") else "X"
    return "TEXT" if isinstance(default, str) else None


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of one learner island (also accepted by the local swarm launcher, passed to every peer). A flag not
    given is absent from the namespace, so that a TOML file's value is not overridden by a default."""
    for section, cls in SECTION_CLASSES.items():
        group = parser.add_argument_group(_GROUP_TITLES[section], f"[{section}] in a --config file")
        for spec in dataclasses.fields(cls):
            meta, default = spec.metadata, spec.default
            shown = _default_text(default)  # unless the help says what the default means already: "(0: no limit)"
            help = meta["help"] if f"({shown}:" in meta["help"] else f"{meta['help']} (default {shown})"
            options: dict[str, Any] = dict(default=argparse.SUPPRESS, help=help.replace("%", "%%"))
            if isinstance(default, bool):
                options["action"] = argparse.BooleanOptionalAction
            else:
                if isinstance(default, tuple):
                    options["nargs"] = "+"
                elif isinstance(default, int | float):
                    options["type"] = type(default)
                if meta.get("choices"):
                    options["choices"] = meta["choices"]
                else:
                    options["metavar"] = meta.get("metavar") or _metavar(spec.name, default)
            group.add_argument(flag_of(spec), **options)


def overrides_from(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``{section: {field: value}}``: the TOML file's values, then the flags given over them."""
    overrides: dict[str, dict[str, Any]] = load_toml(args.config) if getattr(args, "config", None) else {}
    overrides = {section: dict(values) for section, values in overrides.items()}
    for flag, (section, name) in flag_fields().items():
        if flag in vars(args):
            value = getattr(args, flag)
            overrides.setdefault(section, {})[name] = tuple(value) if isinstance(value, list) else value
    return overrides


def resolve_config(args: argparse.Namespace) -> PeerConfig:
    """defaults -> TOML file -> flags; raises ValueError with a one-line reason."""
    config = build_config(overrides_from(args))
    # torch and hivemind load only for the checks that need them (a checkpoint folder, say): a mistyped value is
    # reported at once, not after seconds of imports
    from p2p_diloco.cli.preflight import check_local_inputs
    from p2p_diloco.swarm.addresses import check_multiaddr

    for address in config.swarm.initial_peers + config.swarm.relays:
        check_multiaddr(address, need_peer_id=True)
    for address in config.swarm.host_maddrs + config.swarm.announce_maddrs:
        check_multiaddr(address, need_peer_id=False)
    check_local_inputs(config)  # identity file, checkpoint folder, metrics file, memory: before anything starts
    return config
