"""Codecs for outer gradients on the wire: fp32 (none), fp16, blockwise 8-bit and 4-bit NF4 (bitsandbytes),
and error feedback for the lossy ones.

Pure torch + bitsandbytes, no hivemind: ``averaging.py`` adapts these codecs to hivemind's
serialization. A codec turns a flat fp32 tensor into bytes and back; decoding is deterministic, so
peers that receive the same bytes get the same tensor. The 8-bit codec sends only the absmax of each
block and the 8-bit indices (the dynamic code book is rebuilt on each side, never sent), and parses
its header with plain ``int.from_bytes``, so it works under numpy 2 (hivemind's 8-bit codec does not).

Bytes from another peer are untrusted: ``received_shape`` and ``decode_received`` check them against the
layout before anything is allocated and raise ``MalformedPayloadError``, never anything else.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Protocol

import torch

# A received tensor may have at most this many dims and values (counting a zero-length dim as 1): far above
# any all-reduce part or parameter tensor, far below what overflows torch's int64 size and stride arithmetic.
MAX_RECEIVED_DIMS = 8
MAX_RECEIVED_VALUES = 2**34


class MalformedPayloadError(ValueError):
    """Bytes received from another peer do not fit the layout they claim (wrong length, dtype or shape, block
    scales that are not finite and >= 0, a wire type p2p-diloco never sends). The sender is at fault: the
    caller drops that part or that peer, never the process. A ValueError, so existing handlers keep working."""


class Codec(Protocol):
    name: str

    def encode(self, values: torch.Tensor) -> bytes:
        """Flat fp32 tensor -> bytes."""

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        """Bytes -> flat fp32 tensor of ``numel`` values."""

    def bytes_per_value(self) -> float:
        """Approximate size on the wire per value, in bytes."""


class NoneCodec:
    name = "none"

    def encode(self, values: torch.Tensor) -> bytes:
        return values.detach().to(torch.float32).contiguous().numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        _check_length(self.name, data, 4 * numel)
        if numel == 0:
            return torch.zeros(0)
        return torch.frombuffer(bytearray(data), dtype=torch.float32).clone()

    def bytes_per_value(self) -> float:
        return 4.0


class Float16Codec:
    name = "fp16"
    _FP16_MAX = 65504.0

    def encode(self, values: torch.Tensor) -> bytes:
        clamped = values.detach().to(torch.float32).clamp(-self._FP16_MAX, self._FP16_MAX)
        return clamped.to(torch.float16).contiguous().numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        _check_length(self.name, data, 2 * numel)
        if numel == 0:
            return torch.zeros(0)
        return torch.frombuffer(bytearray(data), dtype=torch.float16).to(torch.float32)

    def bytes_per_value(self) -> float:
        return 2.0


class BlockwiseInt8Codec:
    """bitsandbytes ``quantize_blockwise`` with the dynamic signed code: per block of ``block_size`` values,
    one fp32 absmax plus one uint8 index per value. Size: (1 + 4 / block_size) bytes per value."""

    name = "int8"

    def __init__(self, block_size: int = 256):
        self.block_size = block_size

    def encode(self, values: torch.Tensor) -> bytes:
        from bitsandbytes.functional import quantize_blockwise

        flat = values.detach().to(torch.float32).contiguous().view(-1)
        if flat.numel() == 0:
            return b""
        indices, state = quantize_blockwise(flat, code=_dynamic_code(), blocksize=self.block_size)
        return state.absmax.to(torch.float32).numpy().tobytes() + indices.numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_blockwise

        num_blocks = -(-numel // self.block_size)
        _check_length(self.name, data, 4 * num_blocks + numel)
        if numel == 0:
            return torch.zeros(0)
        buffer = bytearray(data)
        absmax = torch.frombuffer(buffer, dtype=torch.float32, count=num_blocks)
        indices = torch.frombuffer(buffer, dtype=torch.uint8, offset=4 * num_blocks, count=numel)
        return dequantize_blockwise(indices, absmax=absmax, code=_dynamic_code(), blocksize=self.block_size)

    def bytes_per_value(self) -> float:
        return 1.0 + 4.0 / self.block_size


class BlockwiseNF4Codec:
    """bitsandbytes ``quantize_4bit`` (NormalFloat4): per block of ``block_size`` values one fp32 absmax plus
    two 4-bit indices per byte. Size: (0.5 + 4 / block_size) bytes per value. Meant to be used with
    ``ErrorFeedback`` (the error it leaves is about 9% of the norm: too much to drop every round)."""

    name = "int4"

    def __init__(self, block_size: int = 64):
        self.block_size = block_size

    def encode(self, values: torch.Tensor) -> bytes:
        from bitsandbytes.functional import quantize_4bit

        flat = values.detach().to(torch.float32).contiguous().view(-1)
        if flat.numel() == 0:
            return b""
        packed, state = quantize_4bit(flat, blocksize=self.block_size, quant_type="nf4")
        return state.absmax.to(torch.float32).numpy().tobytes() + packed.numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        from bitsandbytes.functional import QuantState, dequantize_4bit

        num_blocks, num_packed = -(-numel // self.block_size), -(-numel // 2)
        _check_length(self.name, data, 4 * num_blocks + num_packed)
        if numel == 0:
            return torch.zeros(0)
        buffer = bytearray(data)
        absmax = torch.frombuffer(buffer, dtype=torch.float32, count=num_blocks)
        packed = torch.frombuffer(buffer, dtype=torch.uint8, offset=4 * num_blocks, count=num_packed).view(-1, 1)
        state = QuantState(
            absmax=absmax, shape=torch.Size([numel]), code=_nf4_code(), blocksize=self.block_size,
            quant_type="nf4", dtype=torch.float32,
        )
        return dequantize_4bit(packed, state).view(-1)[:numel].clone()

    def bytes_per_value(self) -> float:
        return 0.5 + 4.0 / self.block_size


class ErrorFeedback:
    """Carries what a lossy codec did not send into the next round (error feedback, DESIGN.md §2).

    ``prepare`` returns the values to send, ``decoded(outer_grad + residual)``, and the candidate residual;
    ``commit`` keeps that residual once the round succeeded (a failed round sent nothing, so its residual
    is dropped: the next outer gradient already contains the unsent progress).
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self.residual: list[torch.Tensor] | None = None

    def prepare(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        corrected = [t + r for t, r in zip(tensors, self.residual)] if self.residual else list(tensors)
        sent = [self.codec.decode(self.codec.encode(c.reshape(-1)), c.numel()).reshape(c.shape) for c in corrected]
        return sent, [c - s for c, s in zip(corrected, sent)]

    def commit(self, residual: list[torch.Tensor]) -> None:
        self.residual = residual


@functools.cache
def _nf4_code() -> torch.Tensor:
    from bitsandbytes.functional import get_4bit_type

    return get_4bit_type("nf4", device="cpu")


@functools.cache
def _dynamic_code() -> torch.Tensor:
    from bitsandbytes.functional import create_dynamic_map

    return create_dynamic_map(signed=True)


def _check_length(name: str, data: bytes, expected: int) -> None:
    # checked before any tensor is made: a payload can never make this peer allocate more than it received
    if len(data) != expected:
        raise MalformedPayloadError(f"{name} payload has {len(data)} bytes, expected {expected}")


def received_shape(dims: Sequence[int]) -> torch.Size:
    """The shape a received tensor declares, if sane: at most MAX_RECEIVED_DIMS dims, each >= 0, and at most
    MAX_RECEIVED_VALUES values. Computed with Python ints: ``torch.Size(dims).numel()`` wraps around silently
    (dims [2**31, 2**31, 4] give 0 values), which would let a declared shape disagree with its payload."""
    dims = list(dims)
    if len(dims) > MAX_RECEIVED_DIMS or any(d < 0 for d in dims):
        raise MalformedPayloadError(f"received tensor declares shape {dims[:MAX_RECEIVED_DIMS + 1]}")
    if math.prod(max(d, 1) for d in dims) > MAX_RECEIVED_VALUES:
        raise MalformedPayloadError(f"received tensor declares shape {dims}: more than {MAX_RECEIVED_VALUES} values")
    return torch.Size(dims)


def decode_received(codec: Codec, data: bytes, numel: int) -> torch.Tensor:
    """``codec.decode`` for bytes from another peer: also refuses block scales (the fp32 absmax of each block,
    first in a quantized payload) that are not finite and >= 0; our encoder never writes one, and a NaN scale
    would turn a whole block into NaN. Local round trips use ``decode`` and keep a non-finite input as it is."""
    values = codec.decode(data, numel)  # checks the length first
    block_size = getattr(codec, "block_size", None)
    if block_size and numel:
        scales = torch.frombuffer(bytearray(data[: 4 * -(-numel // block_size)]), dtype=torch.float32)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise MalformedPayloadError(f"{codec.name} payload has block scales that are not finite and >= 0")
    return values


def make_codec(name: str) -> Codec:
    codecs = {"none": NoneCodec, "fp16": Float16Codec, "int8": BlockwiseInt8Codec, "int4": BlockwiseNF4Codec}
    if name not in codecs:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(codecs)}")
    if name in ("int8", "int4"):
        # the first import of bitsandbytes takes seconds (it sets up compiled kernels): pay it when the codec
        # is made, at start-up and before the averager process forks, not at the first round inside training
        import bitsandbytes.functional  # noqa: F401
    return codecs[name]()
