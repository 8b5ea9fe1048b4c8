"""swarm/p2p_writes.py: a message to p2pd in one write, the same bytes as hivemind's framing."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p.p2p_daemon import P2P, RPCError
from hivemind.p2p.p2p_daemon_bindings import control, utils
from hivemind.proto import averaging_pb2, p2pd_pb2, runtime_pb2

from p2p_diloco.swarm import p2p_writes


class Writer:
    """An asyncio StreamWriter's two calls, each write kept apart."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        pass


def _daemon_writes(write_pbmsg, message) -> list[bytes]:
    writer = Writer()
    asyncio.run(write_pbmsg(writer, message))
    return writer.writes


def _stream_writes(send_protobuf, message) -> list[bytes]:
    writer = Writer()
    asyncio.run(send_protobuf(message, writer))
    return writer.writes


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16_383, 16_384, 2_097_151, 2_097_152])
def test_a_daemon_message_is_hivemind_s_bytes_in_one_write(size):
    # lengths of 1 to 4 varint bytes
    message = (p2pd_pb2.PersistentConnectionRequest(
        callId=b"c" * 16, callUnary=p2pd_pb2.CallUnaryRequest(peer=b"p", proto="rpc", data=b"x" * size))
        if size else p2pd_pb2.Request(type=p2pd_pb2.Request.IDENTIFY))
    ours = _daemon_writes(p2p_writes.write_pbmsg, message)
    theirs = _daemon_writes(p2p_writes.hivemind_framings()["write_pbmsg"], message)
    assert len(ours) == 1 and ours[0] == b"".join(theirs)
    assert len(theirs) >= 2  # hivemind's: the varint a byte at a time, then the body
    assert p2p_writes.varint(message.ByteSize()) == ours[0][: len(ours[0]) - message.ByteSize()]


@pytest.mark.parametrize("payload", [0, 10, 65_536, 65_537, 300_000])
def test_a_stream_message_is_hivemind_s_bytes_in_one_write(payload):
    # over 64 KiB hivemind writes the payload in chunks; an error goes with its own marker
    for message in (averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=b"\x07" * payload)),
                    RPCError(message="e" * payload)):
        ours = _stream_writes(p2p_writes.send_protobuf, message)
        theirs = _stream_writes(p2p_writes.hivemind_framings()["send_protobuf"], message)
        assert len(ours) == 1 and ours[0] == b"".join(theirs) == p2p_writes.stream_frame(message)
        assert ours[0][:1] == (P2P.ERROR_MARKER if isinstance(message, RPCError) else P2P.MESSAGE_MARKER)


def test_install_replaces_both_framings_once_and_keeps_hivemind_s(monkeypatch):
    originals = p2p_writes.hivemind_framings()  # hivemind's, whether or not a DHT started in this process installed ours
    assert originals["write_pbmsg"] is not p2p_writes.write_pbmsg
    monkeypatch.setattr(utils, "write_pbmsg", originals["write_pbmsg"])
    monkeypatch.setattr(control, "write_pbmsg", originals["write_pbmsg"])
    monkeypatch.setattr(P2P, "send_protobuf", staticmethod(originals["send_protobuf"]))
    monkeypatch.setattr(p2p_writes, "_hivemind", {})
    p2p_writes.install()
    p2p_writes.install()  # a second time: hivemind's stay the ones kept
    assert utils.write_pbmsg is control.write_pbmsg is p2p_writes.write_pbmsg
    assert P2P.send_protobuf is p2p_writes.send_protobuf
    assert p2p_writes.hivemind_framings() == originals


def test_varint_refuses_a_negative_length():
    with pytest.raises(ValueError, match="negative"):
        p2p_writes.varint(-1)
