"""A user's files through Hugging Face datasets: per-peer shards of documents and held-out documents that never
overlap, a seeded order that resumes from the checkpointed position, each chunk once per pass, text / JSONL /
parquet with a chosen text field, chunks reused across restarts, and one-line errors for unusable input."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch

from p2p_diloco.core.config import DataConfig
from p2p_diloco.train.data import open_dataset
from p2p_diloco.train.text_data import FileDataset, load_tokenizer

from .helpers import documents, train_tokenizer, write_parquet

DOCS = 240
SEQ_LEN, BATCH = 32, 4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("text_data")
    texts = documents(DOCS)
    return SimpleNamespace(
        root=root,
        texts=texts,
        parquet=write_parquet(root / "docs.parquet", texts),
        tokenizer=train_tokenizer(texts, root / "tokenizer.json"),
        cache=str(root / "cache"),
    )


def _open(files: SimpleNamespace, seed: int = 0, **fields) -> FileDataset:
    fields.setdefault("dataset", (str(files.parquet),))
    dataset = open_dataset(DataConfig(cache_dir=files.cache, **fields), SEQ_LEN, BATCH, seed)
    assert isinstance(dataset, FileDataset)
    return dataset


def _doc_numbers(rows: torch.Tensor) -> set[int]:
    """Which documents byte-level chunks, in their stored order, hold text of (each begins with ``docNNNN``)."""
    return {int(n) for n in re.findall(r"doc(\d{4})", bytes(rows.flatten().tolist()).decode(errors="replace"))}


def _all_chunks(dataset: FileDataset) -> torch.Tensor:
    return torch.as_tensor(dataset.train.chunks[list(range(dataset.train.count))]["ids"])


def test_shards_and_held_out_documents_never_overlap(files):
    shards = [_open(files, num_shards=3, shard_index=i) for i in range(3)]
    held_out = round(DOCS * DataConfig().eval_fraction)
    trained = [_doc_numbers(_all_chunks(shard)) for shard in shards]
    evaluated = _doc_numbers(shards[0].eval_chunks)
    for i in range(3):
        for j in range(i + 1, 3):
            assert not trained[i] & trained[j], (i, j)
        assert not trained[i] & evaluated
    assert evaluated and min(evaluated) >= DOCS - held_out  # the tail of the documents, the same on every peer
    assert set().union(*trained) | evaluated == set(range(DOCS))  # nothing else is lost
    for shard in shards[1:]:
        torch.testing.assert_close(shard.eval_chunks, shards[0].eval_chunks, rtol=0, atol=0)
    assert max(trained[0]) < min(trained[1]) <= max(trained[1]) < min(trained[2])  # contiguous, in order


def test_batches_are_shifted_windows_in_a_resumable_order(files):
    first, again = _open(files, seed=5), _open(files, seed=5)
    batches = [first.train.next_batch() for _ in range(6)]
    for batch in batches:
        torch.testing.assert_close(again.train.next_batch(), batch, rtol=0, atol=0)
    inputs, targets = batches[0]
    assert inputs.shape == targets.shape == (BATCH, SEQ_LEN) and inputs.dtype == torch.int64
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1], rtol=0, atol=0)
    resumed = _open(files, seed=5)
    resumed.train.position = 4  # what Learner._restore sets from a checkpoint
    torch.testing.assert_close(resumed.train.next_batch(), batches[4], rtol=0, atol=0)
    other = _open(files, seed=6).train.next_batch()
    assert not torch.equal(other[0], batches[0][0])
    assert first.vocab_size == 256 and int(inputs.max()) < 256


def test_each_chunk_is_read_once_per_pass_in_a_new_order(files):
    shard = _open(files).train
    count = shard.count
    first_pass = [shard.chunk_index(read) for read in range(count)]
    second_pass = [shard.chunk_index(read) for read in range(count, 2 * count)]
    assert sorted(first_pass) == sorted(second_pass) == list(range(count))
    assert first_pass != second_pass


def test_a_tokenizer_gives_ids_below_its_vocabulary(files):
    dataset = _open(files, tokenizer=str(files.tokenizer))
    tokenizer = load_tokenizer(str(files.tokenizer))
    assert dataset.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True) > 256
    inputs, _ = dataset.train.next_batch()
    assert int(inputs.max()) < dataset.vocab_size
    assert re.search(r"doc\d{4}", tokenizer.decode(_all_chunks(dataset)[0].tolist()))
    # fewer tokens per document than bytes: the same documents make fewer chunks
    assert dataset.train.count < _open(files).train.count


def test_text_jsonl_and_parquet_in_a_folder_with_a_text_field(files, tmp_path):
    folder = tmp_path / "mixed"
    (folder / "deeper").mkdir(parents=True)
    texts = documents(60, seed=1)
    (folder / "a.txt").write_text("\n".join(texts[:20]) + "\n")
    (folder / "deeper" / "b.jsonl").write_text("".join(json.dumps({"body": t, "n": 1}) + "\n" for t in texts[20:40]))
    write_parquet(folder / "c.parquet", texts[40:], field="body")
    (folder / "notes.csv").write_text("ignored,file\n")
    dataset = _open(files, dataset=(str(folder),), text_field="body")
    assert dataset.documents == 60
    assert _doc_numbers(_all_chunks(dataset)) | _doc_numbers(dataset.eval_chunks) == set(range(60))


def test_chunks_are_cached_and_reused_by_a_restart(files):
    _open(files, num_shards=2, shard_index=1)
    arrow_files = sorted(str(p) for p in (files.root / "cache").rglob("*.arrow"))
    _open(files, num_shards=2, shard_index=1)
    assert sorted(str(p) for p in (files.root / "cache").rglob("*.arrow")) == arrow_files


def _fifo(path):
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda f, d: dict(dataset=(str(d / "missing.parquet"),)), "does not exist"),
        (lambda f, d: dict(dataset=(str(_write(d / "a.csv", "x")),)), "is not one of"),
        (lambda f, d: dict(dataset=(str(d),)), "holds no"),
        (lambda f, d: dict(dataset=(str(_fifo(d / "pipe.jsonl")),)), "not a regular file"),
        (lambda f, d: dict(text_field="body"), "have no column 'body' (columns: text, length): pass --text-field"),
        (lambda f, d: dict(text_field="length"), "holds int64, not text"),
        (lambda f, d: dict(dataset=(str(_write(d / "bad.jsonl", "{not json\n")),)), "cannot read the json files"),
        (lambda f, d: dict(num_shards=DOCS), "too few for"),
        (lambda f, d: dict(tokenizer=str(_write(d / "tok.json", "{}"))), "cannot be read as a tokenizers file"),
    ],
)
def test_unusable_input_is_one_line_naming_the_problem(files, tmp_path, make, message):
    with pytest.raises(ValueError) as error:
        _open(files, **make(files, tmp_path))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def _write(path, text):
    path.write_text(text)
    return path
