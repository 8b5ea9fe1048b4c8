"""The bytes of every computation that makes shared state, on this process's kernels and device, as one JSON line.

    ATEN_CPU_CAPABILITY=default python scripts/portable_bytes.py --threads 2
    python scripts/portable_bytes.py --device cuda

Prints the sha256 of: the seeded init of the built-in model; five outer steps (Nesterov, lr 0.7, momentum 0.9) on
whole tensors and five on streaming segments, params and momentum; and the decoding of fixed payloads of every
codec (none, fp16, int8, int4, int2). The inputs come from portable.py's SHAKE-256 draws, so they are the same bytes
everywhere. Run it under several ``ATEN_CPU_CAPABILITY`` values, thread counts and devices: the portable
computations must print the same hashes (docs/design.md §5). Two controls, torch's own ``normal_`` and a fused
``add(alpha=)``, are not portable: where they differ between two runs, the runs really used other kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

import torch  # noqa: E402

from p2p_diloco.core import compression  # noqa: E402
from p2p_diloco.core.config import ModelConfig, OuterConfig  # noqa: E402
from p2p_diloco.core.outer import OuterOptimizer, Segment, params_sha256  # noqa: E402
from p2p_diloco.core.portable import fp32, seeded_normal, seeded_uniform  # noqa: E402
from p2p_diloco.train.model import build_model  # noqa: E402

_VALUES = 100_003  # not a multiple of any block size: the last, partial block is decoded too


def outer_steps(device: torch.device, segments: bool) -> str:
    """Five outer steps from portable inputs, on whole tensors or on two segments of each: sha256 of params and
    momentum after them."""
    params = [seeded_normal(_VALUES, "params 0").to(device), seeded_normal(999, "params 1").to(device)]
    optimizer = OuterOptimizer(params, OuterConfig(lr=0.7, momentum=0.9))
    pieces = [Segment(0, 0, 50_000), Segment(1, 100, 999)] if segments else None
    for step in range(5):
        sizes = [s.stop - s.start for s in pieces] if pieces else [p.numel() for p in params]
        grads = [seeded_normal(size, f"grad {step} {i}").mul_(fp32(0.01)).to(device) for i, size in enumerate(sizes)]
        if not pieces:
            grads = [g.view(p.shape) for g, p in zip(grads, params)]
        optimizer.step(grads, pieces)
    return params_sha256(params + optimizer.momentum_buffers)


def decodes(device: torch.device) -> dict[str, str]:
    """sha256 of each codec's decoding of a fixed payload of ``_VALUES`` values, computed on ``device``."""
    values = seeded_normal(_VALUES, "payload")
    raw = {"none": values.numpy().tobytes(), "fp16": values.half().numpy().tobytes()}
    found = {
        "none": torch.frombuffer(bytearray(raw["none"]), dtype=torch.float32).to(device),
        "fp16": torch.frombuffer(bytearray(raw["fp16"]), dtype=torch.float16).to(device).float(),
    }
    for name, code, per_byte in (("int8", compression.dynamic_code(), 1), ("int4", compression.nf4_code(), 2),
                                 ("int2", compression.int2_code(), 4)):
        codec = compression.make_codec(name)
        blocks = -(-_VALUES // codec.block_size)
        absmax = seeded_uniform(blocks, f"{name} scales").mul_(fp32(3.0))
        packed = torch.from_numpy(
            (seeded_uniform(-(-_VALUES // per_byte), f"{name} indices").mul_(fp32(256.0))).numpy().astype("uint8")
        )
        payload = absmax.numpy().tobytes() + packed.numpy().tobytes()
        on_cpu = codec.decode(payload, _VALUES)  # the codec's own path (the CPU)
        if per_byte == 1:
            indices = packed
        elif per_byte == 2:  # int4: the first value in the high nibble
            indices = torch.stack([packed >> 4, packed & 15], dim=1).view(-1)[:_VALUES]
        else:  # int2: the first value in the lowest two bits
            indices = torch.stack([packed & 3, (packed >> 2) & 3, (packed >> 4) & 3, packed >> 6], dim=1).view(-1)[:_VALUES]
        on_device = compression.scaled_lookup(code.to(device), indices.to(device), absmax.to(device), codec.block_size)
        if not torch.equal(on_cpu.view(torch.int32), on_device.cpu().view(torch.int32)):
            found[name + " (codec differs from device)"] = on_device
        found[name] = on_device
    return {name: params_sha256([tensor]) for name, tensor in found.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="torch device to compute on (default cpu)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with torch.device(device):  # the init's multiplies run where the model is built
        init = params_sha256(list(build_model(ModelConfig(), seed=0).parameters()))
    generator = torch.Generator().manual_seed(0)
    controls = {
        "control torch normal_": params_sha256([torch.empty(_VALUES).normal_(generator=generator)]),
        "control fused add": params_sha256([seeded_normal(_VALUES, "a").add(seeded_normal(_VALUES, "b"), alpha=0.7)]),
    }
    result = dict(
        device=str(device),
        capability=torch.backends.cpu.get_cpu_capability(),
        threads=torch.get_num_threads(),
        portable={"init": init, "outer": outer_steps(device, False), "outer segments": outer_steps(device, True),
                  **{f"decode {name}": digest for name, digest in decodes(device).items()}},
        controls=controls,
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
