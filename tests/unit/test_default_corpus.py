"""The default corpus (the standard library's .py sources) loads, and its held-out tail overlaps no training shard."""

from __future__ import annotations

from p2p_diloco.core.config import DataConfig
from p2p_diloco.train.data import Dataset

SEQ_LEN, BATCH = 16, 4


def test_default_corpus_loads_and_eval_tail_is_disjoint_from_training_shards():
    config = DataConfig(num_shards=3, shard_index=2, eval_fraction=0.02)  # the last shard borders the tail
    dataset = Dataset(config, SEQ_LEN, BATCH, seed=0)
    total = dataset.total_bytes
    assert total > 4_000_000  # several MB of library code, not a stub
    shard, tail = dataset.train.tokens, dataset.eval_tokens

    # every slice is a view of the one corpus buffer, so storage offsets are byte positions in the corpus
    assert tail.storage_offset() + tail.numel() == total  # the tail is the end of the corpus
    assert tail.numel() == int(total * config.eval_fraction)
    assert shard.storage_offset() + shard.numel() <= tail.storage_offset()
    shard_size = (total - tail.numel()) // config.num_shards
    assert shard.numel() == shard_size and shard.storage_offset() == 2 * shard_size

    # the text is Python source, and training windows stay inside the shard
    assert b"def " in bytes(shard[:200_000].tolist())
    inputs, targets = dataset.train.next_batch()
    assert inputs.shape == (BATCH, SEQ_LEN)
    for batch_inputs, batch_targets in dataset.eval_batches(2):
        assert batch_inputs.shape == batch_targets.shape == (BATCH, SEQ_LEN)
