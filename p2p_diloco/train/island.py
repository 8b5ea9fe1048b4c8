"""A learner island of K ranks (``torchrun --nproc-per-node K``) that train one model together, with DDP or FSDP.

As docs/design.md §2 has it, a torchrun island runs K ranks with torch.distributed inside and talks to the
swarm from rank 0. Every rank runs the same inner steps on its own sub-shard of the island's data shard. With DDP
(``run.island_sharding = "ddp"``) every rank holds all the params and DDP all-reduces the gradients, so the
local params stay bit-identical. With FSDP (``"fsdp"``, fsdp.py) each rank holds a shard of the params and of
the inner AdamW state; rank 0 keeps a full fp32 CPU copy of the local params for the outer machinery, gathered
from the shards when it needs them and scattered back when it changed them.

Only rank 0 is a peer of the swarm: it averages, downloads state, writes metrics and checkpoints. At every
inner step boundary rank 0 broadcasts a small control tensor (stop, state changed, check, outer step,
request); only when its state changed (an outer step applied, a catch-up, a resume) does it send the local
params as well (DDP: broadcast with the global params; FSDP: scattered into the shards). While rank 0 does its
outer work the other ranks wait in that broadcast, and with FSDP serve its requests there: gather the local
params (a round ends, a catch-up) or the inner optimizer state (a checkpoint). The averaging stays in the
background on rank 0: the other ranks wait for it exactly as long as rank 0's training loop does.

Once per outer step every rank checks that it holds what rank 0 holds, and a rank that drifted (it should
never) stops the island with an error. DDP: at the next boundary with no change, rank 0 broadcasts the sha256
of its local params and every rank compares its own. FSDP: right after each scatter, rank 0 broadcasts the
sha256 each rank's shards must have (from its full copy) and every rank compares its own shards'.

With no torchrun (or K = 1) every method here returns at once: one code path for 1 rank and K ranks.
Every collective is bounded by the process group's timeout; a rank that dies ends the island (torchrun stops
the others). This module does not resize an island while it runs, and knows nothing of the swarm.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from p2p_diloco.core.config import DataConfig, PeerConfig
from p2p_diloco.core.outer import params_sha256

if TYPE_CHECKING:  # fsdp.py imports torch.distributed's FSDP and checkpoint modules: only for an FSDP island
    from p2p_diloco.train.fsdp import ShardedLocal

logger = logging.getLogger(__name__)
_MARGIN_S = 120.0  # on top of the longest wait of rank 0 between two boundaries
_POLL_S = 0.001  # how often a rank waiting for rank 0's control tensor returns to Python (to run signal handlers)
# the last value of the control tensor: what rank 0 asks of the others (with FSDP, in the middle of its outer work)
_BOUNDARY, _GATHER_PARAMS, _GATHER_INNER = 0, 1, 2


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
    start = config.run.wait_for_peers_s if config.run.wait_for_peers > 1 else 0.0  # rank 0 waits for the swarm first
    return waits + start + config.run.shutdown_wait_s + _MARGIN_S


class Island:
    """This process's place in its island: rank ``rank`` of ``size`` (a single process: rank 0 of 1)."""

    def __init__(
        self, rank: int = 0, size: int = 1, local_rank: int = 0, device: torch.device | None = None, sharding: str = "ddp",
        precision: str = "auto",
    ):
        if not 0 <= rank < size:
            raise ValueError(f"island rank {rank} is not in [0, {size})")
        if sharding == "fsdp" and size < 2:
            raise ValueError("--island-sharding fsdp needs a torchrun island of 2 or more ranks (torchrun --nproc-per-node K)")
        self.rank, self.size, self.local_rank = rank, size, local_rank
        self.device = device or torch.device("cpu")
        self.sharded = sharding == "fsdp"
        self.precision = precision  # of the inner steps (autocast): auto, fp32 or bf16
        self._synced: tuple[int, str] | None = None  # (outer step, global sha256) the other ranks hold
        self._check_due = False
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._params: list[torch.Tensor] = []  # the model's params: whole tensors, or (FSDP) this rank's shards
        self._local: ShardedLocal | None = None  # FSDP: rank 0's full copy of the local params

    @classmethod
    def from_environment(
        cls, env: Mapping[str, str], timeout_s: float, sharding: str = "ddp", device: str = "auto", precision: str = "auto"
    ) -> Island:
        """The island torchrun describes in ``env`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
        with its process group started (gloo on CPU, nccl on GPU); a single process without them, on ``device``
        (auto: a GPU if torch sees one). Raises ValueError for a GPU that torch does not see."""
        size = int(env.get("WORLD_SIZE", "1"))
        if size <= 1:
            if device == "auto":
                chosen = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            else:
                chosen = torch.device(device)
            if chosen.type == "cuda":
                if not torch.cuda.is_available() or (chosen.index or 0) >= torch.cuda.device_count():
                    raise ValueError(f"--device {device}: torch sees no such GPU ({torch.cuda.device_count()} GPUs)")
                torch.cuda.set_device(chosen)
            return cls(device=chosen, sharding=sharding, precision=precision)  # FSDP over one rank is refused here
        rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            device, backend = torch.device("cuda", local_rank), "nccl"
            torch.cuda.set_device(device)
        else:
            device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        logger.info("island rank %d of %d on %s (%s), collectives time out after %.0f s", rank, size, device, backend, timeout_s)
        return cls(rank, size, local_rank, device, sharding, precision)

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

    def evaluation_model(self, model: torch.nn.Module) -> tuple[torch.nn.Module, torch.device]:
        """The module and device rank 0 evaluates the global params with: ``model`` itself on the island's device,
        or (FSDP: ``wrap`` shards the model in place) an unsharded copy on the CPU. Call it before ``wrap``."""
        if self.sharded and self.is_leader:
            return copy.deepcopy(model), torch.device("cpu")
        return model, self.device

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place ``model`` (in place) and return the module the inner steps call: the model itself (one rank, or
        FSDP: sharded in place over the island's ranks), or DDP around it."""
        if self.sharded:
            from p2p_diloco.train.fsdp import shard_model

            return shard_model(model, self.device, self.size)  # moves each rank's shards to the device
        model.to(self.device)
        if self.size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # buffers are built the same on every rank and never trained: no sync at every forward
        return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, initial: Sequence[torch.Tensor]) -> None:
        """The wrapped ``model`` and its inner ``optimizer``; with FSDP rank 0's full copy of the local params
        starts as ``initial`` (the model's values before it was sharded)."""
        self._model, self._optimizer, self._params = model, optimizer, list(model.parameters())
        if self.sharded:
            from p2p_diloco.train.fsdp import ShardedLocal

            self._local = ShardedLocal(model, optimizer, self.is_leader, list(initial))

    def local_params(self) -> list[torch.Tensor]:
        """Rank 0: the local params as whole tensors, up to date: the model's own (one rank, DDP), or rank 0's
        full copy (FSDP), gathered from the shards first if an inner step ran since. Writing to them changes
        the local params; with FSDP the change reaches the shards at the next ``sync`` (rank 0's state changed)."""
        if self._local is None:
            return self._params
        if not self._local.fresh:
            self._request(_GATHER_PARAMS)
        return self._local.full

    def trained(self) -> None:
        """An inner step changed the local params: with FSDP rank 0's full copy is out of date."""
        if self._local is not None:
            self._local.fresh = False

    def local_model_state(self) -> dict[str, torch.Tensor]:
        """Rank 0: the local model's ``state_dict()``, unsharded (FSDP: from the full copy, gathered if stale)."""
        if self._local is None:
            return self._model.state_dict()
        self.local_params()
        return self._local.model_state()

    def inner_state(self) -> dict[str, Any]:
        """Rank 0: the inner optimizer's ``state_dict()``, unsharded (FSDP: gathered from the ranks)."""
        if self._local is None or not self._optimizer.state:
            # nothing to gather before the first inner step (and torch would initialize the state to gather it,
            # counting an AdamW step that never happened)
            return self._optimizer.state_dict()
        if self._local.held_inner is not None:  # resumed and not yet shared at start
            return self._local.held_inner
        return self._request(_GATHER_INNER)

    def load_local(self, model_state: dict, inner_state: dict) -> None:
        """Rank 0 at a resume: a checkpoint's local model and inner optimizer state (FSDP: held, and scattered
        to the ranks at start). Raises ValueError, and changes nothing, if they do not fit this model."""
        if self._local is not None:
            self._local.load(model_state, inner_state)
            return
        model, optimizer = self._model, self._optimizer
        model_before = {k: v.clone() for k, v in model.state_dict().items()}
        inner_before = optimizer.state_dict()
        try:
            model.load_state_dict(model_state)
            optimizer.load_state_dict(inner_state)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            model.load_state_dict(model_before)
            optimizer.load_state_dict(inner_before)
            raise ValueError(type(e).__name__) from None

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast (``precision`` bf16, or auto on a GPU) or none (fp32): the inner steps' arithmetic only; the
        params, their inner optimizer state, the outer gradient and the global state stay fp32 everywhere."""
        if self.inner_precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def inner_precision(self) -> str:
        """What the inner steps compute in: bf16 (asked for, or auto on a GPU) or fp32."""
        return "bf16" if self.precision == "bf16" or (self.precision == "auto" and self.device.type == "cuda") else "fp32"

    def share_start(self, position: int) -> int:
        """Rank 0's data ``position`` and inner optimizer state (a resume, say) to every rank, once at start;
        returns rank 0's position."""
        if self.size == 1:
            return position
        device = self.device if self.device.type == "cuda" else None
        if self._local is None:  # DDP: the whole state, small next to the model
            box = [dict(inner=self._optimizer.state_dict(), position=position) if self.is_leader else None]
            dist.broadcast_object_list(box, src=0, device=device)
            if not self.is_leader:
                self._optimizer.load_state_dict(box[0]["inner"])
            return box[0]["position"]
        held = self._local.held_inner
        box = [dict(inner=bool(held and held.get("state")), position=position) if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, device=device)
        if box[0]["inner"]:
            self._local.scatter_inner(held)
        self._local.held_inner = None
        return box[0]["position"]

    def sync(self, stop: bool, outer_step: int, global_sha256: str, global_state: Sequence[torch.Tensor]) -> Control:
        """An inner step boundary: rank 0's ``stop`` and state reach every rank (followers' arguments other than
        the tensors are ignored; their local params are overwritten when rank 0's changed, and with DDP their
        ``global_state`` too: the global params and outer momentum, which ``global_sha256`` fingerprints)."""
        if self.size == 1:
            return Control(stop, outer_step)
        changed = self.is_leader and self._synced != (outer_step, global_sha256)
        check = self.is_leader and not changed and self._check_due
        control = torch.tensor([int(stop), int(changed), int(check), outer_step, _BOUNDARY], dtype=torch.int64, device=self.device)
        self._broadcast_control(control)
        while control[-1].item() != _BOUNDARY:  # only on the other ranks: rank 0 asks for something first
            self._serve(int(control[-1].item()))
            self._broadcast_control(control)
        stop, changed, check, outer_step, _ = (int(v) for v in control.tolist())
        if changed and self._local is not None:
            self._local.scatter()
            self._check_shards(outer_step)
            self._synced = (outer_step, global_sha256)
            if self.is_leader:  # the other ranks of an FSDP island hold no global params
                logger.info("island rank 0: outer step %d global sha256 %s", outer_step, global_sha256)
        elif changed:
            self._broadcast_params(self._params + list(global_state))
            sha = global_sha256 if self.is_leader else params_sha256(global_state)  # = outer.state_sha256
            self._synced, self._check_due = (outer_step, sha), True
            logger.info("island rank %d: outer step %d global sha256 %s", self.rank, outer_step, sha)
        elif check:
            self._check_local(outer_step, self._params)
        return Control(bool(stop), outer_step)

    def _request(self, kind: int) -> Any:
        """Rank 0, between two boundaries: ask the other ranks (waiting in ``sync``) to take part in ``kind``."""
        self._broadcast_control(torch.tensor([0, 0, 0, 0, kind], dtype=torch.int64, device=self.device))
        return self._serve(kind)

    def _serve(self, kind: int) -> Any:
        if self._local is None:
            raise IslandDiverged(f"island rank {self.rank}: rank 0 asked for {kind}, which only an FSDP island asks for")
        if kind == _GATHER_PARAMS:
            return self._local.gather()
        if kind == _GATHER_INNER:
            return self._local.gather_inner()
        raise IslandDiverged(f"island rank {self.rank}: rank 0 asked for {kind}, which this version does not know")

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

    def _check_shards(self, outer_step: int) -> None:
        """FSDP, right after a scatter: the sha256 each rank's shards must have, computed by rank 0 from its full
        copy, to every rank; a rank whose shards differ raises IslandDiverged."""
        own = self._local.own_shard_sha256()
        expected = self._local.shard_sha256s(self.size) if self.is_leader else ["00" * 32] * self.size
        digests = torch.tensor([list(bytes.fromhex(sha)) for sha in expected], dtype=torch.uint8, device=self.device)
        dist.broadcast(digests, src=0)
        wanted = bytes(digests[self.rank].tolist()).hex()
        logger.info("island rank %d: outer step %d shard sha256 %s", self.rank, outer_step, own)
        if own != wanted:
            raise IslandDiverged(f"island rank {self.rank} holds other shards than rank 0 sent at outer step {outer_step}")

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
