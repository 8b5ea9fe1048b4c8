"""docs/configuration.md lists every field with its default and help: the block under "Every field" is what
``--print-config`` prints for the defaults, so that the page cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

from p2p_diloco.core.config import PeerConfig
from p2p_diloco.core.config_load import dump_toml

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_every_field_block_is_the_defaults_as_print_config_writes_them():
    text = PAGE.read_text()
    start = text.index("```toml\n", text.index("## Every field")) + len("```toml\n")
    assert text[start : text.index("```", start)] == dump_toml(PeerConfig()), "regenerate it: python peers/peer.py --print-config"
