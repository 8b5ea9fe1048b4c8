"""The decoder for the one hivemind wire type that p2p-diloco does not encode with its own codecs, hardened for
bytes from strangers.

A receiver decodes every tensor through hivemind's registry, keyed by the wire type *the sender* wrote in
the message, so a peer can make us run any of hivemind's decoders on any bytes. Those decoders trust the
message: a wrong dtype, length or shape ends in a TypeError, IndexError or RuntimeError from deep inside
numpy or torch. Here ``NONE`` (raw bytes; our fp32 parts and the state download) is checked first (a known
dtype, a sane shape, exactly numel x itemsize bytes; ``MalformedPayloadError`` if not), then decoded by hivemind as
before. Every other wire type carries one of our own codecs (fp16, int8, int4, int2, topk), which check themselves
(``WireCodec``). This module does not check values (finite, plausible): that is the reducer's job (robust.py).
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping

import torch
from hivemind.compression import CompressionBase, NoCompression
from hivemind.proto import runtime_pb2

from p2p_diloco.core.compression import MalformedPayloadError, received_shape

# dtype names hivemind's NoCompression writes -> bytes per value; bfloat16 may also travel as fp32 (legacy mode)
_RAW_ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


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


def install_checked_decoders(registry: MutableMapping[str, CompressionBase]) -> None:
    """Replace hivemind's NONE decoder in ``registry`` (hivemind's global one)."""
    registry["NONE"] = CheckedNoCompression()
