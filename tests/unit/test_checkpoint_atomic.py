"""Checkpoints: atomic save/load round trip, retention of the newest N, corrupt files rejected by name."""

from __future__ import annotations

import os
import re

import pytest
import torch

from p2p_diloco.core import checkpoint
from p2p_diloco.core.config import InnerConfig, RunConfig
from p2p_diloco.core.link import LocalLink
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.learner import Learner

from .helpers import assert_all_close, make_dataset


def _state(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return dict(
        outer_step=step,
        global_params=[torch.randn(3, 4, generator=generator), torch.randn(5, generator=generator)],
        global_sha256="ab" * 32,
        config={"inner": {"inner_steps": 2}, "swarm": {"initial_peers": ("a", "b")}, "data": {"corpus_dir": None}},
    )


def test_save_then_load_round_trips(tmp_path):
    state = _state(7)
    path = checkpoint.save_atomic(tmp_path, 7, state)
    assert path == tmp_path / "outer_step_00000007.pt"
    loaded = checkpoint.load(path)
    assert loaded["outer_step"] == 7 and loaded["global_sha256"] == state["global_sha256"]
    assert_all_close(loaded["global_params"], state["global_params"], rtol=0, atol=0)
    assert loaded["config"] == state["config"]


def test_save_creates_missing_folders_and_leaves_no_temp_files(tmp_path):
    directory = tmp_path / "nested" / "checkpoints"
    for step in (1, 2):
        checkpoint.save_atomic(directory, step, _state(step))
    assert sorted(p.name for p in directory.iterdir()) == ["outer_step_00000001.pt", "outer_step_00000002.pt"]


def test_failed_save_leaves_no_temp_file_and_keeps_the_previous_checkpoint(tmp_path):
    good = checkpoint.save_atomic(tmp_path, 1, _state(1))
    unpicklable = dict(outer_step=2, bad=lambda: None)
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises, the folder must stay clean
        checkpoint.save_atomic(tmp_path, 2, unpicklable)
    assert [p.name for p in tmp_path.iterdir()] == [good.name]
    assert checkpoint.load(good)["outer_step"] == 1


def test_a_killed_writers_temporary_file_goes_at_the_next_save_and_a_write_in_progress_stays(tmp_path):
    killed = tmp_path / ".tmp-killed.pt"  # a writer SIGKILLed between its first byte and its rename, before we began
    killed.write_bytes(b"PK" * 1000)
    os.utime(killed, (checkpoint._STARTED - 60, checkpoint._STARTED - 60))
    in_progress = tmp_path / ".tmp-writing.pt"  # written since this process began: perhaps ours, so kept
    in_progress.write_bytes(b"PK")
    foreign = tmp_path / "notes.tmp"  # not a temporary checkpoint
    foreign.write_text("keep")
    os.utime(foreign, (checkpoint._STARTED - 60, checkpoint._STARTED - 60))
    path = checkpoint.save_atomic(tmp_path, 3, _state(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, in_progress.name, foreign.name])
    assert checkpoint.remove_leftovers(tmp_path, before=in_progress.stat().st_mtime + 1) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, foreign.name])


def test_keep_n_deletes_the_oldest(tmp_path):
    for step in range(1, 6):
        checkpoint.save_atomic(tmp_path, step, _state(step), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outer_step_00000004.pt", "outer_step_00000005.pt"]
    assert checkpoint.newest(tmp_path) == tmp_path / "outer_step_00000005.pt"


def test_keep_orders_by_step_not_by_write_time(tmp_path):
    for step in (10, 9, 100, 2):
        checkpoint.save_atomic(tmp_path, step, _state(step), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outer_step_00000010.pt", "outer_step_00000100.pt"]


def test_newest_of_an_empty_folder_is_none(tmp_path):
    assert checkpoint.newest(tmp_path) is None


def test_truncated_checkpoint_raises_value_error_naming_the_file(tmp_path):
    path = checkpoint.save_atomic(tmp_path, 3, _state(3))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(str(path))):
        checkpoint.load(path)


def test_garbage_checkpoint_raises_value_error_naming_the_file(tmp_path):
    path = tmp_path / "outer_step_00000004.pt"
    path.write_bytes(b"\x00not a checkpoint at all" * 10)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        checkpoint.load(path)


def test_missing_checkpoint_raises_value_error_naming_the_file(tmp_path):
    path = tmp_path / "outer_step_00000009.pt"
    with pytest.raises(ValueError, match=re.escape(str(path))):
        checkpoint.load(path)


def test_a_torch_file_that_is_not_a_checkpoint_is_rejected(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not a p2p-diloco checkpoint"):
        checkpoint.load(path)


def test_learner_checkpoint_loads_and_matches_its_state(tmp_path, make_config):
    config = make_config(
        inner=InnerConfig(inner_steps=2, batch_size=2),
        run=RunConfig(max_outer_steps=2, checkpoint_dir=str(tmp_path), checkpoint_every=1, eval_batches=1),
    )
    learner = Learner(config, make_dataset(config), metrics=NullSink())
    learner.run(LocalLink("none"))
    path = checkpoint.newest(tmp_path)
    assert path is not None and path.name == "outer_step_00000002.pt"
    state = checkpoint.load(path)
    assert state["outer_step"] == 2 and state["data_position"] == 4
    assert state["global_sha256"] == learner.global_sha256
    assert_all_close(state["global_params"], learner.global_params, rtol=0, atol=0)
    assert_all_close(list(state["local_model"].values()), list(learner.model.state_dict().values()), rtol=0, atol=0)
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith("outer_step_")]
