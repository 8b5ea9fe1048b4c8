"""TokenShard and Dataset: batches are deterministic by (seed, position), targets are shifted inputs, shards differ."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.core.config import DataConfig
from p2p_diloco.train.data import Dataset, TokenShard, load_corpus

SEQ_LEN, BATCH = 16, 4


def _shard(seed: int = 0, numel: int = 5000) -> TokenShard:
    # token value = its position, so every window can be traced back to where it came from
    return TokenShard(torch.arange(numel), SEQ_LEN, BATCH, seed=seed)


def test_batches_have_the_right_shape_and_dtype():
    inputs, targets = _shard().next_batch()
    assert inputs.shape == targets.shape == (BATCH, SEQ_LEN)
    assert inputs.dtype == targets.dtype == torch.int64


def test_targets_are_inputs_shifted_by_one_token():
    shard = _shard()
    for _ in range(5):
        inputs, targets = shard.next_batch()
        torch.testing.assert_close(targets, inputs + 1)  # the next token of the same contiguous window
        torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
        assert int(targets.max()) < 5000 and int(inputs.min()) >= 0


def test_targets_are_shifted_on_real_bytes(tiny_corpus):
    corpus = load_corpus(tiny_corpus)
    inputs, targets = TokenShard(corpus, SEQ_LEN, BATCH, seed=1).next_batch()
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.max()) < 256


def test_same_seed_same_batches_and_position_counts_batches():
    first, second = _shard(seed=3), _shard(seed=3)
    for position in range(4):
        assert first.position == position
        a, b = first.next_batch(), second.next_batch()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert first.position == 4


def test_resuming_at_a_position_gives_the_same_next_batch():
    original = _shard(seed=3)
    batches = [original.next_batch() for _ in range(6)]
    resumed = _shard(seed=3)
    resumed.position = 4  # a peer restarted from a checkpoint taken after 4 batches
    torch.testing.assert_close(resumed.next_batch(), batches[4], rtol=0, atol=0)
    torch.testing.assert_close(resumed.next_batch(), batches[5], rtol=0, atol=0)


def test_different_seeds_give_different_batches():
    a, b = _shard(seed=0).next_batch(), _shard(seed=1).next_batch()
    assert not torch.equal(a[0], b[0])


def test_consecutive_batches_differ():
    shard = _shard()
    assert not torch.equal(shard.next_batch()[0], shard.next_batch()[0])


def test_shard_shorter_than_a_sequence_is_rejected():
    with pytest.raises(ValueError, match="shorter than one sequence"):
        TokenShard(torch.arange(SEQ_LEN + 1), SEQ_LEN, BATCH, seed=0)


def test_different_shard_index_gives_different_disjoint_data(tiny_corpus):
    datasets = [
        Dataset(DataConfig(corpus_dir=tiny_corpus, num_shards=2, shard_index=i), SEQ_LEN, BATCH, 0) for i in (0, 1)
    ]
    first, second = (d.train for d in datasets)
    assert not torch.equal(first.tokens[:100], second.tokens[:100])
    # the two shards are adjacent, disjoint slices of the training bytes
    assert first.tokens.storage_offset() + first.tokens.numel() <= second.tokens.storage_offset()
    assert first.seed != second.seed
    assert not torch.equal(first.next_batch()[0], second.next_batch()[0])
    # the evaluation tail does not depend on the shard
    torch.testing.assert_close(datasets[0].eval_tokens, datasets[1].eval_tokens, rtol=0, atol=0)


def test_same_config_and_seed_give_the_same_batches(tiny_corpus):
    config = DataConfig(corpus_dir=tiny_corpus)
    a, b = Dataset(config, SEQ_LEN, BATCH, seed=5), Dataset(config, SEQ_LEN, BATCH, seed=5)
    for _ in range(3):
        torch.testing.assert_close(a.train.next_batch(), b.train.next_batch(), rtol=0, atol=0)
    torch.testing.assert_close(a.eval_batches(2), b.eval_batches(2), rtol=0, atol=0)


def test_eval_batches_are_the_same_every_call_and_leave_training_alone(tiny_corpus):
    dataset = Dataset(DataConfig(corpus_dir=tiny_corpus), SEQ_LEN, BATCH, seed=0)
    torch.testing.assert_close(dataset.eval_batches(3), dataset.eval_batches(3), rtol=0, atol=0)
    assert dataset.train.position == 0


def test_corpus_below_64_kib_is_rejected(tmp_path):
    (tmp_path / "small.txt").write_text("x" * 1000, encoding="utf-8")
    with pytest.raises(ValueError, match="need at least 64 KiB"):
        load_corpus(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(str(tmp_path / "nowhere"))
