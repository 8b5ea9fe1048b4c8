"""Codecs for outer gradients on the wire: fp32 (none), fp16, blockwise 8-bit and 4-bit NF4 (bitsandbytes), dense
2-bit, and sparse top-k with 2-bit values (the lossiest three run with error feedback: feedback.py).

Pure torch + bitsandbytes, no hivemind: ``averaging.py`` adapts these codecs to hivemind's
serialization. A codec turns a flat fp32 tensor into bytes and back. Encoding runs once per part, on its
reducer, so it may round differently from one machine to the next; decoding gives the same bytes on every
backend (docs/design.md §5): it is a table lookup and one fp32 multiply per value in plain torch, not
bitsandbytes' kernels, and the code books are fixed bit patterns here, not rebuilt by each peer with
floating-point arithmetic. The quantized codecs send only the absmax of each block and the indices (the
code book is never sent), so they work under numpy 2 (hivemind's 8-bit codec does not).

Bytes from another peer are untrusted: ``received_shape`` and ``decode_received`` check them against the
layout before anything is allocated and raise ``MalformedPayloadError``, never anything else.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Protocol

import torch

# A received tensor may have at most this many dims and values (counting a zero-length dim as 1): far above
# any all-reduce part or parameter tensor, far below what overflows torch's int64 size and stride arithmetic.
MAX_RECEIVED_DIMS = 8
MAX_RECEIVED_VALUES = 2**34


class MalformedPayloadError(ValueError):
    """Bytes received from another peer do not fit the layout they claim (wrong length, dtype or shape, block
    scales that are not finite and >= 0). The sender is at fault: the
    caller drops that part or that peer, never the process. A ValueError, so existing handlers keep working."""


_INT8_CODE_HEX = (
    "33337ebf9a997abf000077bf666673bfcdcc6fbf33336cbf9a9968bf000065bf666661bfcdcc5dbf33335abf9a9956bf"
    "000053bf66664fbfcdcc4bbf333348bf9a9944bf000041bf66663dbfcdcc39bf343336bf9a9932bf00002fbf66662bbf"
    "cdcc27bf343324bf9a9920bf00001dbf666619bfcdcc15bf343312bf9a990ebf00000bbf666607bfcccc03bf333300bf"
    "3233f9be0000f2becccceabe9a99e3be6666dcbe3333d5be0000cebeccccc6be9a99bfbe6666b8be3333b1be0000aabe"
    "cccca2be9a999bbe666694be34338dbe000086be99997dbe33336fbecdcc60be666652be000044be9a9935be333327be"
    "cdcc18be66660abe0000f8bd3433dbbd85ebc9bdf728c4bd6766bebdd7a3b8bd48e1b2bdb81eadbd2a5ca7bd9a99a1bd"
    "0ad79bbd7b1496bdeb5190bd5d8f8abdcdcc84bd7b147ebd5d8f72bd3d0a67bd1f855bbd000050bde17a44bdc3f538bd"
    "a3702dbd85eb21bd676616bd48e10abd52b8febc15aee7bcd7a3d0bc9a99b9bc5d8fa2bc1f858bbcc3f568bc48e13abc"
    "643b1fbc180416bccdcc0cbc819503bc6abcf4bbd34de2bb3bdfcfbba470bdbb0d02abbb749398bbdd2486bb8a6c67bb"
    "5c8f42bb2db21dbbfca9f1ba9defa7baff6577ba3ee859ba806a3cbac1ec1eba016f01ba83e2c7b905e78cb90bd723b9"
    "4b1fbab8b3ef8ab8348037b80642b2b7ff0502b7941a5ab6b7a313b500000000b7a31335941a5a36ff0502370642b237"
    "34803738b3ef8a384b1fba380bd7233905e78c3983e2c739016f013ac1ec1e3a806a3c3a3ee8593aff65773a9defa73a"
    "fca9f13a2db21d3b5c8f423b8a6c673bdd24863b7493983b0d02ab3ba470bd3b3bdfcf3bd34de23b6abcf43b8195033c"
    "cdcc0c3c1804163c643b1f3c48e13a3cc3f5683c1f858b3c5d8fa23c9a99b93cd7a3d03c15aee73c52b8fe3c48e10a3d"
    "6766163d85eb213da3702d3dc3f5383de17a443d0000503d1f855b3d3d0a673d5d8f723d7b147e3dcdcc843d5d8f8a3d"
    "eb51903d7b14963d0ad79b3d9a99a13d2a5ca73db81ead3d48e1b23dd7a3b83d6766be3df728c43d85ebc93d3433db3d"
    "0000f83d66660a3ecdcc183e3333273e9a99353e0000443e6666523ecdcc603e33336f3e99997d3e0000863e34338d3e"
    "6666943e9a999b3ecccca23e0000aa3e3333b13e6666b83e9a99bf3eccccc63e0000ce3e3333d53e6666dc3e9a99e33e"
    "ccccea3e0000f23e3233f93e3333003fcccc033f6666073f00000b3f9a990e3f3433123fcdcc153f6666193f00001d3f"
    "9a99203f3433243fcdcc273f66662b3f00002f3f9a99323f3433363fcdcc393f66663d3f0000413f9a99443f3333483f"
    "cdcc4b3f66664f3f0000533f9a99563f33335a3fcdcc5d3f6666613f0000653f9a99683f33336c3fcdcc6f3f6666733f"
    "0000773f9a997a3f33337e3f0000803f"
)
_NF4_CODE_HEX = (
    "000080bfb13932bf306b06bfa032cabe4da291be3f353dbe7178babd00000000fffaa23de3ca243edd047c3e3a03ad3e"
    "b8a4e13eab07103fb313393f0000803f"
)


def _code_book(hex_text: str) -> torch.Tensor:
    """fp32 values from their little-endian bit patterns: the same bytes on every machine, by construction."""
    return torch.frombuffer(bytearray.fromhex(hex_text), dtype=torch.float32).clone()


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
        quantize_blockwise = bitsandbytes_functional().quantize_blockwise
        flat = values.detach().to(torch.float32).contiguous().view(-1)
        if flat.numel() == 0:
            return b""
        indices, state = quantize_blockwise(flat, code=dynamic_code(), blocksize=self.block_size)
        return state.absmax.to(torch.float32).numpy().tobytes() + indices.numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        num_blocks = -(-numel // self.block_size)
        _check_length(self.name, data, 4 * num_blocks + numel)
        if numel == 0:
            return torch.zeros(0)
        buffer = bytearray(data)
        absmax = torch.frombuffer(buffer, dtype=torch.float32, count=num_blocks)
        indices = torch.frombuffer(buffer, dtype=torch.uint8, offset=4 * num_blocks, count=numel)
        return scaled_lookup(dynamic_code(), indices, absmax, self.block_size)

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
        quantize_4bit = bitsandbytes_functional().quantize_4bit
        flat = values.detach().to(torch.float32).contiguous().view(-1)
        if flat.numel() == 0:
            return b""
        packed, state = quantize_4bit(flat, blocksize=self.block_size, quant_type="nf4")
        return state.absmax.to(torch.float32).numpy().tobytes() + packed.numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        if numel == 0:
            _check_length(self.name, data, 0)
            return torch.zeros(0)
        absmax, packed = _scales_and_packed(self.name, data, numel, self.block_size, values_per_byte=2)
        # bitsandbytes packs two values per byte, the first in the high nibble
        indices = torch.stack([packed >> 4, packed & 15], dim=1).view(-1)[:numel]
        return scaled_lookup(nf4_code(), indices, absmax, self.block_size)

    def bytes_per_value(self) -> float:
        return 0.5 + 4.0 / self.block_size


class BlockwiseInt2Codec:
    """Dense 2-bit: each value sent as one of the four levels (-1, -1/3, 1/3, 1) x its block's scale, four values per
    byte (the first in the lowest two bits), after one fp32 scale per block of ``block_size`` values. A value is
    sent as a large level where it is at least the block's RMS in magnitude (the best uniform 4-level quantizer of a
    Gaussian puts its thresholds there), else as a small one; the scale is then the least-squares one for those
    levels, so that encoding a decoded block gives it back (a peer's wire re-encodes what its error feedback already
    encoded: a scale from the RMS, 1.5 x RMS, shrank every hop by ~5% that no feedback saw). Code book values are at
    most 1, so a finite scale never decodes to inf. Size: (0.25 + 4 / block_size) bytes per value, 0.3125 by
    default: 1.8x less than int4, 3.3x more than topk. The error it leaves is about a third of the norm, so it is
    meant only with ``ErrorFeedback``; unlike topk it sends every value, so the mean of several senders re-encodes
    without dropping most of it (docs/learning.md). Decoding is a table lookup and one fp32 multiply: the same bytes
    on every backend."""

    name = "int2"

    def __init__(self, block_size: int = 64):
        if block_size < 1:
            raise ValueError(f"int2 needs blocks of at least 1 value, got {block_size}")
        self.block_size = block_size

    def encode(self, values: torch.Tensor) -> bytes:
        flat = values.detach().to(torch.float32).contiguous().view(-1)
        if flat.numel() == 0:
            return b""
        numel, num_blocks = flat.numel(), -(-flat.numel() // self.block_size)
        blocks = torch.zeros(num_blocks * self.block_size)
        blocks[:numel] = flat
        blocks = blocks.view(num_blocks, self.block_size)
        counts = torch.full((num_blocks,), float(self.block_size))
        counts[-1] = numel - (num_blocks - 1) * self.block_size  # the last block may be partial: its own RMS
        # magnitudes over the block's absmax (1 where it is 0), so that no finite block overflows in the sums below
        absmax = blocks.abs().amax(1)
        unit = absmax.where(absmax > 0, torch.ones(()))[:, None]
        magnitude = blocks.abs() / unit
        rms = (magnitude.square().sum(1) / counts).sqrt()
        large = magnitude >= rms[:, None]  # a tie with the threshold: the large level, either sign
        # least squares for the levels chosen: sum(|x| c) / sum(c^2), c = 1 or 1/3 (the padding of the last block is
        # zeros: never large in a block that is not all zeros, and adding nothing to the sums)
        large_sum, large_count = (magnitude * large).sum(1), large.sum(1)
        small_sum, small_count = magnitude.sum(1) - large_sum, counts - large_count
        fit = (large_sum + small_sum / 3) / (large_count + small_count / 9).clamp(min=1 / 9)
        # a non-finite input gives a NaN scale (a receiver refuses it): it decodes to non-finite, as other codecs do
        scale = (fit * unit[:, 0]).clamp(max=torch.finfo(torch.float32).max).where(absmax.isfinite(), torch.nan)
        negative = blocks < 0
        indices = torch.where(negative, 1 - large.to(torch.uint8), 2 + large.to(torch.uint8)).view(-1)[:numel]
        padded = torch.zeros(-(-numel // 4) * 4, dtype=torch.uint8)
        padded[:numel] = indices
        quads = padded.view(-1, 4)
        packed = quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)
        return scale.numpy().tobytes() + packed.numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        if numel == 0:
            _check_length(self.name, data, 0)
            return torch.zeros(0)
        scale, packed = _scales_and_packed(self.name, data, numel, self.block_size, values_per_byte=4)
        indices = torch.stack([packed & 3, (packed >> 2) & 3, (packed >> 4) & 3, packed >> 6], dim=1).view(-1)[:numel]
        return scaled_lookup(int2_code(), indices, scale, self.block_size)

    def bytes_per_value(self) -> float:
        return 0.25 + 4.0 / self.block_size


class BlockwiseTopKCodec:
    """Sparse and 2-bit (as SparseLoCo sends): per block of ``block_size`` values, the ``keep`` values of largest
    magnitude, each in one byte (its 6-bit index in the block, its sign, and one bit of magnitude: the block's
    absmax or half of it), after one fp32 absmax per block. Size: (4 + keep) / block_size bytes per value, 0.094
    by default (3.1% of the values kept): 6x less than int4. Everything else is dropped, so it is meant only with
    ``ErrorFeedback``, which carries the dropped values into the next round until they are large enough to be
    sent (docs/learning.md). Decoding is a scatter of exact fp32 products: the same bytes on every backend."""

    name = "topk"

    def __init__(self, block_size: int = 64, keep: int = 2):
        if not 1 <= keep <= block_size <= 64:
            raise ValueError(f"topk keeps 1..block_size values of blocks of at most 64, got {keep} of {block_size}")
        self.block_size, self.keep = block_size, keep

    def encode(self, values: torch.Tensor) -> bytes:
        flat = values.detach().to(torch.float32).contiguous().view(-1)
        if flat.numel() == 0:
            return b""
        num_blocks = -(-flat.numel() // self.block_size)
        blocks = torch.zeros(num_blocks * self.block_size)
        blocks[: flat.numel()] = flat
        blocks = blocks.view(num_blocks, self.block_size)
        top = blocks.abs().topk(self.keep, dim=1)
        absmax = top.values[:, 0].contiguous()
        half = top.values < 0.75 * absmax[:, None]  # nearer to absmax / 2 than to absmax
        negative = blocks.gather(1, top.indices) < 0
        codes = (top.indices << 2) | (negative.long() << 1) | half.long()
        return absmax.numpy().tobytes() + codes.to(torch.uint8).numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        num_blocks = -(-numel // self.block_size)
        _check_length(self.name, data, (4 + self.keep) * num_blocks)
        if numel == 0:
            return torch.zeros(0)
        buffer = bytearray(data)
        absmax = torch.frombuffer(buffer, dtype=torch.float32, count=num_blocks)
        codes = torch.frombuffer(buffer, dtype=torch.uint8, offset=4 * num_blocks, count=num_blocks * self.keep)
        codes = codes.view(num_blocks, self.keep).long()
        index = (codes >> 2).clamp(max=self.block_size - 1)  # a stranger's index past a smaller block: its last value
        magnitude = torch.where(codes & 1 == 1, 0.5, 1.0) * absmax[:, None]
        values = torch.where(codes & 2 == 2, -magnitude, magnitude)
        blocks = torch.zeros(num_blocks, self.block_size).scatter_(1, index, values)
        return blocks.view(-1)[:numel]

    def bytes_per_value(self) -> float:
        return (4.0 + self.keep) / self.block_size


@functools.cache
def nf4_code() -> torch.Tensor:
    """bitsandbytes' NormalFloat4 code book (``get_4bit_type("nf4")``); its encoder uses the same values."""
    return _code_book("".join(_NF4_CODE_HEX))


@functools.cache
def int2_code() -> torch.Tensor:
    """The 2-bit codec's four levels in units of its block's scale, rounded to fp32 once by the conversion from
    Python's doubles, which rounds to nearest everywhere: every machine has the same bits."""
    return torch.tensor([-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0], dtype=torch.float32)


@functools.cache
def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit code book (``create_dynamic_map(signed=True)``, which builds it with
    ``linspace`` and powers of ten: kept here as its bit patterns so that no peer computes it). Our encoder is
    given this table too."""
    return _code_book("".join(_INT8_CODE_HEX))


def scaled_lookup(code: torch.Tensor, indices: torch.Tensor, absmax: torch.Tensor, block_size: int) -> torch.Tensor:
    """``code[index] * absmax[block]`` for every value, on the tensors' device: a lookup and one fp32 multiply, the
    same bytes on every backend (docs/design.md §5). bitsandbytes' dequantize computes the same product in kernels
    of its own."""
    values = code[indices.long()]
    whole = values.numel() // block_size * block_size  # whole blocks, then the last, partial one
    values[:whole].view(-1, block_size).mul_(absmax[: whole // block_size, None])
    values[whole:].mul_(absmax[whole // block_size :][:1])
    return values


def _scales_and_packed(name: str, data: bytes, numel: int, block_size: int, values_per_byte: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed payload's parts, its length checked first: one fp32 scale per block, then the indices,
    ``values_per_byte`` to a byte (numel > 0)."""
    num_blocks, num_packed = -(-numel // block_size), -(-numel // values_per_byte)
    _check_length(name, data, 4 * num_blocks + num_packed)
    buffer = bytearray(data)
    scales = torch.frombuffer(buffer, dtype=torch.float32, count=num_blocks)
    return scales, torch.frombuffer(buffer, dtype=torch.uint8, offset=4 * num_blocks, count=num_packed)


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
    codecs = {"none": NoneCodec, "fp16": Float16Codec, "int8": BlockwiseInt8Codec, "int4": BlockwiseNF4Codec,
              "int2": BlockwiseInt2Codec, "topk": BlockwiseTopKCodec}
    if name not in codecs:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(codecs)}")
    if name in ("int8", "int4"):
        # import bitsandbytes when the codec is made, at start-up and before the averager process forks, not at
        # the first round inside training
        bitsandbytes_functional()
    return codecs[name]()


def bitsandbytes_functional() -> ModuleType:
    """``bitsandbytes.functional``, imported without loading torch's compiler. bitsandbytes wraps a few kernels of
    its default backend in ``torch.compile`` as it is imported, and ``torch.compile`` imports the whole compiler
    stack at once: 1.3-1.5 s of CPU, a quarter of a peer's start-up (docs/benchmarks.md, "Start-up"). The
    encoders here call none of those kernels; one that is called is compiled at its first call, as it would be
    anyway (torch compiles lazily; only the import moves)."""
    module = sys.modules.get("bitsandbytes.functional")
    if module is not None:
        return module
    compile_now = torch.compile
    torch.compile = _compile_at_first_call(compile_now)
    try:
        import bitsandbytes.functional as module
    finally:
        torch.compile = compile_now
    return module


def _compile_at_first_call(compile_now: Callable) -> Callable:
    def compile_later(model: Callable | None = None, **options):
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: compile_later(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile_later
