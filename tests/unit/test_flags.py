"""One declaration per knob: the parser is generated from the config dataclasses, and the two agree field by
field; every field is settable from a flag and from TOML; ``dump_toml`` writes a file that reads back the same;
the example files in peers/ are valid configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, flag_fields, overrides_from
from p2p_diloco.core.config import SECTION_CLASSES, PeerConfig, flag_of
from p2p_diloco.core.config_load import build_config, dump_toml, load_toml

PEERS = Path(__file__).resolve().parents[2] / "peers"
ALL_FIELDS = [(section, spec) for section, cls in SECTION_CLASSES.items() for spec in dataclasses.fields(cls)]


def _parser() -> OneLineParser:
    parser = OneLineParser(prog="t")
    parser.add_argument("--config")
    add_peer_flags(parser)
    return parser


def _other_value(spec: dataclasses.Field) -> tuple[list[str], object]:
    """A value unlike the default, as flag words and as the field holds it."""
    default, choices = spec.default, spec.metadata.get("choices")
    if choices:
        value = next(c for c in choices if c != default)
        return [value], value
    if isinstance(default, bool):
        return [], not default
    if isinstance(default, tuple):
        return ["/ip4/10.0.0.1/tcp/1", "/ip4/10.0.0.2/tcp/2"], ("/ip4/10.0.0.1/tcp/1", "/ip4/10.0.0.2/tcp/2")
    if isinstance(default, int):
        return [str(default + 3)], default + 3
    if isinstance(default, float):
        return [repr(default + 0.25)], default + 0.25
    return ["some-value"], "some-value"


def test_every_field_has_exactly_one_flag_and_every_flag_one_field():
    table = flag_fields()
    assert sorted(table.values()) == sorted((section, spec.name) for section, spec in ALL_FIELDS)
    parser_flags = {a.dest for a in _parser()._actions} - {"help", "config"}
    assert parser_flags == set(table)


@pytest.mark.parametrize(("section", "spec"), ALL_FIELDS, ids=[f"{s}.{f.name}" for s, f in ALL_FIELDS])
def test_each_flag_sets_its_own_field_and_nothing_else(section, spec):
    words, value = _other_value(spec)
    flag = flag_of(spec)
    if isinstance(spec.default, bool):
        flag = flag if value else "--no-" + flag[2:]
    overrides = overrides_from(_parser().parse_args([flag, *words]))
    assert overrides == {section: {spec.name: value}}


def test_a_flag_not_given_leaves_the_files_value(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text('[inner]\ninner_steps = 7\nlr = 0.002\n[run]\nresume = true\ncheckpoint_dir = "c"\n')
    overrides = overrides_from(_parser().parse_args(["--config", str(path), "--inner-steps", "9", "--no-resume"]))
    config = build_config(overrides)
    assert (config.inner.inner_steps, config.inner.lr, config.run.resume) == (9, 0.002, False)


def test_help_shows_every_fields_description_and_default():
    text = " ".join(_parser().format_help().split())
    for _section, spec in ALL_FIELDS:
        assert " ".join(spec.metadata["help"].split()) in text, spec.name


def test_dump_toml_reads_back_as_the_same_config(tmp_path):
    changed = build_config({
        "inner": {"inner_steps": 7, "precision": "bf16"},
        "swarm": {"initial_peers": ["/ip4/10.0.0.1/tcp/1/p2p/QmX"], "relay_service": False, "run_id": "x-1"},
        "run": {"checkpoint_dir": 'a "quoted" path', "max_time_s": 12.5},
    })
    for config in (PeerConfig(), changed):
        path = tmp_path / "dumped.toml"
        path.write_text(dump_toml(config))
        assert build_config(load_toml(path)) == config


@pytest.mark.parametrize("name", ["laptop.toml", "gpu.toml", "closed-run.toml"])
def test_the_example_files_in_peers_are_valid_configs(name):
    config = build_config(load_toml(PEERS / name))
    assert config != PeerConfig()  # each says something
