"""Optional dependencies, installed as extras (pyproject.toml): a run that needs a missing one is told, in one line,
which extra to install, before anything starts."""

from __future__ import annotations

import importlib.util

EXTRAS = {  # extra -> the modules it brings
    "hf": ("transformers", "datasets", "tokenizers"),  # --model-config, --init-from, --dataset, --tokenizer
    "tensorboard": ("tensorboard",),  # --tensorboard
    "plot": ("matplotlib",),  # report.png of a local swarm, the benchmarks' figures
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that this Python cannot import."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, purpose: str) -> None:
    """ValueError naming the extra to install if any module of ``extra`` is missing."""
    absent = missing(extra)
    if absent:
        raise ValueError(f"{purpose} needs {', '.join(absent)}: pip install 'p2p-diloco[{extra}]'")
