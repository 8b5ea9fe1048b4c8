"""Byte-level training data: the default corpus and per-peer shards with a resumable position.

The default corpus is the Python standard library's own ``.py`` sources (the folder of the ``os``
module, without site-packages and test suites), present on every Python install, so nothing is downloaded. Users can
point ``corpus_dir`` to their own folder of text files. The last ``eval_fraction`` of the bytes is held
out for evaluation and never trained on. This module does not tokenize beyond raw bytes.

A user's folder may hold anything: only regular files are read (a named pipe or a link to /dev/zero would
block or never end), binary files are skipped, and a corpus too large to hold in memory is refused.

``open_dataset`` is what a process calls: this byte corpus, or the user's text, JSONL and parquet files through
Hugging Face datasets (text_data.py, imported only then) when ``dataset`` names some.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Protocol

import torch

from p2p_diloco.core.config import DataConfig

logger = logging.getLogger(__name__)

# Third-party packages and the test suites are left out: about 12 MB of library code remains.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
# The corpus is held in memory whole, twice while it is joined: refuse more rather than be OOM-killed mid-read.
MAX_CORPUS_BYTES = 4 << 30
_BINARY_SNIFF_BYTES = 8192  # a NUL byte in a file's first 8 KiB marks it as binary (git's heuristic)


def default_corpus_dir() -> Path:
    return Path(os.__file__).resolve().parent


def _corpus_files(root: Path, default: bool) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in sorted(filenames):
            if not default or name.endswith(".py"):
                files.append(Path(dirpath) / name)
    return files


def load_corpus(corpus_dir: str | None) -> torch.Tensor:
    """All bytes of the corpus, in sorted path order, as a uint8 tensor. Raises ValueError if unusable."""
    root = Path(corpus_dir) if corpus_dir else default_corpus_dir()
    if not root.is_dir():
        raise ValueError(f"corpus folder {root} does not exist or is not a folder")
    chunks, total, binary = [], 0, 0
    for path in _corpus_files(root, default=corpus_dir is None):
        data = _read_regular_file(path, limit=MAX_CORPUS_BYTES - total)
        if data is None:
            continue  # not a regular file, or unreadable (permissions, broken or looping links): skipped
        if b"\0" in data[:_BINARY_SNIFF_BYTES]:
            binary += 1
            continue
        total += len(data)
        chunks.append(data)
    if binary:
        logger.warning("corpus folder %s: skipped %d binary file(s)", root, binary)
    data = b"\n".join(chunks)
    if len(data) < 1 << 16:
        raise ValueError(f"corpus folder {root} holds only {len(data)} bytes of text; need at least 64 KiB")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _read_regular_file(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path`` if it is a readable regular file (links followed), else None; ValueError if it has
    more than ``limit`` bytes (what is left of the corpus budget). Opened non-blocking and checked after
    opening, so a named pipe neither blocks the open nor is read, and a file cannot be swapped for one in
    between; at most the size it had when opened is read (a device has none)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        if info.st_size > limit:
            raise ValueError(f"the corpus goes past {MAX_CORPUS_BYTES >> 30} GiB of text at {path}; point --corpus-dir to a smaller folder")
        try:
            return handle.read(info.st_size)
        except OSError:
            return None


class TokenShard:
    """Random windows from one contiguous shard of a token tensor; ``position`` makes the order resumable.

    Batch k is drawn from a generator seeded by (seed, k), so a peer restarted at position k reads
    exactly what it would have read.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        if tokens.numel() < seq_len + 2:
            raise ValueError(f"shard of {tokens.numel()} tokens is shorter than one sequence of {seq_len}")
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.position = 0  # batches drawn so far

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len) int64, targets shifted by one token."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.batch_size,), generator=generator)
        windows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len


class Batches(Protocol):
    """A peer's training shard: batches in a resumable order."""

    position: int  # batches drawn so far; restoring it resumes the order exactly

    @property
    def tokens_per_batch(self) -> int: ...

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...


class DataSource(Protocol):
    """What a learner reads: its training shard and fixed held-out batches."""

    train: Batches
    total_bytes: int
    vocab_size: int  # token ids are below this: the model's vocabulary must cover it

    def eval_batches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def open_dataset(config: DataConfig, seq_len: int, batch_size: int, seed: int) -> DataSource:
    """This peer's data: the user's files (``config.dataset``) or the byte corpus. ValueError if unusable."""
    if config.dataset:
        from p2p_diloco.train.text_data import FileDataset  # imports datasets and tokenizers: only when asked for

        return FileDataset(config, seq_len, batch_size, seed)
    return Dataset(config, seq_len, batch_size, seed)


class Dataset:
    """The corpus split into a training shard for this peer and a held-out evaluation tail."""

    def __init__(self, config: DataConfig, seq_len: int, batch_size: int, seed: int):
        corpus = load_corpus(config.corpus_dir)
        eval_size = max(int(corpus.numel() * config.eval_fraction), seq_len * batch_size + 2)
        train, self.eval_tokens = corpus[:-eval_size], corpus[-eval_size:]
        shard_size = train.numel() // config.num_shards
        shard = train[config.shard_index * shard_size : (config.shard_index + 1) * shard_size]
        self.total_bytes = corpus.numel()
        self.vocab_size = 256  # raw bytes
        self.train = TokenShard(shard, seq_len, batch_size, seed=seed + 7919 * (config.shard_index + 1))
        self.seq_len, self.batch_size = seq_len, batch_size

    def eval_batches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same ``count`` held-out batches every call (fixed seed), so evaluations are comparable."""
        held_out = TokenShard(self.eval_tokens, self.seq_len, self.batch_size, seed=12345)
        return [held_out.next_batch() for _ in range(count)]
