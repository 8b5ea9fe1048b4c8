"""Each message to ``p2pd`` in one write: hivemind's daemon bindings frame a message in pieces, each its own write.

A Python process talks to its ``p2pd`` over a Unix socket: the DHT's requests and answers go on one persistent
connection as length-prefixed protobufs (``write_pbmsg``), an averaging's parts on a stream each (``send_protobuf``: a
marker byte, an 8-byte length, the payload). hivemind 1.1.12 writes the length's varint one byte at a time, each with
its own ``drain``, then the body; and a stream message as marker, length and 64 KiB chunks. asyncio sends at once
whatever it is given while its buffer is empty, so one small message is 3-4 ``send`` calls, and ``p2pd`` wakes and
reads for each piece. In a peer's DHT process about a sixth of the CPU samples were in that varint loop
(docs/benchmarks.md, "Where a peer's time goes").

``install`` replaces both with framings that put the same bytes on the socket in one write. It runs in the trainer's
process before the DHT and the averager are forked (``start_dht``), so their processes inherit it; installing it
again changes nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

_hivemind: dict[str, Any] = {}  # hivemind's own framings, kept by ``install`` (the tests compare the bytes)


def varint(value: int) -> bytes:
    """``value`` as an unsigned LEB128 varint (protobuf's length prefix, as hivemind's ``write_unsigned_varint``)."""
    if value < 0:
        raise ValueError(f"negative integer: {value}")
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | 0x80 if value else byte)
        if not value:
            return bytes(out)


async def write_pbmsg(stream: asyncio.StreamWriter, pbmsg: Any) -> None:
    """hivemind's ``write_pbmsg``, in one write: the body's length as a varint, then the body."""
    body = pbmsg.SerializeToString()
    stream.write(varint(len(body)) + body)
    await stream.drain()


def stream_frame(protobuf: Any) -> bytes:
    """What hivemind's ``P2P.send_protobuf`` writes for ``protobuf``: its marker (an error or a message), the payload's
    length in ``P2P.HEADER_LEN`` bytes, the payload."""
    from hivemind.p2p.p2p_daemon import P2P, RPCError

    marker = P2P.ERROR_MARKER if isinstance(protobuf, RPCError) else P2P.MESSAGE_MARKER
    data = protobuf.SerializeToString()
    return marker + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data


async def send_protobuf(protobuf: Any, writer: asyncio.StreamWriter) -> None:
    """hivemind's ``P2P.send_protobuf``, in one write (a part's payload is copied once into the frame)."""
    writer.write(stream_frame(protobuf))
    await writer.drain()


def hivemind_framings() -> dict[str, Any]:
    """hivemind's own ``write_pbmsg`` and ``send_protobuf``, whether or not ``install`` has replaced them."""
    from hivemind.p2p.p2p_daemon import P2P
    from hivemind.p2p.p2p_daemon_bindings import utils

    return _hivemind or dict(write_pbmsg=utils.write_pbmsg, send_protobuf=P2P.send_protobuf)


def install() -> None:
    """Put the one-write framings in place of hivemind's (module docstring)."""
    if _hivemind:
        return
    from hivemind.p2p.p2p_daemon import P2P
    from hivemind.p2p.p2p_daemon_bindings import control, utils

    _hivemind.update(hivemind_framings())
    utils.write_pbmsg = write_pbmsg
    control.write_pbmsg = write_pbmsg  # control.py imported the name itself
    P2P.send_protobuf = staticmethod(send_protobuf)
