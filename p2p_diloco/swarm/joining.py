"""Joining the swarm: start this peer's DHT (and its ``p2pd``) in the way its network allows.

``join_swarm`` starts the DHT as a directly reachable peer, asks an initial peer to dial back
(``reachability.probe``) and, if nothing gets through, restarts it in client mode (see ``join_swarm`` for
why not behind a relay). What it decided comes back as a ``Reachability`` whose line the peer prints at
start. A mode given by the user (``--reachability direct|relay|client``) is used as is, without probing;
relay mode waits up to ``relay_wait_s`` for its relay to carry a stranger's dial. This module holds no
progress, averaging or training logic.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from hivemind import DHT
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.core.config import SwarmConfig
from p2p_diloco.swarm import future_pipes, p2p_writes
from p2p_diloco.swarm.hivemind_api import check_version
from p2p_diloco.swarm.reachability import (
    Reachability,
    circuit_reaches_us,
    direct_line,
    probe,
    relay_of,
    serve_dial_back,
)

logger = logging.getLogger(__name__)
_BOOTSTRAP_ATTEMPTS = 3


class SwarmStartError(RuntimeError):
    """The peer could not join or start the swarm (bad address, unreachable peers, identity in use)."""


class _PeerDHT(DHT):
    """hivemind's DHT process, which leaves SIGTERM to its peer (see DilocoAverager.run): a SIGTERM sent to
    the whole process group must not take the DHT away from a peer that is saving and leaving.

    ``p2pd_flags`` are added to the ``p2pd`` command line: hivemind's ``P2P.create`` has no parameter for
    some of them (``-relayService``), so its argument builder is wrapped, in this DHT's own process only."""

    p2pd_flags: dict[str, Any] = {}
    p2pd_env: dict[str, str] = {}  # set in this DHT's process, which starts p2pd: its child inherits them

    def run(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.environ.update(self.p2pd_env)
        if self.p2pd_flags:
            build, extra = P2P._make_process_args, dict(self.p2pd_flags)
            P2P._make_process_args = staticmethod(lambda *args, **flags: build(*args, **{**flags, **extra}))
        super().run()


def dht_options(config: SwarmConfig, mode: str) -> tuple[dict, dict]:
    """(hivemind DHT/P2P keyword arguments, extra ``p2pd`` flags) for one way of taking part."""
    options: dict[str, Any] = {}
    if mode == "relay":
        # reserve a slot on a relay and advertise /p2p-circuit addresses; "private" starts that at once
        # instead of waiting for libp2p's AutoNAT to agree (several peers, minutes)
        options.update(use_auto_relay=True, force_reachability="private")
        # named relays are "static" (-relayDiscovery=0 below): libp2p reserves with them at once, where relays
        # it finds by itself wait for 4 candidates or a 3-minute boot delay
        options["trusted_relays"] = list(config.relays or config.initial_peers)
        # p2pd, forced private, advertises no /p2p-circuit address of its own: announce one per relay (proven
        # by reachability.circuit_reaches_us before the peer calls itself relayed)
        options["announce_maddrs"] = [*config.announce_maddrs, *circuit_addresses(config)]
    elif mode == "client":
        options.update(client_mode=True)  # the DHT and the averager accept no incoming requests
    else:
        # libp2p starts its relay service only once it believes itself public, which its AutoNAT would take
        # minutes to decide (if ever, in a small swarm): say so at once. In auto mode a probe that fails
        # restarts the DHT as "client" a few seconds later.
        options.update(force_reachability="public")
    flags = {} if config.relay_service and mode == "direct" else {"relayService": False}
    if mode == "relay":
        flags["relayDiscovery"] = False  # p2pd uses the trusted relays as static ones only without discovery
    return options, flags


def p2pd_env(config: SwarmConfig) -> dict[str, str]:
    """Environment for ``p2pd``: ``GOMAXPROCS`` from ``--p2pd-threads`` (0 leaves Go's default). With one Go thread
    per core, Go's scheduler spins looking for work whenever a message wakes it, CPU that on a machine whose cores
    all train comes from the training (docs/benchmarks.md, "Where a peer's time goes")."""
    return {"GOMAXPROCS": str(config.p2pd_threads)} if config.p2pd_threads > 0 else {}


def circuit_addresses(config: SwarmConfig) -> list[str]:
    """``RELAY/p2p-circuit`` for each relay this peer would use (the relays, or else the initial peers)."""
    return [f"{relay.rstrip('/')}/p2p-circuit" for relay in (config.relays or config.initial_peers)]


def start_dht(
    config: SwarmConfig, record_validators: Sequence[Any] = (), mode: str = "direct", check_identity: bool = True
) -> DHT:
    """Start this peer's DHT (and its ``p2pd``); raise SwarmStartError with a one-line reason."""
    p2p_writes.install()  # before the DHT's process (and later the averager's) is forked: they inherit it
    options, flags = dht_options(config, mode)
    kwargs = dict(
        record_validators=list(record_validators),
        initial_peers=list(config.initial_peers),
        host_maddrs=list(config.host_maddrs),
        start=False,  # started below, once p2pd_flags are set
        # every record we read we read again each progress period, so hivemind's extra copies are pure traffic:
        # no pushing what we found to the nearest node (cache_nearest), no re-reading before expiry
        cache_nearest=0,
        cache_refresh_before_expiry=0,
        **options,
    )
    if config.announce_maddrs and "announce_maddrs" not in kwargs:
        kwargs["announce_maddrs"] = list(config.announce_maddrs)
    if config.identity_path:
        kwargs["identity_path"] = config.identity_path
        # after a restart in another mode our own old p2pd may still be remembered as holding the identity
        kwargs["check_if_identity_free"] = check_identity
    previous_sigint = signal.getsignal(signal.SIGINT)
    try:
        # a busy bootstrap peer can miss p2pd's short dial window: retry a few times, then give up with the reason
        for attempt in range(_BOOTSTRAP_ATTEMPTS):
            dht = None
            try:
                future_pipes.before_fork()
                dht = _PeerDHT(**kwargs)
                future_pipes.to_child(dht._outer_pipe)  # the trainer's calls go without their answer's pipe
                dht.p2pd_flags = flags
                dht.p2pd_env = p2pd_env(config)
                dht.run_in_background(await_ready=False)
                dht.wait_until_ready(timeout=config.startup_timeout_s)
                return dht
            except Exception as e:
                if dht is not None and dht.is_alive():
                    dht.shutdown()
                reason = first_line(e) or f"DHT did not start within {config.startup_timeout_s} s"
                if "bootstrap" not in reason or attempt == _BOOTSTRAP_ATTEMPTS - 1:
                    raise SwarmStartError(reason) from None
                logger.warning("could not reach the initial peers (attempt %d): retrying", attempt + 1)
                time.sleep(1.0 + 2 * attempt)
    finally:
        signal.signal(signal.SIGINT, previous_sigint)  # hivemind ignores SIGINT in the caller (docs/design.md §6)
    raise AssertionError("unreachable")


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[-1].strip() if text else type(error).__name__


def join_swarm(config: SwarmConfig, record_validators: Sequence[Any] = ()) -> tuple[DHT, Reachability]:
    """Start the DHT in the best way this peer's network allows (see the module docstring)."""
    try:
        check_version()
    except RuntimeError as e:
        raise SwarmStartError(str(e)) from None
    if config.reachability in ("relay", "client"):
        dht = start_dht(config, record_validators, config.reachability)
        return dht, _settle(dht, config, config.reachability)
    dht = start_dht(config, record_validators, "direct")
    serve_dial_back(dht)
    addresses = [str(a) for a in dht.get_visible_maddrs()]
    if config.reachability == "direct":
        return dht, Reachability("direct", direct_line(addresses, None) + " (--reachability direct: not checked)")
    if not config.initial_peers:
        return dht, Reachability("direct", direct_line(addresses, None) + " (first peer: nobody to dial back yet)")
    answer = probe(dht, config.initial_peers)
    if answer is None:
        return dht, Reachability("direct", direct_line(addresses, None)
                                 + " (not checked: no initial peer answered a dial-back probe)")
    seen = f"{answer.get('host')}"
    if answer["open"]:
        port = answer["open"][0]
        return dht, Reachability("direct", direct_line(addresses, f"{seen}:{port}"), f"{seen}:{port}")
    logger.info("a dial-back to %s on ports %s did not get through: behind a NAT or firewall", seen,
                [p for p in (answer.get("open") or [])] or "tried")
    dht.shutdown()
    # client mode, not relay: in our emulation a relayed peer's own rounds came back partial every time (a
    # stream across the relay was reset) and it healed by a state download each round, at twice the bytes and
    # time per averaging of a client's clean rounds. Relay mode stays one flag away (--reachability relay)
    dht = start_dht(config, record_validators, "client", check_identity=False)
    return dht, _settle(dht, config, "client", public_address=seen)


def _settle(dht: DHT, config: SwarmConfig, mode: str, public_address: str | None = None) -> Reachability:
    """In relay mode, wait (bounded) until a stranger's dial reaches us through a relay; the line a person reads."""
    behind = f"behind NAT (seen from outside as {public_address})" if public_address else "behind NAT"
    if mode == "client":
        return Reachability("client", f"client mode: {behind}; this peer dials out only: it "
                            "sends its outer gradient and receives the average, but reduces no part and serves no state",
                            public_address)
    deadline = time.monotonic() + config.relay_wait_s
    own = f"/p2p/{dht.peer_id.to_base58()}"
    while time.monotonic() < deadline:
        circuit = circuit_reaches_us(dht, circuit_addresses(config), max(1.0, min(10.0, deadline - time.monotonic())))
        if circuit:
            return Reachability("relay", f"{behind}: reachable through relay {relay_of(circuit)} at {circuit}{own}",
                                public_address)
        time.sleep(1.0)
    # asked for by the user (auto never comes here): p2pd keeps asking its relays in the background, say so
    return Reachability("relay", f"{behind}: no relay carried a stranger's dial to this peer within "
                        f"{config.relay_wait_s:.0f} s; p2pd keeps asking the relays (others cannot dial this "
                        "peer until one answers)", public_address)


def peer_ids_in(addresses: Sequence[str]) -> list[str]:
    """The peer ids in multiaddrs' /p2p/ parts (malformed ones skipped)."""
    found = []
    for address in addresses:
        try:
            found.append(str(Multiaddr(address)["p2p"]))
        except Exception:
            continue
    return found
