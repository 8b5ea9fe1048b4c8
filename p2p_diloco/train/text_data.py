"""A user's text, JSONL and parquet files as training data, read through Hugging Face ``datasets``.

Each line of a text file, and each row of a JSONL or parquet file (its ``text_field``), is a document. The
documents, in sorted path order, end with a newline and are tokenized with a ``tokenizers`` file, or read as
UTF-8 bytes without one. The last ``eval_fraction`` of the documents is held out for evaluation and never
trained on; the others are split into ``num_shards`` contiguous shards of documents, one per peer.

Every peer converts all the files to Arrow once (to count the documents; peers on one machine share that
cache), but tokenizes only its own shard, packs the tokens into chunks of ``seq_len + 1`` (inputs and shifted
targets) and reads them in a seeded order, each chunk once per pass over the shard. ``datasets`` keeps the
documents and the chunks in memory-mapped Arrow files in its cache (``cache_dir``), so a shard larger than
memory works, and a restarted peer reuses the chunks it made. Batch k depends only on the seed and k, so the
checkpointed ``position`` (batches drawn) resumes the exact order, as with the byte corpus (data.py).

It does not stream from remote storage, mix datasets by weight, or pack across the batches of documents that
are tokenized together (each drops its last partial chunk). ``datasets`` and ``tokenizers`` are imported only
here, and this module only when a run names files, so that the default start-up does not pay for them.
Nothing is downloaded (hf_model.force_offline).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch

from p2p_diloco.core.config import DataConfig
from p2p_diloco.train.hf_model import force_offline, one_line

logger = logging.getLogger(__name__)

# file name endings -> the datasets builder that reads them
FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
BYTE_VOCAB = 256
_MAX_TOKENIZER_BYTES = 1 << 30  # a tokenizer.json is a few MB; this bounds what a wrong path reads
_EVAL_CHUNKS_MAX = 1024  # held-out chunks kept for evaluation: more than any eval_batches x batch_size used
_MAP_BATCH_DOCS = 100  # documents tokenized and packed together; each such batch drops its last partial chunk
_CHUNKS_VERSION = "chunks-v1"  # part of the cache key of the chunks: change it when the packing changes


def find_files(paths: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(builder, file) for every data file named or inside a named folder, in sorted order; ValueError if a
    path does not exist, a named file is not a regular file of a known kind, or nothing usable is found."""
    found: list[tuple[str, Path]] = []
    kinds = ", ".join(sorted(FORMATS))
    for name in paths:
        path = Path(name)
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if _kind(p) and _is_regular(p))
            if not inside:
                raise ValueError(f"dataset folder {path} holds no {kinds} files")
            found += [(_kind(p), p) for p in inside]
        elif not path.exists():
            raise ValueError(f"dataset path {path} does not exist")
        elif not _is_regular(path):  # a named pipe would block the read, a device never end
            raise ValueError(f"dataset path {path} is not a regular file or a folder")
        elif not _kind(path):
            raise ValueError(f"dataset file {path} is not one of {kinds}")
        else:
            found.append((_kind(path), path))
    if not found:
        raise ValueError("no dataset files given")
    return found


def _kind(path: Path) -> str | None:
    return FORMATS.get(path.suffix.lower())


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def load_tokenizer(path: str) -> Any:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file; ValueError with a one-line reason otherwise."""
    file = Path(path)
    if not _is_regular(file):
        raise ValueError(f"tokenizer file {file} does not exist or is not a regular file")
    if file.stat().st_size > _MAX_TOKENIZER_BYTES:
        raise ValueError(f"tokenizer file {file} is larger than {_MAX_TOKENIZER_BYTES >> 30} GiB: not a tokenizer")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises its own exception type, with the parser's message
        raise ValueError(f"tokenizer file {file} cannot be read as a tokenizers file: {one_line(e)}") from None


def vocab_size(tokenizer: Any | None) -> int:
    """Token ids are in [0, vocab_size): the tokenizer's vocabulary with its added tokens, or 256 bytes."""
    return BYTE_VOCAB if tokenizer is None else tokenizer.get_vocab_size(with_added_tokens=True)


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _datasets() -> Any:
    force_offline()
    import datasets

    datasets.disable_progress_bars()  # one bar per file and map would fill every peer's log
    return datasets


def load_documents(files: list[tuple[str, Path]], text_field: str, cache_dir: str | None) -> Any:
    """One ``datasets.Dataset`` with a single string column ``text``: the documents of all files, grouped by
    builder in the order their first file comes, each group in path order."""
    datasets = _datasets()
    parts = []
    for builder in dict.fromkeys(kind for kind, _ in files):
        group = [str(path) for kind, path in files if kind == builder]
        options = dict(keep_linebreaks=True) if builder == "text" else {}
        try:
            part = datasets.load_dataset(builder, data_files=group, split="train", cache_dir=cache_dir, **options)
        except Exception as e:  # malformed JSON, a damaged parquet file, ...: datasets wraps them variously
            raise ValueError(f"cannot read the {builder} files of the dataset ({group[0]}, ...): {one_line(e)}") from None
        field = "text" if builder == "text" else text_field
        if field not in part.column_names:
            raise ValueError(f"the {builder} files of the dataset ({group[0]}, ...) have no column {field!r} "
                             f"(columns: {', '.join(part.column_names)}): pass --text-field")
        dtype = getattr(part.features[field], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise ValueError(f"column {field!r} of the dataset's {builder} files holds {dtype or 'nested values'}, not text")
        part = part.select_columns([field])
        parts.append(part.rename_column(field, "text") if field != "text" else part)
    if len(parts) == 1:
        return parts[0]
    for index, part in enumerate(parts):  # large_string and string columns do not concatenate
        parts[index] = part.cast(datasets.Features({"text": datasets.Value("large_string")}))
    return datasets.concatenate_datasets(parts)


class _Encoder:
    """Documents -> token ids: each document ends with a newline (added if missing), then is encoded by the
    tokenizer or as UTF-8 bytes."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer

    def __call__(self, texts: list[str | None]) -> list[np.ndarray]:
        texts = [text or "" for text in texts]  # a missing value (null) is an empty document
        texts = [text if text.endswith("\n") else text + "\n" for text in texts]
        if self.tokenizer is None:
            return [np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8) for text in texts]
        return [np.asarray(encoding.ids, dtype=np.int32) for encoding in self.tokenizer.encode_batch(texts)]


def _pack(texts: list[str | None], encode: _Encoder, length: int) -> np.ndarray:
    """The documents' tokens one after the other, cut into rows of ``length``: (rows, length) int32; the
    last partial row is dropped."""
    tokens = np.concatenate([np.zeros(0, dtype=np.int32), *encode(texts)]).astype(np.int32)
    rows = len(tokens) // length
    return tokens[: rows * length].reshape(rows, length)


def make_chunks(documents: Any, encode: _Encoder, length: int, key: str) -> Any:
    """The documents tokenized and packed into rows of ``length`` tokens, as a memory-mapped ``datasets.Dataset``
    cached under a fingerprint of the documents and ``key`` (tokenizer, length): a restart reuses it."""
    datasets = _datasets()
    # datasets names cache files by fingerprints (``_fingerprint``: no public accessor); the same documents, tokenizer
    # and packing give the same name, so that a restart finds the chunks it made
    packing = f"{key}|{length}|{_MAP_BATCH_DOCS}|{_CHUNKS_VERSION}"
    fingerprint = hashlib.sha256(f"{documents._fingerprint}|{packing}".encode()).hexdigest()[:32]
    return documents.map(
        lambda batch: {"ids": _pack(batch["text"], encode, length)},
        batched=True,
        batch_size=_MAP_BATCH_DOCS,
        remove_columns=documents.column_names,
        features=datasets.Features({"ids": datasets.Sequence(datasets.Value("int32"))}),
        new_fingerprint=fingerprint,  # the lambda cannot be hashed stably: without this, no reuse across restarts
        desc="tokenizing",
    ).with_format("numpy")


class ChunkShard:
    """This peer's chunks in a seeded order; ``position`` (batches drawn) makes the order resumable.

    Pass e over the shard reads the chunks in the permutation seeded by (seed, e); batch k holds reads
    k * batch_size ... (k + 1) * batch_size - 1 of that endless sequence, so it depends only on (seed, k).
    """

    def __init__(self, chunks: Any, seq_len: int, batch_size: int, seed: int):
        self.chunks, self.seq_len, self.batch_size, self.seed = chunks, seq_len, batch_size, seed
        self.count = len(chunks)
        self.position = 0  # batches drawn so far
        self._pass, self._order = -1, torch.empty(0, dtype=torch.long)

    def chunk_index(self, read: int) -> int:
        """The chunk that read number ``read`` (counted over all batches) takes."""
        one_pass, offset = divmod(read, self.count)
        if one_pass != self._pass:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + one_pass)
            self._pass, self._order = one_pass, torch.randperm(self.count, generator=generator)
        return int(self._order[offset])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len) int64, targets shifted by one token."""
        first = self.position * self.batch_size
        self.position += 1
        indices = [self.chunk_index(read) for read in range(first, first + self.batch_size)]
        windows = torch.from_numpy(np.asarray(self.chunks[indices]["ids"], dtype=np.int64))
        return windows[:, :-1], windows[:, 1:]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len


class FileDataset:
    """A dataset of files split into this peer's training shard and held-out documents (the same on every peer)."""

    def __init__(self, config: DataConfig, seq_len: int, batch_size: int, seed: int):
        files = find_files(config.dataset)
        tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
        self.vocab_size = vocab_size(tokenizer)
        self.total_bytes = sum(os.path.getsize(path) for _, path in files)
        self.seq_len, self.batch_size = seq_len, batch_size
        documents = load_documents(files, config.text_field, config.cache_dir)
        self.documents = total = len(documents)
        held_out = max(1, round(total * config.eval_fraction))
        if total - held_out < config.num_shards:
            raise ValueError(f"the dataset holds {total} documents: too few for {held_out} held out and "
                             f"{config.num_shards} training shard(s)")
        train = total - held_out
        first, last = config.shard_index * train // config.num_shards, (config.shard_index + 1) * train // config.num_shards
        encode = _Encoder(tokenizer)
        key = _file_sha256(config.tokenizer) if config.tokenizer else "bytes"
        chunks = make_chunks(documents.select(range(first, last)), encode, seq_len + 1, key)
        if len(chunks) == 0:
            raise ValueError(f"training shard {config.shard_index} of {config.num_shards} (documents {first}-{last - 1}) "
                             f"holds fewer than {seq_len + 1} tokens: use fewer shards, a shorter --seq-len or more data")
        self.train = ChunkShard(chunks, seq_len, batch_size, seed=seed + 7919 * (config.shard_index + 1))
        self.eval_chunks = self._held_out_chunks(documents.select(range(train, total)), encode, seq_len + 1)
        logger.info("dataset: %d documents in %d file(s), %d held out; this shard: documents %d-%d, %d chunks of %d tokens",
                    total, len(files), held_out, first, last - 1, len(chunks), seq_len + 1)

    @staticmethod
    def _held_out_chunks(documents: Any, encode: _Encoder, length: int) -> torch.Tensor:
        """The first chunks of the held-out documents (as many as evaluations use), packed like the training data."""
        parts, count = [np.zeros((0, length), dtype=np.int32)], 0
        for start in range(0, len(documents), _MAP_BATCH_DOCS):
            parts.append(_pack(documents[start : start + _MAP_BATCH_DOCS]["text"], encode, length))
            count += len(parts[-1])
            if count >= _EVAL_CHUNKS_MAX:
                break
        if not count:
            raise ValueError(f"the held-out documents hold fewer than {length} tokens: raise data.eval_fraction or add data")
        return torch.from_numpy(np.concatenate(parts)[:_EVAL_CHUNKS_MAX]).long()

    def eval_batches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The same ``count`` held-out batches every call, so evaluations are comparable (chunks repeat if
        the held-out documents hold fewer than ``count`` batches)."""
        total = count * self.batch_size
        rows = self.eval_chunks[torch.arange(total) % len(self.eval_chunks)]
        return [(batch[:, :-1], batch[:, 1:]) for batch in rows.split(self.batch_size)]
