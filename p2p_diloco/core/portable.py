"""One arithmetic on every backend: the computations whose bytes every peer of a swarm must reproduce exactly,
whatever its CPU (x86 with or without AVX2 or AVX-512, ARM), its thread count or its GPU (docs/design.md §5).

Invariant 1 asks every peer that applies the same averaged outer gradient to the same global state to end with
the same bytes. Three computations make that state: the seeded init of the model, the decoding of an averaged
outer gradient (compression.py) and the outer step (outer.py). Each follows these rules, and this module holds
the pieces they share:

- Every floating-point operation is one IEEE 754 binary32 operation (``+``, ``-``, ``*``, or a conversion) on
  fp32 operands, rounded to nearest even. IEEE 754 fixes the result of each such operation bit for bit, and
  every backend torch supports does it in hardware (SSE/AVX, NEON, CUDA built without fast-math).
- No fused multiply-add. ``add(a, b, alpha=)``, ``addcmul`` and ``lerp`` are one FMA in torch's AVX2 kernel and a
  multiply then an add (two roundings) in its default kernel. A multiply and an add are two separate ops here.
- Scalars are fp32 0-dim tensors (``fp32``): a Python float is a double, and a kernel may apply it at either
  precision.
- No reduction (sum, norm, mean) in anything shared: its order follows the vector width and the thread count.
- No transcendental function (log, exp, cos, erfinv): libm and torch's vector library (SLEEF) round them
  differently, and torch's ``normal_`` calls one or the other by kernel and tensor size. The init draws its
  normals from integers instead (``seeded_normal``).
- Random bits come from SHAKE-256 (``hashlib``), the same on every platform and version, not from torch's
  generators (mt19937 on the CPU, Philox on CUDA, each with its own bits-to-float conversion per kernel).

What would break it: denormals flushed to zero (``torch.set_flush_denormal(True)``, a build or an extension
compiled with fast-math), TF32 or reduced-precision modes applied to these ops (they are elementwise, which
TF32 does not touch), a big-endian machine (bytes are hashed and sent little-endian), or a change to any of the
three computations that brings back a fused op, a Python scalar, a reduction or a transcendental function.
The inner steps need none of this: they are local, and only their difference to the global params travels.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import numpy as np
import torch

_UNIFORMS = 12  # Irwin-Hall: 12 uniforms on [0, 1) summed, minus 6, have mean 0 and variance 1
_CHUNK_VALUES = 1 << 20  # values per SHAKE-256 stream: bounds the memory a large tensor's draw takes at once


def fp32(value: float) -> torch.Tensor:
    """``value`` as an fp32 0-dim CPU tensor (rounded to nearest once, here): a scalar every kernel applies in fp32."""
    return torch.tensor(value, dtype=torch.float32)


def _shake_words(key: str, count: int, dtype: str) -> np.ndarray:
    """``count`` little-endian integers of numpy ``dtype`` from SHAKE-256 of ``key`` (in chunks of fixed keys)."""
    size = np.dtype(dtype).itemsize
    parts = []
    for start in range(0, count, _CHUNK_VALUES):
        wanted = min(_CHUNK_VALUES, count - start)
        digest = hashlib.shake_256(f"{key}/{start // _CHUNK_VALUES}".encode()).digest(wanted * size)
        parts.append(np.frombuffer(digest, dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def seeded_normal(numel: int, key: str) -> torch.Tensor:
    """``numel`` draws close to a standard normal, fp32, the same bytes everywhere for the same ``key``.

    Irwin-Hall with 12 uniforms of 16 bits: the sum s of 12 integers in [0, 65535] is exact in int64, 2s - 12 * 65535
    is an odd integer of magnitude below 2**20 (exact in fp32), and times 2**-17 (exact: a power of two) it has mean
    0 and variance 1 - 2**-32. The tails stop at about 6 standard deviations, which an init never misses.
    """
    words = _shake_words(f"normal/{key}", numel * _UNIFORMS, "<u2").reshape(numel, _UNIFORMS)
    centered = 2 * words.sum(axis=1, dtype=np.int64) - _UNIFORMS * 65535
    return torch.from_numpy(centered.astype(np.float32)).mul_(fp32(2.0**-17))


def seeded_uniform(numel: int, key: str) -> torch.Tensor:
    """``numel`` draws uniform on [0, 1) in steps of 2**-24, fp32, the same bytes everywhere for the same ``key``."""
    words = _shake_words(f"uniform/{key}", numel, "<u4") >> np.uint32(8)  # 24 bits: exact in fp32
    return torch.from_numpy(words.astype(np.float32)).mul_(fp32(2.0**-24))


class _PortableDraws:
    """Replacements for ``Tensor.normal_`` and ``Tensor.uniform_`` that draw from ``seeded_normal`` and
    ``seeded_uniform``, each call with a key of its own: the seed and the call's number. A model's constructor calls
    them in the same order on every peer, so the n-th call gets the same bytes everywhere."""

    def __init__(self, seed: int):
        self.seed, self.calls = seed, 0

    def _key(self) -> str:
        self.calls += 1
        return f"p2p-diloco init seed {self.seed} call {self.calls}"

    def normal_(self, tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: object = None) -> torch.Tensor:
        draw = seeded_normal(tensor.numel(), self._key()).to(tensor.device)
        draw.mul_(fp32(std)).add_(fp32(mean))  # a multiply, then an add: two roundings, no FMA
        with torch.no_grad():
            return tensor.copy_(draw.view(tensor.shape))

    def uniform_(self, tensor: torch.Tensor, a: float = 0.0, b: float = 1.0, *, generator: object = None) -> torch.Tensor:
        draw = seeded_uniform(tensor.numel(), self._key()).to(tensor.device)
        draw.mul_(fp32(b - a)).add_(fp32(a))
        with torch.no_grad():
            return tensor.copy_(draw.view(tensor.shape))

    def trunc_normal_(self, tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                      generator: object = None) -> torch.Tensor:
        # torch's own inverts the normal's CDF (erfinv, a transcendental function); clamping is exact
        self.normal_(tensor, mean, std)
        with torch.no_grad():
            return tensor.clamp_(min=a, max=b)


@contextlib.contextmanager
def portable_init(seed: int) -> Iterator[_PortableDraws]:
    """While active, every ``normal_``, ``uniform_`` and ``trunc_normal_`` of torch (the tensor methods, and the
    ``torch.nn.init`` functions that call them) draws portable bytes keyed by ``seed`` and the call's order. Meant
    for building a model: its constructor's random init then gives the same bytes on every backend.

    Init functions that use other random ops (``orthogonal_``'s QR, ``sparse_``) are not covered: a model that
    uses them should start from a file (``--init-from``). Not thread-safe: it swaps methods of ``torch.Tensor``."""
    draws = _PortableDraws(seed)
    saved = (torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_)
    torch.Tensor.normal_ = lambda self, mean=0.0, std=1.0, *, generator=None: draws.normal_(self, mean, std)
    torch.Tensor.uniform_ = lambda self, a=0.0, b=1.0, *, generator=None: draws.uniform_(self, a, b)
    torch.nn.init.trunc_normal_ = draws.trunc_normal_
    try:
        yield draws
    finally:
        torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_ = saved
