"""Multiaddr checks of a peer's flags that do not load hivemind: a mistyped address is reported at once, not after
seconds of imports (docs/configuration.md, "What is checked at start").

hivemind vendors py-multiaddr as ``hivemind.utils.multiaddr``, a package that needs nothing of hivemind's own (its
imports are varint, base58, netaddr, idna, cid and itself); importing it by that name imports hivemind, and with it
torch. It is loaded here by itself, under a private name, unless hivemind is already loaded.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from typing import Any

_PRIVATE_NAME = "_p2p_diloco_vendored_multiaddr"


@cache
def _multiaddr_class() -> Any:
    if "hivemind" not in sys.modules:
        try:
            return _load_vendored().Multiaddr
        except Exception:  # laid out otherwise, or a dependency missing: the slow way below says what is wrong
            sys.modules.pop(_PRIVATE_NAME, None)
    from hivemind.utils.multiaddr import Multiaddr

    return Multiaddr


def _load_vendored() -> Any:
    found = importlib.util.find_spec("hivemind")  # a top-level name: found, not imported
    folder = Path(found.origin).parent / "utils" / "multiaddr"
    spec = importlib.util.spec_from_file_location(_PRIVATE_NAME, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[_PRIVATE_NAME] = module  # its relative imports resolve against this name
    spec.loader.exec_module(module)
    return module


def check_multiaddr(text: str, need_peer_id: bool) -> str:
    """Return ``text`` if it is a valid multiaddr (with a /p2p/ peer id if asked); raise ValueError otherwise."""
    parse = _multiaddr_class()
    try:
        protocols = [p.name for p in parse(text).protocols()]
    except Exception as e:
        lines = str(e).strip().splitlines()
        raise ValueError(f"bad multiaddr {text!r}: {lines[-1].strip() if lines else type(e).__name__}") from None
    if need_peer_id and "p2p" not in protocols:
        raise ValueError(f"initial peer {text!r} lacks its /p2p/<peer id> part (copy the whole address a peer printed)")
    return text
