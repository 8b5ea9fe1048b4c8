"""Decoders for the hivemind wire types that p2p-diloco does not encode with its own codecs, hardened for
bytes from strangers.

A receiver decodes every tensor through hivemind's registry, keyed by the wire type *the sender* wrote in
the message, so a peer can make us run any of hivemind's decoders on any bytes. Those decoders trust the
message: a wrong dtype, length or shape ends in a TypeError, IndexError or RuntimeError from deep inside
numpy or torch. Here:

- ``NONE`` (raw bytes; our fp32 parts and the state download) is checked first (a known dtype, a sane
  shape, exactly numel x itemsize bytes), then decoded by hivemind as before;
- the type p2p-diloco never sends (``MEANSTD_16BIT``) is refused outright.

Both raise ``MalformedPayloadError``. Our own codecs (fp16, int8, int4) check themselves (``WireCodec``).
This module does not check values (finite, plausible): that is the reducer's job (robust.py).
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression
from hivemind.proto import runtime_pb2

from p2p_diloco.core.compression import MalformedPayloadError, received_shape

# dtype names hivemind's NoCompression writes -> bytes per value; bfloat16 may also travel as fp32 (legacy mode)
_RAW_ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
_UNUSED_WIRE_TYPES = ("MEANSTD_16BIT",)


class CheckedNoCompression(NoCompression):
    """hivemind's raw layout, checked before hivemind decodes it."""

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        dtype, length = serialized_tensor.dtype, len(serialized_tensor.buffer)
        if dtype not in _RAW_ITEMSIZE:
            raise MalformedPayloadError(f"raw tensor has unknown dtype {dtype[:32]!r}")
        numel = math.prod(received_shape(serialized_tensor.size))
        allowed = {numel * _RAW_ITEMSIZE[dtype]} | ({numel * 4} if dtype == "bfloat16" else set())
        if length not in allowed:
            raise MalformedPayloadError(f"raw {dtype} tensor of {numel} values has {length} bytes")
        if serialized_tensor.requires_grad and not dtype.startswith(("float", "bfloat")):
            # hivemind calls requires_grad_() on what we return: a RuntimeError for an integer tensor
            raise MalformedPayloadError(f"raw {dtype} tensor claims to require gradients")
        return super().extract(serialized_tensor)


class UnusedWireType(CompressionBase):
    """A wire type p2p-diloco never sends: receiving one means the sender is not one of our peers' code."""

    def __init__(self, name: str):
        self.name = name
        self.compression_type = runtime_pb2.CompressionType.Value(name)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        raise ValueError(f"p2p-diloco does not send the {self.name} wire type")

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        raise MalformedPayloadError(f"received a tensor of wire type {self.name}, which p2p-diloco never sends")

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1.0


def install_checked_decoders(registry: MutableMapping[str, CompressionBase]) -> None:
    """Replace hivemind's NONE decoder and the unused types' in ``registry`` (hivemind's global one)."""
    registry["NONE"] = CheckedNoCompression()
    for name in _UNUSED_WIRE_TYPES:
        registry[name] = UnusedWireType(name)
