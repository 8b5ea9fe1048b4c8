"""Helpers shared by the unit tests: the tiny model config, dataset building, parameter snapshots, small files for
the Hugging Face paths (documents, parquet, a BPE tokenizer, a transformers config.json), and a script's refusal of
an ``--out`` that is a file."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from p2p_diloco.core.config import ModelConfig, PeerConfig
from p2p_diloco.train.data import DataSource, open_dataset
from p2p_diloco.train.model import build_model

TINY_MODEL = ModelConfig(n_layers=1, d_model=32, n_heads=2, seq_len=16)


def make_dataset(config: PeerConfig) -> DataSource:
    """The dataset exactly as the CLI builds it for a peer."""
    return open_dataset(config.data, config.model.seq_len, config.inner.batch_size, config.run.seed)


def run_learner(config: PeerConfig):
    """Build a learner (resuming if the config says so) and run it alone to its stop, with the int8 codec."""
    from p2p_diloco.core.link import LocalLink
    from p2p_diloco.observe.metrics import NullSink
    from p2p_diloco.train.learner import Learner

    learner = Learner(config, make_dataset(config), NullSink())
    if config.run.resume:
        learner.resume()
    learner.run(LocalLink("int8"))
    return learner


def snapshot(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def flat(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-param tensors in the form an averaging carries them: one flat buffer (train/fragments.py, P = 1)."""
    return [torch.cat([t.detach().reshape(-1) for t in tensors])]


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


_WORDS = "the cat sat on a mat and dog ran far away while birds sang softly over green hills".split()


def documents(count: int, seed: int = 0) -> list[str]:
    """``count`` short generated documents; document i begins with its number, ``doc0042``, so that a token
    window shows which documents it came from."""
    rng = random.Random(seed)
    return [f"doc{i:04d} " + " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(8, 40))) for i in range(count)]


def write_parquet(path: Path, texts: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: texts, "length": [len(t) for t in texts]}), path)
    return path


def train_tokenizer(texts: list[str], path: Path, vocab_size: int = 300) -> Path:
    """A small byte-level BPE tokenizer trained on ``texts``, saved as a tokenizers file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path


def write_model_config(path: Path, vocab_size: int, model_type: str = "llama", max_positions: int = 64) -> Path:
    """A tiny transformers config.json: 2 layers, width 32."""
    shapes = {
        "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=max_positions),
        # tied output head and dropout: what the Llama config lacks
        "gpt2": dict(n_embd=32, n_layer=2, n_head=2, n_positions=max_positions, bos_token_id=0, eos_token_id=0),
    }
    path.write_text(json.dumps(dict(model_type=model_type, vocab_size=vocab_size, **shapes[model_type])))
    return path


def assert_out_file_refused_and_kept(main: Callable[[list[str]], int], path: Path, capsys) -> None:
    """A script's ``--out`` that names a file: refused in one line with exit 2, and the file left as it was."""
    path.write_text("earlier results")
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(path)])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "is a file, not a folder" in error and len(error.splitlines()) == 1
    assert path.read_text() == "earlier results"
