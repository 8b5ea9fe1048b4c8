"""Helpers shared by the unit tests: the tiny model config, dataset building, and parameter snapshots."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from p2p_diloco.config import ModelConfig, PeerConfig
from p2p_diloco.data import Dataset
from p2p_diloco.model import build_model

TINY_MODEL = ModelConfig(n_layers=1, d_model=32, n_heads=2, seq_len=16)


def make_dataset(config: PeerConfig) -> Dataset:
    """The dataset exactly as the CLI builds it for a peer."""
    return Dataset(config.data, config.model.seq_len, config.inner.batch_size, config.run.seed)


def snapshot(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def assert_all_close(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], **tolerances) -> None:
    assert len(actual) == len(expected)
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a.detach(), e.detach(), msg=lambda m, i=index: f"tensor {i}: {m}", **tolerances)


def plain_adamw(config: PeerConfig, steps: int) -> list[torch.Tensor]:
    """The reference: the same init, batches and clipping, ``steps`` plain AdamW steps, no outer loop."""
    model = build_model(config.model, config.run.seed)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=config.inner.lr, weight_decay=config.inner.weight_decay)
    dataset = make_dataset(config)
    for _ in range(steps):
        inputs, targets = dataset.train.next_batch()
        loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, config.inner.grad_clip_norm)
        optimizer.step()
    return snapshot(params)
