"""What travels in an all-reduce: our codecs adapted to hivemind's (``WireCodec``) and registered for the wire
types they use, the size of the parts every peer of a group reduces, and counters of the bytes each way."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import averaging_pb2, runtime_pb2

from p2p_diloco.core.compression import Codec, MalformedPayloadError, decode_received, make_codec, received_shape
from p2p_diloco.swarm.wire_guard import install_checked_decoders

WIRE_TYPES = {
    "none": runtime_pb2.CompressionType.NONE,
    "fp16": runtime_pb2.CompressionType.FLOAT16,
    "int8": runtime_pb2.CompressionType.BLOCKWISE_8BIT,
    # hivemind's wire enum has no 4-bit type: NF4 parts travel under UNIFORM_8BIT's id, which p2p-diloco
    # never uses otherwise; every peer decodes it with our codec (install_wire_codecs)
    "int4": runtime_pb2.CompressionType.UNIFORM_8BIT,
    "topk": runtime_pb2.CompressionType.QUANTILE_8BIT,  # likewise: sparse 2-bit parts, under an id never used otherwise
    "int2": runtime_pb2.CompressionType.MEANSTD_16BIT,  # likewise: dense 2-bit parts, under the last id left
}
_QUANTIZATION_BLOCK = 256  # every part holds whole quantization blocks (64 for int4, int2 and topk, 256 for int8)
_PARTS_PER_AVERAGING = 32  # enough parts that every peer of a group reduces about its share
_MIN_PART_VALUES = 16 * _QUANTIZATION_BLOCK


def part_values_for(codec: Codec, total_values: int) -> int:
    """Values per all-reduce part for averagings of ``total_values``: about 1/32 of the total, in whole
    quantization blocks, and no larger than hivemind's default part (2**19 bytes on the wire).

    hivemind hands each part whole to one reducer, so with its default a streaming fragment of a few hundred
    thousand values is a single part and one peer reduces all of it: that peer sends twice the bytes of the
    others, and the burst that fragments are meant to cut comes back. Small parts spread the load evenly.
    """
    largest = max(_QUANTIZATION_BLOCK, int(DEFAULT_PART_SIZE_BYTES / codec.bytes_per_value()) // _QUANTIZATION_BLOCK * _QUANTIZATION_BLOCK)
    wanted = -(-total_values // _PARTS_PER_AVERAGING)
    wanted = -(-wanted // _QUANTIZATION_BLOCK) * _QUANTIZATION_BLOCK
    return min(largest, max(_MIN_PART_VALUES, wanted))


def part_norms_of(tensors: Sequence[torch.Tensor], part_values: int) -> list[float]:
    """The L2 norm of each all-reduce part of ``tensors``, in hivemind's order (each tensor flattened and cut into
    pieces of ``part_values`` values: ``TensorPartContainer``)."""
    return [float(piece.norm()) for tensor in tensors for piece in tensor.detach().reshape(-1).split(part_values)]


class WireCodec(CompressionBase):
    """Adapts a p2p_diloco codec to hivemind's three-method CompressionBase (fp32 tensors only).

    ``part_values``: how many values hivemind puts in one all-reduce part (see ``part_values_for``).
    """

    def __init__(self, codec: Codec, part_values: int | None = None):
        self.codec = codec
        self.part_values = part_values or part_values_for(codec, 2**40)  # default: hivemind's own part size
        self.compression_type = WIRE_TYPES[codec.name]
        # load the codec's native library here, before the averager forks: importing bitsandbytes takes
        # seconds, longer than a groupmate waits for our first chunk, so a lazy import fails the first round
        codec.decode(codec.encode(torch.zeros(8)), 8)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return self.wrap(tensor, lambda: self.codec.encode(tensor.detach().reshape(-1)))

    def wrap(self, tensor: torch.Tensor, encode: Callable[[], bytes]) -> runtime_pb2.Tensor:
        """The message for ``tensor`` with the bytes ``encode()`` gives (the codec's, or the reducer's error feedback's)."""
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=encode(), size=tensor.shape, dtype="float32",
                                  requires_grad=False)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """Decode a part; the bytes may come from a stranger, so a malformed one raises MalformedPayloadError
        (shape, dtype, length and block scales are checked before anything is allocated)."""
        shape = received_shape(serialized_tensor.size)
        if serialized_tensor.dtype != "float32":  # compress() always writes float32
            raise MalformedPayloadError(f"{self.codec.name} part has dtype {serialized_tensor.dtype[:32]!r}, not float32")
        return decode_received(self.codec, serialized_tensor.buffer, shape.numel()).reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # hivemind cuts tensors into parts of int(part_size_bytes / (4 * ratio)) values; report the ratio that
        # makes that exactly part_values, a whole number of quantization blocks, so a part re-quantizes
        # exactly like the whole tensor did (error feedback relies on it)
        return DEFAULT_PART_SIZE_BYTES / (4.0 * (self.part_values + 0.5))


def install_wire_codecs() -> None:
    """Make hivemind decode fp16, int8, int4, int2 and topk parts with our codecs, in this process and its forks.

    Receivers decode through hivemind's global registry, keyed by the wire type in each message, so this
    must run in every peer process before its averager starts (the averager is a forked child).
    """
    for name in ("fp16", "int8", "int4", "int2", "topk"):
        wire_type = runtime_pb2.CompressionType.Name(WIRE_TYPES[name])
        hivemind_serialization._BASE_COMPRESSION_TYPES[wire_type] = WireCodec(make_codec(name))
    install_checked_decoders(hivemind_serialization._BASE_COMPRESSION_TYPES)  # and hivemind's raw type


class TrafficCounters:
    """Bytes of averaging messages sent and received, and the states served to peers catching up (how many, and
    their bytes), shared between the averager process and its parent."""

    def __init__(self) -> None:
        self._sent = mp.Value(ctypes.c_double, 0.0)
        self._received = mp.Value(ctypes.c_double, 0.0)
        self._states_served = mp.Value(ctypes.c_double, 0.0)
        self._state_bytes_served = mp.Value(ctypes.c_double, 0.0)

    def add_sent(self, num_bytes: int) -> None:
        with self._sent.get_lock():
            self._sent.value += num_bytes

    def add_received(self, num_bytes: int) -> None:
        with self._received.get_lock():
            self._received.value += num_bytes

    def add_state_served(self) -> None:
        with self._states_served.get_lock():
            self._states_served.value += 1

    def add_state_bytes(self, num_bytes: int) -> None:
        with self._state_bytes_served.get_lock():
            self._state_bytes_served.value += num_bytes

    def totals(self) -> tuple[int, int]:
        return int(self._sent.value), int(self._received.value)

    def served(self) -> tuple[int, int]:
        """States served (downloads begun by an asker we did not refuse) and their bytes sent so far."""
        return int(self._states_served.value), int(self._state_bytes_served.value)


async def metered(messages: AsyncIterator[Any], count: Callable[[int], None]) -> AsyncIterator[Any]:
    async for message in messages:
        count(message.ByteSize())
        yield message


class MeteredStub:
    """Wraps an averager stub so that the sender side of an all-reduce counts its bytes."""

    def __init__(self, stub: Any, traffic: TrafficCounters):
        self._stub, self._traffic = stub, traffic

    async def rpc_aggregate_part(self, requests: AsyncIterator[averaging_pb2.AveragingData]) -> AsyncIterator[Any]:
        stream = await self._stub.rpc_aggregate_part(metered(requests, self._traffic.add_sent))
        return metered(stream, self._traffic.add_received)
