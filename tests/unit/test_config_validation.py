"""Config validation: bad values, unknown keys and bad files raise ValueError naming the field or file."""

from __future__ import annotations

import re

import pytest

from p2p_diloco.core.config import (
    DataConfig,
    InnerConfig,
    ModelConfig,
    OuterConfig,
    PeerConfig,
    RunConfig,
    SwarmConfig,
)
from p2p_diloco.core.config_load import build_config, load_toml


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: InnerConfig(inner_steps=-1), "inner.inner_steps"),
        (lambda: InnerConfig(inner_steps=0), "inner.inner_steps"),
        (lambda: InnerConfig(lr=0), "inner.lr"),
        (lambda: InnerConfig(grad_clip_norm=-1.0), "inner.grad_clip_norm"),
        (lambda: OuterConfig(momentum=1.0), "outer.momentum"),
        (lambda: OuterConfig(momentum=1.5), "outer.momentum"),
        (lambda: OuterConfig(momentum=-0.1), "outer.momentum"),
        (lambda: OuterConfig(lr=0.0), "outer.lr"),
        (lambda: SwarmConfig(compression="zstd"), "swarm.compression"),
        (lambda: SwarmConfig(run_id="has space"), "swarm.run_id"),
        (lambda: SwarmConfig(round_share_cap=0.5), "swarm.round_share_cap"),  # would hold even the median peer back
        (lambda: SwarmConfig(round_share_cap=float("nan")), "swarm.round_share_cap"),
        (lambda: ModelConfig(d_model=30, n_heads=4), "model.n_heads"),
        (lambda: ModelConfig(n_layers=0), "model.n_layers"),
        (lambda: DataConfig(shard_index=2, num_shards=2), "data.shard_index"),
        (lambda: DataConfig(eval_fraction=0.0), "data.eval_fraction"),
        (lambda: RunConfig(max_outer_steps=-1), "run.max_outer_steps"),
        (lambda: ModelConfig(vocab_size=10), "model.vocab_size"),  # tokens are bytes: IndexError at the first step
        (lambda: InnerConfig(throttle=1e300), "inner.throttle"),  # time.sleep overflows
        (lambda: RunConfig(seed=2**63 - 1), "run.seed"),  # data order seeds overflow int64
        (lambda: RunConfig(seed=-1), "run.seed"),
        (lambda: RunConfig(threads=10**9), "run.threads"),  # torch aborts with a C++ stack trace
        (lambda: RunConfig(start_at_unix=1.7e12), "run.start_at_unix"),  # milliseconds: would wait 50,000 years
        (lambda: ModelConfig(hf_config="config.json", init_from="folder"), "model.init_from"),
        (lambda: ModelConfig(hf_config="config.json", n_layers=2), "model.n_layers describes the built-in model"),
        (lambda: DataConfig(dataset=("a.parquet",), corpus_dir="texts"), "data.corpus_dir"),
        (lambda: DataConfig(tokenizer="tokenizer.json"), "data.tokenizer (--tokenizer) needs data.dataset"),
        (lambda: DataConfig(dataset=("",)), "data.dataset"),
        (lambda: DataConfig(dataset=("a.jsonl",), text_field=""), "data.text_field"),
        (lambda: DataConfig(cache_dir="cache"), "data.cache_dir"),
    ],
)
def test_bad_values_raise_naming_the_field(make, field: str):
    with pytest.raises(ValueError, match=re.escape(field)):
        make()


def test_n_heads_not_dividing_d_model_names_both():
    with pytest.raises(ValueError, match=r"model\.d_model \(30\) must be divisible by model\.n_heads \(4\)"):
        ModelConfig(d_model=30, n_heads=4)


def test_unknown_compression_lists_the_choices():
    with pytest.raises(ValueError, match="none, fp16, int8"):
        SwarmConfig(compression="zstd")


def test_build_config_applies_overrides():
    config = build_config({"inner": {"inner_steps": 3}, "swarm": {"initial_peers": ["/ip4/1.2.3.4/tcp/5"]}})
    assert config.inner.inner_steps == 3
    assert config.swarm.initial_peers == ("/ip4/1.2.3.4/tcp/5",)  # TOML lists become tuples
    assert config.outer == PeerConfig().outer


def test_build_config_rejects_unknown_key_naming_it():
    with pytest.raises(ValueError, match=r"unknown key\(s\) in \[inner\]: inner_stepz"):
        build_config({"inner": {"inner_stepz": 3}})


def test_build_config_rejects_unknown_section():
    with pytest.raises(ValueError, match="unknown config section.*innr"):
        build_config({"innr": {"inner_steps": 3}})


def test_build_config_rejects_wrong_type_naming_the_field():
    with pytest.raises(ValueError, match=r"inner\.inner_steps must be of type int"):
        build_config({"inner": {"inner_steps": "3"}})


def test_build_config_validates_values():
    with pytest.raises(ValueError, match=r"inner\.inner_steps"):
        build_config({"inner": {"inner_steps": -2}})


def test_load_toml_reads_sections(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text('[inner]\ninner_steps = 7\n[swarm]\ncompression = "fp16"\n', encoding="utf-8")
    config = build_config(load_toml(path))
    assert config.inner.inner_steps == 7 and config.swarm.compression == "fp16"


def test_load_toml_rejects_invalid_toml_naming_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[inner\ninner_steps = = 7\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} is not valid TOML"):
        load_toml(path)


def test_load_toml_rejects_a_top_level_value(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text("inner_steps = 7\n", encoding="utf-8")
    with pytest.raises(ValueError, match="'inner_steps' must be a \\[table\\]"):
        load_toml(path)


def test_load_toml_rejects_non_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[run]\nmetrics_file = "caf\xe9"\n')
    with pytest.raises(ValueError, match="not UTF-8"):
        load_toml(path)


def test_load_toml_unreadable_file_raises_naming_it(tmp_path):
    missing = tmp_path / "missing.toml"
    with pytest.raises(ValueError, match=rf"cannot read config file {re.escape(str(missing))}"):
        load_toml(missing)
    with pytest.raises(ValueError, match=rf"cannot read config file {re.escape(str(tmp_path))}"):
        load_toml(tmp_path)  # a folder, not a file


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"inner": {"lr": float("inf")}}, r"inner\.lr must be a finite number"),  # inf passes "> 0", then diverges
        ({"outer": {"lr": float("nan")}}, r"outer\.lr must be a finite number"),
        ({"swarm": {"averaging_timeout_s": float("inf")}}, r"swarm\.averaging_timeout_s must be a finite number"),
        ({"swarm": {"averaging_timeout_s": 1e12}}, r"swarm\.averaging_timeout_s must be <="),  # overflows timers
        ({"model": {"n_layers": 10**30}}, r"model\.n_layers must be a finite number within \+-2\*\*53"),
        ({"data": {"corpus_dir": 5}}, r"data\.corpus_dir must be a path"),  # was a TypeError traceback
        ({"run": {"checkpoint_dir": "ckpt\x00"}}, r"run\.checkpoint_dir must be a path"),
        ({"swarm": {"initial_peers": [1, 2]}}, r"swarm\.initial_peers must be a list of strings"),
        ({"inner": 5}, r"config section \[inner\] must be a table"),
        ({"inner": {1: 2}}, r"unknown key\(s\) in \[inner\]: 1"),
        ({"swarm": {"run_id": "x" * 10_000 + "!"}}, r"swarm\.run_id .*\.\.\.$"),  # cut short: one readable line
    ],
)
def test_build_config_refuses_hostile_values_in_one_line(overrides, expected):
    with pytest.raises(ValueError, match=expected) as caught:
        build_config(overrides)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300


def test_load_toml_refuses_a_huge_file_without_reading_it_all(tmp_path):
    path = tmp_path / "huge.toml"
    path.write_bytes(b"# " + b"x" * (2 << 20))
    with pytest.raises(ValueError, match="larger than 1 MiB"):
        load_toml(path)


def test_load_toml_refuses_deep_nesting_naming_the_file(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} nests arrays or tables too deeply"):
        load_toml(path)
