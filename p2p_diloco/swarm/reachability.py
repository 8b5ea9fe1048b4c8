"""Can other peers dial this one? Decide how a peer takes part when it sits behind a NAT or a firewall.

Three ways to take part:

- ``direct``: other peers can open connections to this peer's address; it averages, reduces a part of
  every all-reduce and serves its state to peers that rejoin.
- ``relay``: nobody can dial it, but a reachable peer relays for it (libp2p circuit relay v2 through
  hivemind's ``p2pd``: the peer keeps a reservation on a relay and advertises a ``/p2p-circuit`` address).
  It reduces parts and serves state, its bytes crossing the relay (but see joining.py: in our emulation its
  own rounds came back partial, so ``auto`` does not pick it). ``p2pd`` advertises no circuit address by itself
  while it is forced private with static relays, so the peer announces ``RELAY/p2p-circuit`` itself and then
  proves the reservation: a throwaway ``p2pd`` of its own (a stranger's identity, no connection to us yet)
  dials that address and must reach our handler over a relayed connection (``circuit_reaches_us``).
- ``client``: what ``auto`` picks behind a NAT, and ``relay`` is no better. It dials out only: it sends its outer gradient and receives the average
  but reduces no part (hivemind's averager client mode) and serves no state.

``auto`` (the default) asks an initial peer to *dial back*: the peer it asks opens a fresh TCP connection
to the address it sees our connection come from (our NAT's public address) on our listening ports. A
connection that gets through means ``direct``; none means a NAT or a firewall drops incoming connections,
and the peer restarts its DHT as ``client`` (``relay`` is one flag away; joining.py says why it is not the
automatic choice). libp2p's own AutoNAT needs several confirming peers and minutes, and ``p2pd`` does not
report its verdict to the client, so we ask for one dial-back instead. A probe server dials only the address the
request came from, on at most a few ports, at most once per peer per ``_PROBE_INTERVAL_S``, so it cannot
be used to scan other hosts.

This module starts DHTs (through ``swarm.start_dht``) and holds no training or averaging logic.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.p2p import PeerID

logger = logging.getLogger(__name__)

REACHABILITY = ("auto", "direct", "relay", "client")
PROBE_HANDLER = "p2p_diloco.dial_back"
CIRCUIT_HANDLER = "p2p_diloco.circuit_check"
_PROBE_INTERVAL_S = 10.0  # a probe server answers each peer at most this often
_PROBE_PORTS = 4  # ports tried per probe (our listening ports, plus the one the server sees)
_DIAL_TIMEOUT_S = 3.0
_PROBE_TIMEOUT_S = 15.0  # one whole probe, ours or one we serve
_PROBE_ATTEMPTS = 3  # rounds of asking every initial peer, within one probe's time


@dataclass(frozen=True)
class Reachability:
    """How this peer takes part, and the line a person reads at start."""

    mode: str  # "direct", "relay" or "client"
    line: str
    public_address: str | None = None  # the address a probe server saw us at (our NAT's address, if any)


# ---------------------------------------------------------------------------------------------------------
# the probe server: every peer that accepts connections answers dial-back requests


def serve_dial_back(dht: DHT) -> None:
    """Answer dial-back probes from the DHT's own process (where its ``p2pd`` client lives)."""
    dht.run_coroutine(_add_probe_handler)


async def _add_probe_handler(_dht: DHT, node: DHTNode) -> None:
    last_probe: dict[PeerID, float] = {}

    async def handle(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await asyncio.wait_for(reader.readline(), _PROBE_TIMEOUT_S) or b"{}")
            answer = await _dial_back(stream_info, request, last_probe)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except Exception as e:  # a malformed or abandoned probe: nothing to answer
            logger.debug("dial-back probe from %s failed: %r", stream_info.peer_id, e)
        finally:
            writer.close()

    await node.p2p.add_binary_stream_handler(PROBE_HANDLER, handle)


async def _dial_back(stream_info: Any, request: object, last_probe: dict[PeerID, float]) -> dict:
    now = time.monotonic()
    if now - last_probe.get(stream_info.peer_id, -_PROBE_INTERVAL_S) < _PROBE_INTERVAL_S:
        return {"error": "probed too often"}
    last_probe[stream_info.peer_id] = now
    host, observed_port = observed_endpoint(str(stream_info.addr))
    if host is None:  # a relayed or non-IP connection: no address of theirs to dial
        return {"error": f"no IP address to dial back in {stream_info.addr}"}
    ports = [p for p in (request.get("ports", []) if isinstance(request, dict) else []) if isinstance(p, int)]
    ports = sorted({p for p in [*ports[:_PROBE_PORTS], observed_port] if p and 0 < p < 65536})
    opened = [port for port, ok in zip(ports, await asyncio.gather(*(_tcp_dial(host, p) for p in ports))) if ok]
    return {"host": host, "open": opened}


def observed_endpoint(address: object) -> tuple[str | None, int | None]:
    """(IP, TCP port) of a direct TCP connection's remote address; (None, None) for a relayed one."""
    text = str(address)
    if "/p2p-circuit" in text:
        return None, None
    parts = text.strip("/").split("/")
    host = next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p in ("ip4", "ip6")), None)
    port = next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p == "tcp"), None)
    return host, int(port) if port and port.isdigit() else None


async def _tcp_dial(host: str, port: int) -> bool:
    """A fresh TCP connection to host:port opens within the timeout (closed at once: nothing is sent)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _DIAL_TIMEOUT_S)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


# ---------------------------------------------------------------------------------------------------------
# the probe client


def probe(dht: DHT, initial_peers: Sequence[str]) -> dict | None:
    """Ask the initial peers, one after another, to dial us back; their answer, or None if none answered.

    A round in which every peer failed at once (a connection not yet up just after joining, seen on a loaded
    machine) is tried again after a pause, for as long as one probe's time allows."""
    peer_ids = list(dict.fromkeys(p for p in map(_peer_id, initial_peers) if p is not None))
    ports = sorted({port for port in (_listen_port(a) for a in dht.get_visible_maddrs()) if port})
    deadline = time.monotonic() + _PROBE_TIMEOUT_S
    for attempt in range(_PROBE_ATTEMPTS):
        for peer_id in peer_ids:
            try:
                answer = dht.run_coroutine(partial(_ask, peer_id=peer_id.to_base58(), ports=ports[:_PROBE_PORTS]),
                                          return_future=True).result(timeout=_PROBE_TIMEOUT_S + 5)
            except Exception as e:  # the DHT's process did not answer in time
                answer = {"error": repr(e)}
            if isinstance(answer, dict) and "open" in answer:
                return answer
            logger.debug("dial-back probe through %s failed (attempt %d): %r", peer_id, attempt + 1, answer)
        pause = 1.0 + attempt
        if attempt == _PROBE_ATTEMPTS - 1 or time.monotonic() + pause >= deadline:
            break
        time.sleep(pause)
    return None


async def _ask(_dht: DHT, node: DHTNode, peer_id: str, ports: list[int]) -> dict:
    """Runs in the DHT's process (``run_coroutine`` pickles it: a module-level function with plain arguments). A
    failure comes back as an answer with no "open" (raised, hivemind would log it as an error with a traceback)."""
    try:
        _, reader, writer = await asyncio.wait_for(
            node.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), PROBE_HANDLER), _PROBE_TIMEOUT_S)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    try:
        writer.write(json.dumps({"ports": ports}).encode() + b"\n")
        await writer.drain()
        return json.loads(await asyncio.wait_for(reader.readline(), _PROBE_TIMEOUT_S))
    finally:
        writer.close()


def _peer_id(address: str) -> PeerID | None:
    try:
        return PeerID.from_base58(str(address).rstrip("/").split("/p2p/")[-1])
    except Exception:
        return None


def _listen_port(address: object) -> int | None:
    text = str(address)
    return None if "/p2p-circuit" in text else observed_endpoint(address)[1]


def circuit_reaches_us(dht: DHT, circuits: Sequence[str], timeout_s: float) -> str | None:
    """The first of our announced ``RELAY/p2p-circuit`` addresses through which a fresh peer reaches this one,
    or None: the relay holds no reservation for us (yet), refuses to relay, or cannot be reached."""
    for circuit in circuits:
        try:
            relayed = dht.run_coroutine(partial(_dial_own_circuit, circuit=circuit, timeout_s=timeout_s),
                                        return_future=True).result(timeout=timeout_s + 10)
        except Exception as e:
            logger.debug("checking the circuit %s failed: %r", circuit, e)
            continue
        if relayed:
            return circuit
    return None


async def _dial_own_circuit(_dht: DHT, node: DHTNode, circuit: str, timeout_s: float) -> bool:
    """Runs in the DHT's process: a throwaway p2pd bootstraps from ``circuit/p2p/<us>`` and opens a stream to
    our handler, which answers whether the stream came over a relayed connection."""
    from hivemind.p2p import P2P

    async def answer(info: Any, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"relayed\n" if "/p2p-circuit" in str(info.addr) else b"direct\n")
        await writer.drain()
        writer.close()

    await node.p2p.add_binary_stream_handler(CIRCUIT_HANDLER, answer)
    stranger = None
    try:
        stranger = await asyncio.wait_for(P2P.create(
            initial_peers=[f"{circuit}/p2p/{node.p2p.peer_id.to_base58()}"], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            use_relay=True, startup_timeout=timeout_s), timeout_s)
        _, reader, writer = await asyncio.wait_for(
            stranger.call_binary_stream_handler(node.p2p.peer_id, CIRCUIT_HANDLER), timeout_s)
        try:
            return await asyncio.wait_for(reader.readline(), timeout_s) == b"relayed\n"
        finally:
            writer.close()
    finally:
        if stranger is not None:
            await stranger.shutdown()
        await node.p2p.remove_binary_stream_handler(CIRCUIT_HANDLER)


def relay_of(circuit_address: str) -> str:
    """``/ip4/A/tcp/P/p2p/RELAY/p2p-circuit`` -> ``RELAY`` (the relay's peer id, shortened for a person)."""
    relay = circuit_address.split("/p2p-circuit")[0].rstrip("/").split("/p2p/")[-1]
    return relay if len(relay) <= 16 else f"{relay[:8]}...{relay[-6:]}"


def direct_line(addresses: Sequence[str], public_address: str | None) -> str:
    shown = [a for a in addresses if "/127." not in a and "/p2p-circuit" not in a] or list(addresses)
    seen = f" (a peer dialled back {public_address})" if public_address else ""
    return f"reachable directly at {shown[0] if shown else '?'}{seen}"
