"""A small GPT-style decoder built from ModelConfig (pre-LayerNorm, causal attention, tied embeddings).

It deliberately stays minimal: no dropout, no KV cache, no weight loading. Parameter order is fixed by
construction, and its random init draws portable bytes (portable.portable_init), so every peer that builds it
from the same config and seed gets identical tensors on any CPU or GPU (docs/design.md §5).
``build_model`` also builds a Hugging Face transformers model when the config names one (hf_model.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from p2p_diloco.core.config import ModelConfig
from p2p_diloco.core.portable import portable_init


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        # (B, T, 3C) -> 3 x (B, heads, T, C/heads)
        q, k, v = self.qkv(x).view(batch, time, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (B, T) int64. Returns logits (B, T, vocab), or the mean cross-entropy if targets are given."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.token_embedding.weight.T  # tied output head
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(config: ModelConfig, seed: int) -> nn.Module:
    """Build the model with a seeded init, so that every peer of a run starts from the same bytes on any hardware:
    the built-in GPT, or the transformers model that ``config`` names. Either is called as ``model(tokens, targets)``."""
    if config.transformers_model:
        from p2p_diloco.train.hf_model import build_transformers_model  # imports transformers: only when asked for

        return build_transformers_model(config, seed)
    # torch's normal_ is not portable (its vectorised kernel and its default one compute different transcendental
    # functions): every draw of the constructor comes from portable_init, and torch's generator is left untouched
    with portable_init(seed):
        return GPT(config)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
