"""The hivemind this package is written against, and what of it the rest of the package reaches through here.

swarm/ is the only layer that imports hivemind (a test checks it). Several of its modules subclass or reach into
hivemind's private API, which only this version is known to have; ``check_version`` fails with a clear message
anywhere else, before a peer joins a swarm (``join_swarm``). Where the private API is used:

- averaging.py: ``AllReduceRunner._communicate_with_peer``, ``_accumulate_parts_streaming``, ``_ban_sender``,
  ``tensor_part_container`` / ``tensor_part_reducer`` internals; ``DecentralizedAverager._run_allreduce_inplace_``,
  ``_load_state_from_peers`` (copied with an exclusion list), ``_matchmaking`` (group key and target size,
  ``GroupKeyManager.get_averagers`` paced, ``min_matchmaking_time``), ``_outer_pipe``; ``StepControl`` cancelling
  (mark, then wake).
- wire.py: the codec registry ``compression.serialization._BASE_COMPRESSION_TYPES`` (our codecs, and wire_guard.py's
  checked decoder for hivemind's raw type).
- guarded.py: ``TensorPartReducer`` accumulation, ``TensorPartContainer._input_parts_by_peer`` and
  ``register_processed_part``; ``Matchmaking._request_join_group``; ``rpc_join_group`` / ``rpc_aggregate_part`` /
  ``rpc_download_state`` overrides.
- progress.py: ``DHTProtocol.call_store`` / ``call_ping``, ``routing_table``, ``storage``, ``record_validator``,
  ``node.blacklist`` and the p2p daemon client (pushed records, rejoining).
- reachability.py, joining.py, membership.py: p2pd flags, ``P2P`` handlers, record validators.
- future_pipes.py: ``MPFuture.__getstate__`` / ``__setstate__``, ``_global_sender_pipe``, the ``_outer_pipe`` of the
  DHT and the averager.
- p2p_writes.py: ``p2p_daemon_bindings`` ``write_pbmsg`` (in ``utils`` and ``control``) and ``P2P.send_protobuf``.
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types

SUPPORTED_VERSION = "1.1.12"
# what a call into hivemind's processes raises when it fails: its futures raise asyncio's CancelledError, a
# BaseException, for a step or request cancelled on the other side (an averaging thread once died of it, and its
# learner waited for that round forever). Background threads and the training loop catch this, not Exception alone
CALL_FAILED: tuple[type[BaseException], ...] = (Exception, asyncio.CancelledError)


def check_version() -> None:
    """Raise RuntimeError with what to do when the installed hivemind is not the one this package subclasses."""
    import hivemind

    found = getattr(hivemind, "__version__", "unknown")
    if found != SUPPORTED_VERSION:
        raise RuntimeError(f"p2p-diloco needs hivemind=={SUPPORTED_VERSION} (it subclasses hivemind's private averaging "
                           f"and DHT internals, swarm/hivemind_api.py); found {found}: pip install hivemind=={SUPPORTED_VERSION}")


def route_logs(debug: bool) -> None:
    """Send hivemind's log records through the root logger (one format, one stream); below DEBUG, its warnings only."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(logging.DEBUG if debug else logging.WARNING)


def is_libp2p_key(data: bytes) -> bool:
    """Whether ``data`` is a libp2p private key, as hivemind itself parses an identity file."""
    from hivemind.p2p import PeerID

    try:
        PeerID.from_identity(data)
    except Exception:
        return False
    return True


# imported by hivemind for what no peer of ours runs: scipy.optimize (~0.45 CPU s of a peer's ~5 s of imports) for
# the averager's bandwidth balancer (hivemind/averaging/load_balancing.py), which calls it only for peers that declare
# a bandwidth; ours never do. Each loads at its first use instead (load_on_first_use)
UNUSED_IMPORTS = ("scipy.optimize",)


class _LoadsOnFirstUse(types.ModuleType):
    """Stands in ``sys.modules`` for a module not imported yet: the attributes an import sets (``__file__``,
    ``__spec__``, ``__path__``...) are its own, so that a scan of ``sys.modules`` (``inspect.getmodule``, which torch
    runs as it registers operators) loads nothing; any other attribute imports the module, then is the module's."""

    def __init__(self, spec: importlib.machinery.ModuleSpec):
        super().__init__(spec.name)
        self.__spec__, self.__loader__, self.__file__, self.__package__ = spec, spec.loader, spec.origin, spec.parent
        if spec.submodule_search_locations is not None:
            self.__path__ = list(spec.submodule_search_locations)

    def __getattr__(self, attribute: str) -> object:
        name = self.__spec__.name
        with _LOADING:
            if sys.modules.get(name) is self:
                del sys.modules[name]
            module = importlib.import_module(name)  # in sys.modules and on its package from now on
        return getattr(module, attribute)


_LOADING = threading.RLock()  # the module's own import may reach its stand-in (through its package)


def load_on_first_use(name: str) -> None:
    """Import module ``name`` (of a package that is imported now) only when one of its attributes is first read;
    nothing if it is imported already or not installed."""
    if name in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return
    if spec is None:
        return
    stand_in = _LoadsOnFirstUse(spec)
    sys.modules[name] = stand_in
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, stand_in)
