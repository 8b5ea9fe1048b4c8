"""Hugging Face transformers models in the learner: a seeded init that is the same on every peer, the wrapper's
loss and state, loading a save_pretrained folder, a stop-and-resume run that matches an uninterrupted one (with
a parquet dataset and a BPE tokenizer), and the start-up checks of model configs against the data."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from p2p_diloco.cli.preflight import check_model_and_data
from p2p_diloco.core.config import DataConfig, InnerConfig, ModelConfig, OuterConfig, PeerConfig, RunConfig
from p2p_diloco.train.hf_model import CausalLM
from p2p_diloco.train.model import build_model
from p2p_diloco.train.text_data import load_tokenizer, vocab_size

from .helpers import (
    assert_all_close,
    documents,
    run_learner,
    train_tokenizer,
    write_model_config,
    write_parquet,
)

SEQ_LEN = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("hf_model")
    texts = documents(200)
    tokenizer = train_tokenizer(texts, root / "tokenizer.json")
    vocab = vocab_size(load_tokenizer(str(tokenizer)))
    return SimpleNamespace(
        root=root,
        parquet=write_parquet(root / "docs.parquet", texts),
        tokenizer=tokenizer,
        vocab=vocab,
        llama=write_model_config(root / "llama.json", vocab),
        gpt2=write_model_config(root / "gpt2.json", vocab, model_type="gpt2"),
    )


def _model(files: SimpleNamespace, kind: str, seed: int = 0) -> CausalLM:
    model = build_model(ModelConfig(hf_config=str(getattr(files, kind)), seq_len=SEQ_LEN), seed)
    assert isinstance(model, CausalLM)
    return model


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_same_seed_builds_the_same_fp32_weights(files, kind):
    first, again, other = _model(files, kind, 3), _model(files, kind, 3), _model(files, kind, 4)
    assert_all_close(list(first.parameters()), list(again.parameters()), rtol=0, atol=0)
    assert not torch.equal(next(first.parameters()), next(other.parameters()))
    assert all(p.dtype == torch.float32 for p in first.parameters())
    assert first.vocab_size == files.vocab


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_loss_is_cross_entropy_of_the_logits_and_global_params_evaluate_the_same(files, kind):
    model = _model(files, kind).eval()  # GPT-2's dropout off
    tokens = torch.randint(0, files.vocab, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs)
    assert logits.shape == (2, SEQ_LEN, files.vocab)
    expected = F.cross_entropy(logits.reshape(-1, files.vocab), targets.reshape(-1))
    torch.testing.assert_close(model(inputs, targets), expected)
    # what Learner.evaluate does with the global params: by name, a tied output head included (GPT-2)
    names = [name for name, _ in model.named_parameters()]
    copies = [p.detach().clone() for p in model.parameters()]
    torch.testing.assert_close(torch.func.functional_call(model, dict(zip(names, copies)), (inputs, targets)), expected)
    # other params (a moved embedding, which is also GPT-2's output head) give what a model holding them gives
    copies[0].add_(torch.randn(copies[0].shape, generator=torch.Generator().manual_seed(1)))
    holder = _model(files, kind, seed=9).eval()
    holder.load_state_dict(dict(zip(names, copies)))
    moved = torch.func.functional_call(model, dict(zip(names, copies)), (inputs, targets))
    torch.testing.assert_close(moved, holder(inputs, targets))
    assert abs(moved.item() - expected.item()) > 1e-3


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_state_dict_holds_each_parameter_once_in_order_and_loads_back(files, kind):
    model = _model(files, kind, seed=1)
    state = model.state_dict()
    named = list(model.named_parameters())
    assert list(state) == [name for name, _ in named]  # a tied head once; buffers left out
    other = _model(files, kind, seed=2)
    other.load_state_dict(state)
    assert_all_close(list(other.parameters()), list(model.parameters()), rtol=0, atol=0)


def test_init_from_a_save_pretrained_folder_loads_its_weights(files, tmp_path):
    saved = _model(files, "llama", seed=7)
    saved.lm.save_pretrained(tmp_path / "ckpt")
    loaded = build_model(ModelConfig(init_from=str(tmp_path / "ckpt"), seq_len=SEQ_LEN), seed=0)
    assert_all_close(list(loaded.parameters()), list(saved.parameters()), rtol=0, atol=0)


def _config(files: SimpleNamespace, directory, max_outer_steps: int, resume: bool = False) -> PeerConfig:
    return PeerConfig(
        model=ModelConfig(hf_config=str(files.llama), seq_len=SEQ_LEN),
        data=DataConfig(dataset=(str(files.parquet),), tokenizer=str(files.tokenizer), cache_dir=str(files.root / "cache")),
        inner=InnerConfig(inner_steps=2, batch_size=2),
        outer=OuterConfig(lr=0.7, momentum=0.9),
        run=RunConfig(max_outer_steps=max_outer_steps, checkpoint_dir=str(directory), checkpoint_every=1,
                      eval_batches=1, seed=5, resume=resume),
    )


def test_a_transformers_model_on_files_stops_and_resumes_like_an_uninterruptedrun_learner(files, tmp_path):
    straight = run_learner(_config(files, tmp_path / "straight", 4))
    run_learner(_config(files, tmp_path / "stopped", 2))
    resumed = run_learner(_config(files, tmp_path / "stopped", 4, resume=True))
    assert resumed.outer_step == straight.outer_step == 4
    assert resumed.dataset.train.position == straight.dataset.train.position == 8
    assert resumed.global_sha256 == straight.global_sha256
    assert_all_close(resumed.global_params, straight.global_params, rtol=0, atol=0)
    assert_all_close(list(resumed.model.parameters()), list(straight.model.parameters()), rtol=0, atol=0)
    assert straight.evaluate() < run_learner(_config(files, tmp_path / "short", 1)).evaluate()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda f, d: dict(model=ModelConfig(hf_config=str(d / "missing.json"))), "does not exist"),
        (lambda f, d: dict(model=ModelConfig(hf_config=str(_write(d / "c.json", "{nope")))), "is not valid JSON"),
        (lambda f, d: dict(model=ModelConfig(hf_config=str(_write(d / "c.json", '{"vocab_size": 9}')))), 'names no "model_type"'),
        (lambda f, d: dict(model=ModelConfig(hf_config=str(_write(d / "c.json", '{"model_type": "nosuch"}')))), "cannot be used: ValueError"),
        (lambda f, d: dict(model=ModelConfig(init_from=str(d / "nowhere"))), "is not a folder"),
        (lambda f, d: dict(model=ModelConfig(hf_config=str(f.llama), seq_len=65)), "covers 64 positions"),
        (lambda f, d: dict(model=ModelConfig(hf_config=str(write_model_config(d / "small.json", 256)), seq_len=SEQ_LEN),
                           data=_tokenized(f)),
         "the model's vocabulary (256 tokens) does not cover the"),
        (lambda f, d: dict(data=_tokenized(f)), "pass --vocab-size"),  # the built-in model, at its 256 bytes
    ],
)
def test_start_up_checks_refuse_unusable_models_in_one_line(files, tmp_path, make, message):
    with pytest.raises(ValueError) as error:
        check_model_and_data(PeerConfig(**make(files, tmp_path)))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_start_up_checks_accept_a_model_that_covers_the_tokenizer(files):
    check_model_and_data(PeerConfig(model=ModelConfig(hf_config=str(files.llama), seq_len=SEQ_LEN), data=_tokenized(files)))
    check_model_and_data(PeerConfig(model=ModelConfig(vocab_size=files.vocab, seq_len=SEQ_LEN), data=_tokenized(files)))


def _tokenized(files: SimpleNamespace) -> DataConfig:
    return DataConfig(dataset=(str(files.parquet),), tokenizer=str(files.tokenizer))


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_muon_takes_a_transformers_models_matrices_but_not_its_embeddings_or_output_head(files, kind):
    from p2p_diloco.train.inner_optimizer import muon_params

    model = _model(files, kind)
    muon = muon_params(model)
    names = {name for name, p in model.named_parameters() if id(p) in muon}
    assert names and all(p.ndim == 2 for p in model.parameters() if id(p) in muon)
    assert not any(("embed" in name or "wte" in name or "wpe" in name or "lm_head" in name) for name in names), names
    assert any(("proj" in name or "attn" in name) for name in names)
