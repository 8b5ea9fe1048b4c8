"""FSDP2 inside a multi-rank island: each rank holds a shard of the local params and of the inner AdamW state.

The inner steps run on the shards (``torch.distributed.fsdp.fully_shard``: all-gather before each layer,
reduce-scatter of the gradients). The outer machinery of DiLoCo (outer gradient, averaging, outer step, state
download, checkpoints, sha256 checks) stays on rank 0 and works on full fp32 CPU copies of the local params,
``ShardedLocal.full``: gathered from the shards when rank 0 needs them (the end of a round, a catch-up, a
checkpoint) and scattered back into the shards when rank 0 changed them (an outer step, a catch-up, a resume).
Every method marked *collective* must be called on every rank at the same point; island.py arranges that.

Shards are split as FSDP2 splits them: dim 0 of each parameter in ``torch.chunk`` pieces, rank r holding
piece r (or nothing). ``shard_sha256s`` relies on that layout; a different layout would show as a failed
check, not pass unnoticed.

This module does not choose when to gather or scatter (island.py does), does not offload params to the CPU
between steps, does not use FSDP's mixed precision (the island's autocast stays), and does not initialize
the model on the meta device: every rank builds the whole model on the CPU first, then shards it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from p2p_diloco.core.outer import params_sha256

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)


def shard_model(model: nn.Module, device: torch.device, size: int) -> nn.Module:
    """Shard ``model`` in place over ``size`` ranks on ``device``: one FSDP unit per layer of every ModuleList
    (the transformer blocks of the built-in GPT and of transformers models), one for the rest."""
    mesh = init_device_mesh(device.type, (size,))
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for layer in module:
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class ShardedLocal:
    """Rank 0's full view of an FSDP island's local params and inner optimizer state (other ranks: none)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, leader: bool, initial: list[torch.Tensor]):
        self.model, self.optimizer, self.leader = model, optimizer, leader
        self.names = [name for name, _ in model.named_parameters()]
        self.params = list(model.parameters())  # DTensors: this rank's shards
        # full fp32 CPU local params on rank 0, in model.parameters() order; ``fresh`` while no inner step ran since
        self.full = [t.detach().to("cpu", torch.float32, copy=True) for t in initial] if leader else []
        self.fresh = True
        self.held_inner: dict | None = None  # a resumed inner optimizer state (full, rank 0), scattered at start

    def gather(self) -> None:
        """*Collective.* The shards' current values into rank 0's ``full`` (one parameter at a time)."""
        with torch.no_grad():
            for index, param in enumerate(self.params):
                value = param.full_tensor()  # all-gather: every rank takes part
                if self.leader:
                    self.full[index].copy_(value)
        self.fresh = True

    def scatter(self) -> None:
        """*Collective.* Rank 0's ``full`` into every rank's shards (each rank keeps its own piece)."""
        state = dict(zip(self.names, self.full)) if self.leader else {}
        set_model_state_dict(self.model, state, options=_SCATTER)

    def own_shard_sha256(self) -> str:
        return params_sha256([param.to_local() for param in self.params])

    def shard_sha256s(self, size: int) -> list[str]:
        """Rank 0: the sha256 each rank's shards must have if they hold exactly ``full``."""
        pieces: list[list[torch.Tensor]] = [[] for _ in range(size)]
        for full in self.full:
            chunks = full.chunk(size, dim=0)
            for rank in range(size):
                pieces[rank].append(chunks[rank] if rank < len(chunks) else full[:0])
        return [params_sha256(rank_pieces) for rank_pieces in pieces]

    def gather_inner(self) -> dict:
        """*Collective.* The full inner optimizer state, on rank 0 ({} elsewhere), in ``Optimizer.state_dict()``
        form (params by index): a checkpoint of an FSDP island resumes in a single process or DDP, and back."""
        state = get_optimizer_state_dict(self.model, self.optimizer, options=_GATHER)
        if not self.leader:
            return {}
        index = {name: i for i, name in enumerate(self.names)}
        return dict(
            state={index[name]: value for name, value in state["state"].items()},
            param_groups=[
                dict(group, params=[index[name] for name in group["params"]]) for group in state["param_groups"]
            ],
        )

    def scatter_inner(self, state: dict | None) -> None:
        """*Collective.* Rank 0's full inner optimizer ``state`` (``Optimizer.state_dict()`` form) into every
        rank's shards of it; the other ranks pass None."""
        by_name = {}
        if self.leader and state is not None:
            by_name = dict(
                state={self.names[i]: value for i, value in state["state"].items()},
                param_groups=[
                    dict(group, params=[self.names[i] for i in group["params"]]) for group in state["param_groups"]
                ],
            )
        set_optimizer_state_dict(self.model, self.optimizer, by_name, options=_SCATTER)

    def model_state(self) -> dict[str, torch.Tensor]:
        """Rank 0: the local model as ``state_dict()`` would give it unsharded (tied params under each name)."""
        index = {id(param): i for i, param in enumerate(self.params)}
        state = {
            name: self.full[index[id(param)]] for name, param in self.model.named_parameters(remove_duplicate=False)
        }
        persistent = set(self.model.state_dict())
        state.update({name: buffer.detach().cpu() for name, buffer in self.model.named_buffers() if name in persistent})
        return state

    def load(self, model_state: dict, inner_state: dict) -> None:
        """Rank 0 at a resume (no collective): check a checkpoint's local model and inner optimizer state against
        this model, then hold them until they are scattered at start. Raises ValueError; changes nothing then."""
        values = []
        for name, full in zip(self.names, self.full):
            value = model_state.get(name)
            if not isinstance(value, torch.Tensor) or value.shape != full.shape:
                raise ValueError(f"its local model lacks {name} or holds it in another shape")
            values.append(value)
        groups = inner_state.get("param_groups")
        indices = sorted(i for group in groups or () for i in group.get("params", ()))
        if indices != list(range(len(self.names))):
            raise ValueError("its inner optimizer state is for another number of params")
        for i, entry in inner_state.get("state", {}).items():
            if not isinstance(i, int) or not 0 <= i < len(self.full):
                raise ValueError(f"its inner optimizer state names a param {i!r} this model lacks")
            moments = [entry[key] for key in ("exp_avg", "exp_avg_sq") if key in entry]
            if any(moment.shape != self.full[i].shape for moment in moments):
                raise ValueError(f"its inner optimizer state does not fit {self.names[i]}")
        with torch.no_grad():
            for full, value in zip(self.full, values):
                full.copy_(value)
        self.held_inner, self.fresh = inner_state, True
