"""Shared fixtures for the unit tests: a tiny generated corpus and a tiny peer config."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from p2p_diloco.core.config import DataConfig, InnerConfig, OuterConfig, PeerConfig, RunConfig

from .helpers import TINY_MODEL

_WORDS = "def class return import yield lambda for while if else try except with as pass None True False".split()


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder of 4 generated text files, about 100 KB in all (DataConfig needs at least 64 KiB)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(1234)
    for index in range(4):
        lines = []
        size = 0
        while size < 25_000:
            line = " ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(rng.randrange(3, 12)))
            lines.append(line)
            size += len(line) + 1
        Path(root, f"part_{index}.txt").write_text("\n".join(lines), encoding="utf-8")
    return str(root)


@pytest.fixture
def make_config(tiny_corpus: str):
    """Build a tiny PeerConfig on the tiny corpus; keyword arguments replace whole sections."""

    def make(**sections) -> PeerConfig:
        defaults = dict(
            model=TINY_MODEL,
            data=DataConfig(corpus_dir=tiny_corpus),
            inner=InnerConfig(inner_steps=1, batch_size=4, lr=1e-3, weight_decay=0.1, grad_clip_norm=1.0),
            outer=OuterConfig(),
            run=RunConfig(eval_batches=1, seed=3),
        )
        defaults.update(sections)
        return PeerConfig(**defaults)

    return make
