"""An island's inner optimizer: AdamW (the default), or Muon on the transformer blocks' weight matrices and AdamW on
every other param (``--inner-optimizer muon``; docs/design.md §2, docs/learning.md "Muon islands").

Muon (momentum, then the update orthogonalized by a Newton–Schulz iteration) is what MuLoCo (Thérien et al. 2025)
runs inside DiLoCo; in the learning study it took DiLoCo's held-out loss 17–19% lower at the same bytes, and the gap
to sync DP (with Muon too) at 1,024× fewer bytes from +15.4% to +9.5%, at sync DP's own inner lr (not half of it, as
AdamW islands want). Its update is scaled to AdamW's RMS (0.2 √max(rows, cols), Moonshot's rule), so the AdamW lr
and weight decay carry over. Embeddings, biases and norms stay with AdamW: a lookup table's rows and a vector have no
matrix for the orthogonalization to act on.

``MuonAdamW`` is one ``torch.optim.Optimizer`` with one parameter group per param, in the model's order, so that
everything that handles the inner state (checkpoints, their validation, a torchrun island's broadcast, the lr
schedule writing ``group["lr"]``) sees one optimizer whose state ``i`` belongs to local param ``i``, as with AdamW.
Its arithmetic is torch's own ``Muon(adjust_lr_fn="match_rms_adamw")`` and single-tensor ``AdamW``, op for op
(tests/unit/test_inner_optimizer.py checks equality); torch's Muon is not used directly as it exists only in recent
torch releases and takes matrices only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic Newton–Schulz iteration of Muon (torch's and Keller Jordan's)
NS_STEPS = 5
MUON_MOMENTUM = 0.95


def muon_params(model: nn.Module) -> set[int]:
    """The ids of the params Muon steps: every 2-D param but the embedding tables (any ``nn.Embedding``'s) and the
    output head (a transformers model's ``get_output_embeddings()``, when it is not tied to the input's). In the
    built-in GPT: the attention and MLP matrices of every block."""
    excluded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        output = getattr(module, "get_output_embeddings", None)
        head = output() if callable(output) else None
        if isinstance(getattr(head, "weight", None), torch.Tensor):
            excluded.add(id(head.weight))
    return {id(p) for p in model.parameters() if p.ndim == 2 and id(p) not in excluded}


def build_inner_optimizer(kind: str, model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The island's inner optimizer of ``kind`` (``adamw`` or ``muon``) over ``model.parameters()``, in their order."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    if kind == "muon":
        return MuonAdamW(model.parameters(), muon_params(model), lr=lr, weight_decay=weight_decay)
    raise ValueError(f"inner optimizer must be adamw or muon, got {kind!r}")


def orthogonalize(update: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """Muon's Newton–Schulz iteration in bf16: about U V^T of the update's SVD (singular values pushed to ~0.5–1.5)."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # the spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the params whose ids are in ``muon`` (2-D), AdamW (torch's defaults: betas 0.9/0.999, eps 1e-8) on the
    rest, both with decoupled weight decay at the same lr; one group per param, in ``params``' order (module
    docstring)."""

    def __init__(self, params: Iterable[torch.Tensor], muon: set[int], lr: float, weight_decay: float,
                 momentum: float = MUON_MOMENTUM):
        groups = [dict(params=[p], use_muon=id(p) in muon) for p in params]
        if any(g["use_muon"] and g["params"][0].ndim != 2 for g in groups):
            raise ValueError("Muon steps matrices only")
        if not groups:
            raise ValueError("the inner optimizer needs at least one param")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True, ns_steps=NS_STEPS,
                        betas=(0.9, 0.999), eps=1e-8)
        super().__init__(groups, defaults)

    def __setstate__(self, state: dict) -> None:
        """As torch's Adam: a step count saved as a number becomes the tensor the arithmetic reads."""
        super().__setstate__(state)
        for param_state in self.state.values():
            if "step" in param_state and not torch.is_tensor(param_state["step"]):
                param_state["step"] = torch.tensor(float(param_state["step"]))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (torch's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon(param, group)
                else:
                    self._adamw(param, group)
        return loss

    def _muon(self, param: torch.Tensor, group: dict) -> None:
        """torch's Muon, single tensor, ``adjust_lr_fn="match_rms_adamw"``."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1  # not used by Muon's arithmetic: kept so that every param's state says how far it went
        grad, buffer, momentum = param.grad, state["momentum_buffer"], group["momentum"]
        buffer.lerp_(grad, 1 - momentum)
        update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        update = orthogonalize(update, group["ns_steps"])
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(update, alpha=-(lr * (0.2 * math.sqrt(max(param.shape[0], param.shape[1])))))  # torch's rounding

    def _adamw(self, param: torch.Tensor, group: dict) -> None:
        """torch's AdamW, single tensor (what it runs on a CPU)."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        grad, exp_avg, exp_avg_sq = param.grad, state["exp_avg"], state["exp_avg_sq"]
        (beta1, beta2), lr = group["betas"], group["lr"]
        state["step"] += 1
        step = state["step"].item()
        param.mul_(1 - lr * group["weight_decay"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        param.addcdiv_(exp_avg, denom, value=-(lr / (1 - beta1**step)))
