"""Config precedence: defaults -> TOML file -> flags."""

from __future__ import annotations

from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, resolve_config


def test_config_file_is_read_and_flags_override_it(tmp_path):
    config = tmp_path / "peer.toml"
    config.write_text('[inner]\ninner_steps = 7\nlr = 0.002\n[swarm]\ncompression = "fp16"\n')
    parser = OneLineParser(prog="t")
    parser.add_argument("--config")
    add_peer_flags(parser)
    resolved = resolve_config(parser.parse_args(["--config", str(config), "--inner-steps", "9"]))
    assert (resolved.inner.inner_steps, resolved.inner.lr, resolved.swarm.compression) == (9, 0.002, "fp16")
