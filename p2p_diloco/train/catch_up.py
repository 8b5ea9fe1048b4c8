"""Catching up with the swarm: take the state it vouches for (core/history.py), if it is not ours, and rebase this
peer's local progress onto it (docs/design.md §4). A part of the learner (train/learner.py), kept apart so that the
loop reads like the algorithm: the loop calls ``catch_up`` at a round's end and after a failed round.

- a state ahead of ours, or other bytes at our step (a fork), or a history most of the swarm holds, is downloaded
  verified by the link (core/verify.py ``state_problem`` and its sha256);
- a next step that no majority backs (a swarm of two) is taken only if this peer recomputes it from its own state and
  the average its donor serves, and that average passes a reducer result's checks and the reference norm (the
  swarm's, or in a run's first rounds our own scaled to a round's tokens: ``next_step_problem``);
- a fork won on a tie (the smaller sha256, which a hostile side can grind for) is taken only within one honest round
  of our state (``tie_problem``); one refused is said once and not downloaded again;
- a fork at a step this peer's own group made waits, once, for the groupmates still applying that step to report
  their bytes, so that the group's majority, not the first report read, decides which bytes go on;
- such a fork is said in one line (someone's arithmetic differs: docs/design.md §5), whether the swarm is still at
  that step or, by the downloaded state's history, has moved on; the line blames this peer's hardware only where
  more of its groupmates say they computed one other state than computed ours (a pair cannot tell whose differs);
- a failed averaging that the swarm applied after all (the donor's round history names us) is not counted twice.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

import torch

from p2p_diloco.core.history import CHAIN
from p2p_diloco.core.link import AveragingOutcome, Link, SwarmState
from p2p_diloco.core.robust import total_norm
from p2p_diloco.core.verify import next_step_problem, tie_problem

if TYPE_CHECKING:
    from p2p_diloco.train.learner import Learner, PendingAveraging

logger = logging.getLogger(__name__)


def catch_up(learner: Learner, link: Link) -> bool:
    """Take the state the swarm vouches for (history.py), if it is not ours: ahead of us, other bytes at our step
    (a fork), or, for a partition's smaller side, another history; download it verified, and rebase our local
    progress onto it. A next step that no majority backs is taken only if we recompute it ourselves."""
    if learner.pending is not None:
        return False  # never while our own averaging is in flight: its result is still to be applied
    target = link.swarm_target(list(learner.chain), learner.fresh)
    if target is None:
        return False
    if target.how == "next" and (learner.unconfirmed is None or learner.unconfirmed.outer_step != learner.outer_step):
        return False  # nothing of ours to check the donor's average against: wait for a majority
    if target.how == "tie" and target.sha256 in learner.refused_ties:
        return False  # refused before (said once): not downloaded again every round
    if target.step == learner.outer_step:
        if target.how in ("fork", "tie") and _group_yet_to_report(learner, link):
            return False
        _note_arithmetic_mismatch(learner, link)
    started = time.monotonic()
    state = link.download_state([tuple(p.shape) for p in learner.global_params], target)
    learner.add_blocked(time.monotonic() - started)
    if state is None or (state.outer_step, state.global_sha256) == learner.chain[-1]:
        logger.warning("the swarm holds outer step %d (%s); no verified state could be downloaded", target.step, target.how)
        return False
    if state.how == "next":  # the target may have changed while downloading: check what was downloaded
        problem = _next_step_problem(learner, state, link) if learner.unconfirmed is not None else "nothing of ours to check it by"
        if problem is not None:
            logger.warning("refused the next step served by %s: %s", state.donor, problem)
            link.refuse_donor(state.donor, problem)
            return False
    if state.how == "tie":  # won on the smaller sha256 alone, which a hostile side can grind for
        problem = _tie_problem(learner, state, link)
        if problem is not None:
            if state.global_sha256 not in learner.refused_ties:
                logger.warning("kept our outer step %d over the fork %s at the same step, vouched for alike: %s",
                               learner.outer_step, state.global_sha256[:12], problem)
            if len(learner.refused_ties) >= 256:
                learner.refused_ties.clear()
            learner.refused_ties.add(state.global_sha256)
            return False
    before = learner.outer_step
    # other bytes at our step, a history most of the swarm holds, or (a state ahead) a donor's history that holds other
    # bytes for our step: the swarm moved on from a step we computed otherwise before we could see it at that step
    theirs_then = dict(state.chain).get(before) if state.outer_step > before else None
    forked = state.outer_step <= before or (theirs_then is not None and theirs_then != learner.global_sha256)
    if forked and theirs_then is not None:
        _note_mismatch_in_history(learner, state, link, theirs_then)
    _take_state(learner, state, link.peer_id)
    learner.catch_ups += 1
    learner.forks_healed += int(forked)
    what = ("took the history most of the swarm holds, back at" if state.outer_step < before else
            "healed a fork at" if forked else "caught up to")
    logger.info("%s outer step %d in %.2f s (%s)", what, learner.outer_step, time.monotonic() - started, target.how)
    learner.publish_step(link)
    status = "fork_healed" if forked else "caught_up"
    learner.write(link, AveragingOutcome(None, (), 0.0, status, f"downloaded from {state.donor} ({target.how})",
                                       state.refused_donors))
    learner.checkpoints.save(learner)  # a restart after this resumes here, not from before the download
    return True


def _next_step_problem(learner: Learner, state: SwarmState, link: Link) -> str | None:
    """Why we cannot take ``state`` as the step after ours: recomputed from our own state and the average its donor
    serves, it must give its bytes, and that average must pass a reducer result's checks against the outer
    gradient we sent for that step, and a group average's against the reference norm (verify.py), which the link
    takes from the swarm's published norms or, before there are any, from ours and the tokens behind it."""
    pending = learner.unconfirmed
    assert pending is not None
    sent = [segment.of(learner.global_params) - snapshot.cpu() for segment, snapshot in zip(pending.segments, pending.snapshot)]
    averaged = learner.fragments.unpack(state.last_average, pending.segments) if state.last_average is not None else None
    own_norm = total_norm(sent)
    return next_step_problem(state, learner.outer_step, learner.global_params, learner.outer.momentum_buffers,
                             learner.outer.steps_taken, learner.global_sha256, learner.config.outer, pending.segments,
                             averaged, sent, reference=link.norm_reference(learner.outer_step, own_norm, pending.weight))


def _tie_problem(learner: Learner, state: SwarmState, link: Link) -> str | None:
    """Why we must not take ``state``, a same-step fork won on a tie (verify.tie_problem): our reference is the norm of
    the average that made our head, or, without one (a state we downloaded), the swarm's reference norm."""
    if learner.last_average is not None:
        reference: float | None = total_norm(learner.last_average)
    else:
        reference = link.norm_reference(max(0, learner.outer_step - 1), 0.0)
    return tie_problem(state.global_params, state.momentum, learner.global_params, learner.outer.momentum_buffers,
                       reference, learner.config.outer)


def _take_state(learner: Learner, state: SwarmState, peer_id: str) -> None:
    """Replace our global state by a verified ``state`` and rebase our local progress onto it."""
    applied = _unconfirmed_was_applied(learner, state, peer_id)
    local = learner.island.local_params()
    with torch.no_grad(), learner.state_lock:
        if applied is not None:  # that fragment's progress up to the snapshot is in the new global already
            for segment, snapshot in zip(applied.segments, applied.snapshot):
                piece = segment.of(local)
                piece.add_((segment.of(learner.global_params) - snapshot.cpu()).to(piece.device))
            learner.fragments.synced(applied.fragment, applied.tokens_behind)
        for param, old, new in zip(local, learner.global_params, state.global_params):
            param.add_((new - old).to(param.device))  # local_params <- new_global + (local_params - old_global)
            old.copy_(new)
        learner.outer.load_state(state.momentum, state.outer_steps_taken)
        learner.outer_step, learner.global_sha256 = state.outer_step, state.global_sha256
        learner.chain = deque(state.chain or [(state.outer_step, state.global_sha256)], maxlen=CHAIN)
        learner.parent_sha256, learner.last_average = state.parent_sha256, state.last_average
        for step, peers in state.round_history.items():
            learner.round_history.setdefault(step, peers)
        learner.trim_history()
    learner.unconfirmed = None


def _group_yet_to_report(learner: Learner, link: Link) -> bool:
    """Whether to leave a fork at our step for now (True once per step): groupmates of the round that made it are
    still at the step before, applying it, so their bytes are not in the count yet. Without this, the first of a
    group of three to look saw one groupmate's other bytes against its own, a tie, and took them on the smaller
    sha256: the group's odd member's bytes went on and its two others each blamed their own hardware (a CI run).
    We look again at the next round's end (or failed round), by when they have reported; not at the planned end,
    where ``run_edges.confirm_last_step`` has already waited for them."""
    step = learner.outer_step
    if learner.fork_waited == step or learner.should_stop():
        return False
    groupmates = set(learner.round_history.get(step - 1, ())) - {link.peer_id}
    applying = groupmates & set(link.reported_sha256(step - 1))
    if not applying:
        return False
    learner.fork_waited = step
    logger.info("outer step %d: other bytes are reported for it; waiting a round for the %d groupmate(s) still "
                "applying it", step, len(applying))
    return True


def _note_arithmetic_mismatch(learner: Learner, link: Link) -> None:
    """Say so, once per outer step, when the swarm holds other bytes for a step that this peer's own group made and
    a groupmate says it computed other bytes for it (``made``: not a fork that another group made)."""
    step = learner.outer_step
    groupmates = set(learner.round_history.get(step - 1, ())) - {link.peer_id}
    if not groupmates or step in learner.arithmetic_mismatches:
        return
    made = {peer: sha for peer, sha in link.made_sha256(step).items() if peer in groupmates}
    theirs = sorted({sha for sha in made.values() if sha != learner.global_sha256})
    if theirs:
        _say_mismatch(learner, step, len(groupmates) + 1, made, ", ".join(sha[:12] for sha in theirs))


def _note_mismatch_in_history(learner: Learner, state: SwarmState, link: Link, theirs: str) -> None:
    """As ``_note_arithmetic_mismatch``, for a fork found only in a downloaded state's history: the donor's history
    holds ``theirs`` for our outer step, and says that step was made by the very group we averaged it with."""
    step = learner.outer_step
    group = set(learner.round_history.get(step - 1, ()))
    groupmates = group - {link.peer_id}
    if not groupmates or step in learner.arithmetic_mismatches or set(state.round_history.get(step - 1, ())) != group:
        return
    made = {peer: sha for peer, sha in link.made_sha256(step).items() if peer in groupmates}
    _say_mismatch(learner, step, len(group), made, f"{theirs[:12]} in {state.donor}'s history")


def _say_mismatch(learner: Learner, step: int, group: int, made: dict[str, str], theirs: str) -> None:
    """One line, and one count in ``arithmetic_mismatches``, for our ``step``, made in a ``group`` (this peer
    included) whose members declared the same state before it and got the same averaged bytes back (averaging.py),
    yet came out on other bytes: someone's hardware computes the outer step otherwise (a kernel that breaks the
    portable arithmetic, docs/design.md §5, or a machine that miscomputes). Whose, by what each groupmate says it
    computed (``made``), not by what it holds now: one whose round failed downloads either side afterwards, and a
    first look at the step's reports once blamed the two portable members of a group of three (a CI run). It is
    this peer's only if more groupmates computed one other state than computed ours, this peer included; a group
    of two, or one split evenly, cannot tell (said, and counted); if most computed ours, the odd one says it (not
    said here, not counted). The fork heals by download all the same."""
    ours = 1 + sum(sha == learner.global_sha256 for sha in made.values())
    most = max(Counter(sha for sha in made.values() if sha != learner.global_sha256).values(), default=0)
    if made and ours > most:
        return  # most of the group computed ours: the groupmate whose bytes differ says so, not this peer
    learner.arithmetic_mismatches.append(step)
    shas = f"ours {learner.global_sha256[:12]}, theirs {theirs}"
    if most > ours:
        logger.warning("this peer's hardware computed outer step %d differently from %d of %d groupmates (%s): "
                       "same inputs, other bytes; taking the swarm's state", step, len(made) + 1 - ours, len(made), shas)
    elif group == 2:
        logger.warning("outer step %d came out as other bytes on this peer than on its one groupmate (%s): same "
                       "inputs, other bytes, and a group of two cannot tell whose hardware differs; taking the "
                       "swarm's state", step, shas)
    elif not made:
        logger.warning("outer step %d came out as other bytes on this peer than in the swarm, in a group of %d (%s): "
                       "same inputs, other bytes, and no groupmate says what it computed; taking the swarm's state",
                       step, group, shas)
    else:
        logger.warning("outer step %d came out as other bytes on this peer than on %d of the %d groupmates that say "
                       "what they computed, in a group of %d (%s): same inputs, other bytes, and as many of those "
                       "that say hold ours, so nobody can tell whose hardware differs; taking the swarm's state",
                       step, len(made) + 1 - ours, len(made), group, shas)


def _unconfirmed_was_applied(learner: Learner, state: SwarmState, peer_id: str) -> PendingAveraging | None:
    """The failed averaging whose outer gradient the swarm applied after all, per the donor's history.

    Without this, a peer whose all-reduce was partial on its side only would carry its progress into the
    next round and have it counted twice. With no history for that step, the progress is carried (the
    round most likely failed for everyone).
    """
    pending = learner.unconfirmed
    if pending is None or state.outer_step <= pending.outer_step:
        return None
    if peer_id in state.round_history.get(pending.outer_step, ()):
        logger.info("outer step %d: the swarm applied our outer gradient although our side failed", pending.outer_step)
        return pending
    return None
