"""What travels in an all-reduce: our codecs adapted to hivemind's (``WireCodec``) and registered for the wire
types they use, the size of the parts every peer of a group reduces, and counters of the bytes each way."""

from __future__ import annotations

import copy
import ctypes
import math
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
_BLOCKS_PER_AVERAGING = 96  # norm blocks: fine enough that any group's shares are close to whole blocks
_MIN_PART_VALUES = 16 * _QUANTIZATION_BLOCK


def largest_part_values(codec: Codec) -> int:
    """The most values one all-reduce part may hold: hivemind's default part (2**19 bytes on the wire), in whole
    quantization blocks."""
    return max(_QUANTIZATION_BLOCK, int(DEFAULT_PART_SIZE_BYTES / codec.bytes_per_value()) // _QUANTIZATION_BLOCK * _QUANTIZATION_BLOCK)


def part_values_for(codec: Codec, total_values: int) -> int:
    """Values per norm block for averagings of ``total_values``: about 1/96 of the total, in whole quantization
    blocks, and no larger than hivemind's default part (``largest_part_values``).

    A block is the unit the members declare norms for (``part_norms_of``) and every all-reduce part is whole blocks
    (``WireCodec.for_group``): one part per reducer, cut to its share, where hivemind's default part allows.
    """
    wanted = -(-total_values // _BLOCKS_PER_AVERAGING)
    wanted = -(-wanted // _QUANTIZATION_BLOCK) * _QUANTIZATION_BLOCK
    return min(largest_part_values(codec), max(_MIN_PART_VALUES, wanted))


def part_norms_of(tensors: Sequence[torch.Tensor], block_values: int) -> list[float]:
    """The L2 norm of each norm block of ``tensors``: each tensor flattened and cut into pieces of ``block_values``
    values, in hivemind's order (``TensorPartContainer`` cuts the same way, in parts of whole blocks)."""
    return [float(piece.norm()) for tensor in tensors for piece in tensor.detach().reshape(-1).split(block_values)]


def part_blocks(numels: Sequence[int], block_values: int, part_values: int) -> list[range]:
    """For each all-reduce part of tensors of ``numels`` values, in hivemind's order, the norm blocks it covers
    (indices into ``part_norms_of``'s list). ``part_values`` is a whole number of blocks."""
    per_part, found, first = part_values // block_values, [], 0
    for numel in numels:
        blocks = max(1, -(-numel // block_values))  # an empty tensor is one (empty) part and one norm
        found += [range(first + k, first + min(k + per_part, blocks)) for k in range(0, blocks, per_part)]
        first += blocks
    return found


class WireCodec(CompressionBase):
    """Adapts a p2p_diloco codec to hivemind's three-method CompressionBase (fp32 tensors only).

    ``part_values``: how many values hivemind puts in one all-reduce part; ``block_values``: the norm block
    (``part_values_for``), of which every part holds a whole number. Built with a block, the codec's parts are one
    block each; ``for_group`` gives the codec of one all-reduce, with parts of several.
    """

    def __init__(self, codec: Codec, part_values: int | None = None):
        self.codec = codec
        self.part_values = part_values or part_values_for(codec, 2**40)  # default: hivemind's own part size
        self.block_values = self.part_values
        self.compression_type = WIRE_TYPES[codec.name]
        # load the codec's native library here, before the averager forks: importing bitsandbytes takes
        # seconds, longer than a groupmate waits for our first chunk, so a lazy import fails the first round
        codec.decode(codec.encode(torch.zeros(8)), 8)

    def for_group(self, numels: Sequence[int], peer_fractions: Sequence[float]) -> WireCodec:
        """This codec with the part size of one all-reduce of tensors of ``numels`` values among reducers with
        ``peer_fractions`` (hivemind's shares; 0 for a client): whole blocks, as many as the smallest share holds, so
        that each reducer gets its share in one part, or in a few even ones where a share is larger than hivemind's
        default part (docs/design.md §2, "Parts").

        Every part is a message to its reducer and one back, each through both averagers' executors and ``p2pd``s:
        the fewer, the less a round costs the machine's CPU (docs/benchmarks.md, "Where a peer's time goes")."""
        shares = [float(f) for f in peer_fractions if f > 0]
        if not shares:
            return self
        blocks = sum(max(1, -(-n // self.block_values)) for n in numels)
        share = blocks * min(shares) / sum(shares)  # in blocks
        cap = max(1, largest_part_values(self.codec) // self.block_values)
        parts_per_share = max(1, math.ceil(share / cap - 1e-6))  # a share over the cap: that many parts, even
        per_part = max(1, min(cap, math.ceil(share / parts_per_share - 1e-6)))
        group_codec = copy.copy(self)
        group_codec.part_values = per_part * self.block_values
        return group_codec

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
