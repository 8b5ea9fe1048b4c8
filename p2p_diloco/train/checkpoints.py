"""A learner's checkpoints: written atomically (core/checkpoint.py) every ``checkpoint_every`` outer steps, after a
download and at the end; read back at ``--resume``. ``Checkpoints`` when the run has a checkpoint folder,
``NoCheckpoints`` otherwise, chosen once when the learner is built: the loop has no ``if`` for it."""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from p2p_diloco.core import checkpoint
from p2p_diloco.core.history import CHAIN
from p2p_diloco.core.outer import state_sha256

if TYPE_CHECKING:
    from p2p_diloco.train.learner import Learner

logger = logging.getLogger(__name__)


class NoCheckpoints:
    """A run without a checkpoint folder."""

    def save(self, learner: Learner) -> None:
        pass

    def after_outer_step(self, learner: Learner) -> None:
        pass


class Checkpoints:
    """Checkpoints in ``learner.config.run.checkpoint_dir``."""

    def save(self, learner: Learner) -> None:
        save(learner)

    def after_outer_step(self, learner: Learner) -> None:
        if learner.outer_step % learner.config.run.checkpoint_every == 0:
            save(learner)


def checkpoints_for(learner_config_run: object) -> Checkpoints | NoCheckpoints:
    return Checkpoints() if getattr(learner_config_run, "checkpoint_dir", None) else NoCheckpoints()


def save(learner: Learner) -> None:
    # unsharded: gathered from the other ranks of an FSDP island, which wait at a boundary meanwhile
    local_model, inner_optimizer = learner.island.local_model_state(), learner.island.inner_state()
    with learner.state_lock:
        state = dict(
            config=learner.config.to_dict(),
            outer_step=learner.outer_step,
            outer_steps_taken=learner.outer.steps_taken,
            global_params=[t.clone() for t in learner.global_params],
            momentum=[t.clone() for t in learner.outer.state_tensors()],
            global_sha256=learner.global_sha256,
            local_model=local_model,
            inner_optimizer=inner_optimizer,
            data_position=learner.dataset.train.position,
            tokens_total=learner.tokens_total,
            unsynced_by_fragment=list(learner.fragments.unsynced),
            recent_round_tokens=[list(entry) for entry in learner.rounds.recent],
        )
    path = checkpoint.save_atomic(learner.config.run.checkpoint_dir, learner.outer_step, state)
    logger.info("checkpoint written: %s", path)


def resume(learner: Learner) -> Path | None:
    """Restore the newest readable checkpoint of ``run.checkpoint_dir``; None if there is none yet.

    A corrupt, truncated or foreign file is reported (its name and why) and the one before it is tried;
    nothing is deleted or rewritten. If files exist but none can be used, raise ValueError.
    """
    directory = learner.config.run.checkpoint_dir
    assert directory, "resume needs a checkpoint folder"
    problems = []
    for path in checkpoint.candidates(directory):
        try:
            _restore(learner, checkpoint.load(path), path)
        except ValueError as e:
            logger.error("%s; trying the checkpoint before it", e)
            problems.append(str(e))
            continue
        logger.info("resumed from %s at outer step %d (%d tokens so far)", path, learner.outer_step, learner.tokens_total)
        return path
    if problems:
        raise ValueError(f"no usable checkpoint in {directory}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return None


def _restore(learner: Learner, state: dict, path: Path) -> None:
    """Check everything first, then change state: a checkpoint that fails a check leaves the learner as it was."""
    try:
        global_params, momentum = list(state["global_params"]), list(state["momentum"])
        local_model, inner_state = state["local_model"], state["inner_optimizer"]
        outer_step, steps_taken = int(state["outer_step"]), int(state["outer_steps_taken"])
        position, tokens_total = int(state["data_position"]), int(state["tokens_total"])
        saved_sha = str(state["global_sha256"])
        unsynced = [int(t) for t in state.get("unsynced_by_fragment", [0] * len(learner.fragments))]
        recent = [[int(step), int(count)] for step, count in state.get("recent_round_tokens", [])]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"checkpoint {path} lacks a field or has a bad one ({type(e).__name__}: {e})") from None
    shapes = [tuple(p.shape) for p in learner.global_params]
    for name, tensors in (("global params", global_params), ("outer momentum", momentum)):
        if [tuple(t.shape) for t in tensors] != shapes or any(t.dtype != torch.float32 for t in tensors):
            raise ValueError(f"checkpoint {path} holds {name} of another model than this config builds")
    if state_sha256(global_params, momentum) != saved_sha:
        raise ValueError(f"checkpoint {path} is damaged: its global params and momentum do not match their sha256")
    if any(not torch.isfinite(t).all() for t in global_params + momentum):
        raise ValueError(f"checkpoint {path} holds non-finite global params or momentum")
    if len(unsynced) != len(learner.fragments):
        raise ValueError(f"checkpoint {path} was written with {len(unsynced)} fragments, this run uses {len(learner.fragments)}")
    groups = inner_state.get("param_groups") if isinstance(inner_state, dict) else None
    written = "muon" if isinstance(groups, list) and groups and all(isinstance(g, dict) and "use_muon" in g for g in groups) else "adamw"
    if written != learner.config.inner.optimizer:  # the local params are fine, but the optimizer state is another's
        raise ValueError(f"checkpoint {path} was written with --inner-optimizer {written}, this run uses "
                         f"{learner.config.inner.optimizer}")
    try:
        learner.island.load_local(local_model, inner_state)
    except ValueError as e:
        raise ValueError(f"checkpoint {path} holds a local model or optimizer that does not fit ({e})") from None
    with torch.no_grad(), learner.state_lock:
        for target, value in zip(learner.global_params, global_params):
            target.copy_(value)
        learner.outer.load_state(momentum, steps_taken)
        learner.outer_step, learner.global_sha256 = outer_step, saved_sha
        learner.chain = deque([(outer_step, saved_sha)], maxlen=CHAIN)  # fresh: the swarm's vouched state wins
    learner.dataset.train.position = position
    learner.tokens_total = tokens_total
    learner.fragments.unsynced = unsynced
    learner.rounds.recent = deque(recent, maxlen=len(learner.fragments))
    learner.resumed_from = str(path)
