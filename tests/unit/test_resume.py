"""Resume: a run stopped and resumed from its checkpoint ends bit-identical to one that never stopped;
corrupt, truncated or foreign checkpoints are named and skipped for the previous good one."""

from __future__ import annotations

import re

import pytest

from p2p_diloco.core import checkpoint
from p2p_diloco.core.config import InnerConfig, ModelConfig, OuterConfig, RunConfig
from p2p_diloco.core.link import LocalLink
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.learner import Learner

from .helpers import assert_all_close, make_dataset, run_learner, snapshot


def _config(make_config, directory, max_outer_steps, resume=False, **model):
    return make_config(
        inner=InnerConfig(inner_steps=3, batch_size=2, fragments=2),
        outer=OuterConfig(lr=0.7, momentum=0.9),
        run=RunConfig(
            max_outer_steps=max_outer_steps, checkpoint_dir=str(directory), checkpoint_every=1,
            eval_batches=1, seed=5, resume=resume,
        ),
        **({"model": ModelConfig(**model)} if model else {}),
    )


def test_stop_and_resume_equals_an_uninterruptedrun_learner(tmp_path, make_config):
    straight = run_learner(_config(make_config, tmp_path / "straight", 4))

    first = run_learner(_config(make_config, tmp_path / "split", 2))
    assert first.outer_step == 2
    resumed = Learner(_config(make_config, tmp_path / "split", 4, resume=True), make_dataset(first.config), NullSink())
    used = resumed.resume()
    assert used == tmp_path / "split" / "outer_step_00000002.pt"
    assert resumed.outer_step == 2 and resumed.dataset.train.position == first.dataset.train.position
    assert resumed.global_sha256 == first.global_sha256 and resumed.tokens_total == first.tokens_total
    # the rounds each fragment's next weight counts (2 fragments: the last 2 outer steps' tokens)
    assert list(resumed.rounds.recent) == list(first.rounds.recent) and len(first.rounds.recent) == 2
    resumed.run(LocalLink("int8"))

    assert resumed.outer_step == straight.outer_step == 4
    assert resumed.global_sha256 == straight.global_sha256
    assert_all_close(resumed.params, straight.params, rtol=0, atol=0)
    assert_all_close(resumed.outer.state_tensors(), straight.outer.state_tensors(), rtol=0, atol=0)
    assert resumed.tokens_total == straight.tokens_total


def test_a_fresh_folder_resumes_nothing(tmp_path, make_config):
    learner = Learner(_config(make_config, tmp_path, 1, resume=True), make_dataset(_config(make_config, tmp_path, 1)), NullSink())
    before = snapshot(learner.params)
    assert learner.resume() is None
    assert learner.outer_step == 0
    assert_all_close(learner.params, before, rtol=0, atol=0)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip_a_param"])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path, make_config, caplog, damage):
    run_learner(_config(make_config, tmp_path, 3))
    newest = tmp_path / "outer_step_00000003.pt"
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        newest.write_bytes(b"\x00" * 1000)
    else:  # a readable file whose params no longer match the sha256 saved beside them
        state = checkpoint.load(newest)
        state["global_params"][0][0, 0] += 1.0
        checkpoint.save_atomic(tmp_path, 3, state)
    data = newest.read_bytes()
    learner = Learner(_config(make_config, tmp_path, 5, resume=True), make_dataset(_config(make_config, tmp_path, 5)), NullSink())
    assert learner.resume() == tmp_path / "outer_step_00000002.pt"
    assert learner.outer_step == 2
    assert str(newest) in caplog.text
    assert newest.read_bytes() == data  # the damaged file is reported, not deleted or rewritten


def test_no_usable_checkpoint_is_an_error_naming_the_file(tmp_path, make_config):
    run_learner(_config(make_config, tmp_path, 1))
    only = tmp_path / "outer_step_00000001.pt"
    only.write_bytes(b"truncated")
    learner = Learner(_config(make_config, tmp_path, 2, resume=True), make_dataset(_config(make_config, tmp_path, 2)), NullSink())
    with pytest.raises(ValueError, match=re.escape(str(only))):
        learner.resume()
    assert learner.outer_step == 0


def test_a_checkpoint_of_another_model_is_refused_and_leaves_the_learner_as_it_was(tmp_path, make_config):
    run_learner(_config(make_config, tmp_path, 1))
    other = _config(make_config, tmp_path, 2, resume=True, n_layers=1, d_model=16, n_heads=2, seq_len=16)
    learner = Learner(other, make_dataset(other), NullSink())
    before = snapshot(learner.params)
    with pytest.raises(ValueError, match="another model"):
        learner.resume()
    assert learner.outer_step == 0
    assert_all_close(learner.params, before, rtol=0, atol=0)
