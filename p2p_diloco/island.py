"""A learner island of K ranks (``torchrun --nproc-per-node K``) that train one model together with DDP.

DESIGN.md §2: "a multi-GPU island runs its devices with torch.distributed inside and talks to the swarm
from rank 0". Every rank runs the same inner steps on its own sub-shard of the island's data shard (DDP
all-reduces the gradients, so the local params stay bit-identical). Only rank 0 is a peer of the swarm: it
averages, downloads state, writes metrics and checkpoints. At every inner step boundary rank 0 broadcasts a
small control tensor (stop, state changed, check, outer step); only when its state changed (an outer step
applied, a catch-up, a resume) does it broadcast the local and global params as well. The averaging stays in
the background on rank 0: the other ranks wait for it exactly as long as rank 0's training loop does.

Once per outer step, at the next boundary with no change, rank 0 also broadcasts the sha256 of its local
params and every rank compares its own: a rank that drifted (it should never) stops the island with an error.

With no torchrun (or K = 1) every method here returns at once: one code path for 1 rank and K ranks.
Every collective is bounded by the process group's timeout; a rank that dies ends the island (torchrun stops
the others). This module does not shard the model (no FSDP: the model must fit on each device), does not
resize an island while it runs, and knows nothing of the swarm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from p2p_diloco.config import DataConfig, PeerConfig
from p2p_diloco.outer import params_sha256

logger = logging.getLogger(__name__)
_MARGIN_S = 120.0  # on top of the longest wait of rank 0 between two boundaries
_POLL_S = 0.001  # how often a rank waiting for rank 0's control tensor returns to Python (to run signal handlers)


class IslandDiverged(RuntimeError):
    """A rank's local params differ from rank 0's: the island cannot go on as one learner."""


class Control(NamedTuple):
    """What rank 0 decided at an inner step boundary, as every rank sees it."""

    stop: bool
    outer_step: int


def collective_timeout_s(config: PeerConfig) -> float:
    """How long one rank may wait for another in a collective: longer than anything rank 0 does between two
    inner step boundaries (joining the swarm, waiting for an averaging, a state download, settling at the end)."""
    swarm = config.swarm
    waits = swarm.startup_timeout_s + swarm.relay_wait_s + swarm.averaging_timeout_s + swarm.state_timeout_s
    return waits + config.run.shutdown_wait_s + _MARGIN_S


class Island:
    """This process's place in its island: rank ``rank`` of ``size`` (a single process: rank 0 of 1)."""

    def __init__(self, rank: int = 0, size: int = 1, local_rank: int = 0, device: torch.device | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"island rank {rank} is not in [0, {size})")
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.device = device or torch.device("cpu")
        self._synced: tuple[int, str] | None = None  # (outer step, global sha256) the other ranks hold
        self._check_due = False

    @classmethod
    def from_environment(cls, env: Mapping[str, str], timeout_s: float) -> Island:
        """The island torchrun describes in ``env`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
        with its process group started (gloo on CPU, nccl on GPU); a single process without them."""
        size = int(env.get("WORLD_SIZE", "1"))
        if size <= 1:
            return cls()
        rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            device, backend = torch.device("cuda", local_rank), "nccl"
            torch.cuda.set_device(device)
        else:
            device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        logger.info("island rank %d of %d on %s (%s), collectives time out after %.0f s", rank, size, device, backend, timeout_s)
        return cls(rank, size, local_rank, device)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def shard(self, data: DataConfig) -> DataConfig:
        """This rank's sub-shard: the island's shard i of n is shards i*K ... i*K + K-1 of n*K."""
        if self.size == 1:
            return data
        return dataclasses.replace(
            data, shard_index=data.shard_index * self.size + self.rank, num_shards=data.num_shards * self.size
        )

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the inner steps call: DDP over the island's ranks, or the model itself."""
        if self.size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # buffers are built the same on every rank and never trained: no sync at every forward
        return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on a GPU; fp32 on a CPU (the global params stay fp32 everywhere)."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def share_start(self, state: dict) -> dict:
        """Rank 0's ``state`` (small: inner optimizer state, data position) to every rank, once at start."""
        if self.size == 1:
            return state
        box = [state if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def sync(
        self, stop: bool, outer_step: int, global_sha256: str, local_params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor]
    ) -> Control:
        """An inner step boundary: rank 0's ``stop`` and state reach every rank (followers' arguments other than
        the params are ignored; their params are overwritten when rank 0's changed)."""
        if self.size == 1:
            return Control(stop, outer_step)
        changed = self.is_leader and self._synced != (outer_step, global_sha256)
        check = self.is_leader and not changed and self._check_due
        control = torch.tensor([int(stop), int(changed), int(check), outer_step], dtype=torch.int64, device=self.device)
        self._broadcast_control(control)
        stop, changed, check, outer_step = (int(v) for v in control.tolist())
        if changed:
            self._broadcast_params(list(local_params) + list(global_params))
            sha = global_sha256 if self.is_leader else params_sha256(global_params)
            self._synced, self._check_due = (outer_step, sha), True
            logger.info("island rank %d: outer step %d global sha256 %s", self.rank, outer_step, sha)
        elif check:
            self._check_local(outer_step, local_params)
        return Control(bool(stop), outer_step)

    @staticmethod
    def _broadcast_control(control: torch.Tensor) -> None:
        """The per-step control broadcast, waited for in Python: the other ranks wait here while rank 0 evaluates,
        checkpoints or waits for an averaging, and a wait inside the C++ collective would hold off their signal
        handlers (SIGTERM from torchrun) until it ends."""
        work = dist.broadcast(control, src=0, async_op=True)
        while not work.is_completed():
            time.sleep(_POLL_S)
        work.wait()  # raises if the collective failed or timed out

    def _broadcast_params(self, tensors: list[torch.Tensor]) -> None:
        """One broadcast of all the tensors, flattened into one fp32 buffer; followers copy rank 0's bytes."""
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in tensors])
            dist.broadcast(flat, src=0)
            if not self.is_leader:
                offset = 0
                for tensor in tensors:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view(tensor.shape))
                    offset += tensor.numel()

    def _check_local(self, outer_step: int, local_params: Sequence[torch.Tensor]) -> None:
        """Rank 0's local params' sha256 to every rank; a rank whose own differ raises IslandDiverged."""
        own = params_sha256(local_params)
        digest = torch.tensor(list(bytes.fromhex(own)), dtype=torch.uint8, device=self.device)
        dist.broadcast(digest, src=0)
        leader = bytes(digest.tolist()).hex()
        self._check_due = False
        logger.info("island rank %d: outer step %d local sha256 %s", self.rank, outer_step, own)
        if own != leader:
            raise IslandDiverged(f"island rank {self.rank} trained to other local params than rank 0 at outer step {outer_step}")

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
