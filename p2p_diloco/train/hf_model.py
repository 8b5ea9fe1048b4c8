"""Hugging Face ``transformers`` causal LMs as p2p-diloco models.

A model comes from a local ``config.json`` (trained from scratch: a seeded init drawn by portable.portable_init, so
every peer of a run starts from the same bytes on any hardware) or from a local folder written by
``save_pretrained`` (config and weights; a weight the folder lacks takes torch's seeded init, which is not portable
across CPU kernels). ``CausalLM`` wraps it so that the learner calls it like the built-in GPT: ``model(tokens,
targets)`` returns the mean cross-entropy, ``model(tokens)`` the logits; parameters, outer steps, sha256s and
checkpoints need nothing else.

Nothing is ever downloaded: the hub is switched off before ``transformers`` is imported, files are opened with
``local_files_only`` and no code from a config runs (``trust_remote_code=False``). ``transformers`` is imported
only by the functions here, and this module only when a run names such a model, so that the built-in model's
start-up does not pay for it. It does not tokenize (``text_data.py``), shard a model or load quantized weights.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from p2p_diloco.core.config import ModelConfig
from p2p_diloco.core.portable import portable_init

_MAX_CONFIG_JSON_BYTES = 1 << 20  # a config.json is a few KB; this bounds what a wrong path (/dev/zero) reads
_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def force_offline() -> None:
    """Switch the Hugging Face libraries off the network (they read these when first imported): this machine
    may have no internet, and a peer must never fetch code or weights that its swarm did not agree on."""
    os.environ.update(_OFFLINE)


@dataclass(frozen=True)
class ModelShape:
    """What the start-up checks need to know of a transformers model, read without allocating its weights."""

    parameters: int
    vocab_size: int  # rows of the input embedding: the largest token id + 1 the model accepts
    max_positions: int | None  # longest sequence its position embeddings cover; None = not stated
    width: int
    layers: int


def one_line(error: BaseException) -> str:
    """An exception as one short line: its type and the first sentence of its message (transformers' messages
    can list every model type it knows)."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > 160:
        first = first.split(". ")[0][:157] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def config_json_path(model: ModelConfig) -> Path:
    """The config.json that describes the model: --model-config itself, or the one in the --init-from folder."""
    if model.hf_config:
        return Path(model.hf_config)
    assert model.init_from, "not a transformers model"
    folder = Path(model.init_from)
    if not folder.is_dir():
        raise ValueError(f"--init-from {folder} is not a folder (expected one written by save_pretrained)")
    return folder / "config.json"


def read_config_json(path: Path) -> dict[str, Any]:
    """The JSON object of a transformers config file; ValueError with a one-line reason if it is not one."""
    try:
        if not path.is_file():  # a named pipe would block the read, a device never end
            raise ValueError(f"model config {path} does not exist or is not a regular file")
        with path.open("rb") as handle:
            raw = handle.read(_MAX_CONFIG_JSON_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read model config {path}: {e.strerror or e}") from None
    if len(raw) > _MAX_CONFIG_JSON_BYTES:
        raise ValueError(f"model config {path} is larger than {_MAX_CONFIG_JSON_BYTES >> 20} MiB: not a config.json")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"model config {path} is not valid JSON: {one_line(e)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f'model config {path} names no "model_type" (a transformers config.json does, e.g. "llama")')
    return data


def load_config(model: ModelConfig) -> Any:
    """The ``transformers`` config of the model (a ``PretrainedConfig``); ValueError if it cannot be used."""
    path = config_json_path(model)
    values = read_config_json(path)
    force_offline()
    try:
        from transformers import AutoConfig

        values.pop("auto_map", None)  # code that a config would have us fetch and run: never
        return AutoConfig.for_model(values.pop("model_type"), **values)
    except Exception as e:  # transformers raises many kinds (unknown model_type, bad values): one line here
        raise ValueError(f"model config {path} cannot be used: {one_line(e)}") from None


def _from_config(config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)


def describe(model: ModelConfig) -> ModelShape:
    """Shape and size of the model, built on the meta device (no memory is allocated for its weights)."""
    config = load_config(model)
    try:
        with torch.device("meta"):
            lm = _from_config(config)
    except Exception as e:
        raise ValueError(f"model config {config_json_path(model)} does not describe a causal LM: {one_line(e)}") from None
    return ModelShape(
        parameters=sum(p.numel() for p in lm.parameters()),
        vocab_size=lm.get_input_embeddings().num_embeddings,
        max_positions=getattr(config, "max_position_embeddings", None),
        width=int(getattr(config, "hidden_size", 0) or 0),
        layers=int(getattr(config, "num_hidden_layers", 0) or 0),
    )


def build_transformers_model(model: ModelConfig, seed: int) -> CausalLM:
    """The causal LM of ``model.hf_config`` (seeded init) or ``model.init_from`` (its weights; any weight the
    folder lacks is initialised from the seed too), in fp32, so that every peer starts from the same bytes."""
    config = load_config(model)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # for any draw portable_init does not cover (see there)
    try:
        if model.hf_config:
            with portable_init(seed) as draws, _portable_transformers_init(draws):
                lm = _from_config(config)
        else:
            from transformers import AutoModelForCausalLM

            lm = AutoModelForCausalLM.from_pretrained(
                model.init_from, config=config, dtype=torch.float32, local_files_only=True, trust_remote_code=False
            )
    except Exception as e:
        where = model.hf_config or f"--init-from {model.init_from}"
        raise ValueError(f"cannot build the transformers model of {where}: {one_line(e)}") from None
    finally:
        torch.random.set_rng_state(generator_state)
    wrapped = CausalLM(lm)
    if any(p.dtype != torch.float32 for p in wrapped.parameters()):  # outer steps and sha256s assume fp32
        wrapped.float()
    return wrapped


@contextlib.contextmanager
def _portable_transformers_init(draws: Any) -> Iterator[None]:
    """transformers' own ``init.trunc_normal_`` calls torch's, kept from before ``portable_init`` was entered; the
    others (``normal_``, ``uniform_`` and those built on them) end in the patched tensor methods."""
    try:
        from transformers import initialization
    except ImportError:  # older transformers: its inits call torch.nn.init directly
        yield
        return
    table = getattr(initialization, "TORCH_INIT_FUNCTIONS", {})
    saved = table.get("trunc_normal_")
    if saved is not None:
        table["trunc_normal_"] = draws.trunc_normal_
    try:
        yield
    finally:
        if saved is not None:
            table["trunc_normal_"] = saved


class CausalLM(nn.Module):
    """A transformers causal LM called like the built-in GPT.

    Its ``state_dict`` holds exactly its parameters, each once, in ``parameters()`` order: an output head tied
    to the input embedding (GPT-2) is one tensor, not two, and buffers (rotary frequencies, masks) are left out.
    That is what the rest of p2p-diloco takes a model's state to be (the swarm averages parameters only, and
    a checkpoint's optimizer state is matched to the model's tensors by position); buffers are constants that
    every peer rebuilds from the config, and loading fills them, and tied names, from the model itself.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        unique = dict(self.named_parameters())
        self._param_names = list(unique)
        owner = {id(param): name for name, param in unique.items()}
        self._tied = {  # tied name -> the name the parameter is stored under
            name: owner[id(param)] for name, param in self.named_parameters(remove_duplicate=False) if name not in unique
        }
        buffers = {name for name, _ in self.named_buffers()}
        self._persistent_buffers = [name for name in ("lm." + key for key in lm.state_dict()) if name in buffers]
        self.register_state_dict_post_hook(_parameters_only)
        self.register_load_state_dict_pre_hook(_fill_tied_and_buffers)

    @property
    def vocab_size(self) -> int:
        return self.lm.get_input_embeddings().num_embeddings

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (B, T) int64. Returns logits (B, T, vocab), or the mean cross-entropy if targets are given."""
        logits = self.lm(input_ids=tokens, use_cache=False).logits
        if targets is None:
            return logits
        # the data already shifts targets by one token (data.py): no second shift, unlike transformers' labels=
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _parameters_only(module: CausalLM, state_dict: dict[str, Any], prefix: str, _metadata: Any) -> None:
    kept = {name: state_dict[prefix + name] for name in module._param_names}
    for key in [key for key in state_dict if key.startswith(prefix)]:
        del state_dict[key]
    state_dict.update((prefix + name, value) for name, value in kept.items())


def _fill_tied_and_buffers(module: CausalLM, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    for name, stored_as in module._tied.items():
        if prefix + stored_as in state_dict:
            state_dict.setdefault(prefix + name, state_dict[prefix + stored_as])
    buffers = dict(module.named_buffers())
    for name in module._persistent_buffers:  # what strict loading expects: this model's own constants
        state_dict.setdefault(prefix + name, buffers[name].detach())
