"""One averaging round from the learner's side: hand the averager our outer gradient, find a group at our outer step
(retried within the round's time), read what the group declared, and take back the average or a reason.

The averager itself (the exact, compressed all-reduce) lives in ``swarm/averaging.py``; this module decides nothing
about *when* to average or what to do with the outcome: that is the learner's job (``swarm_link.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from p2p_diloco.core.link import AveragingOutcome
from p2p_diloco.swarm.averaging import DilocoAverager
from p2p_diloco.swarm.hivemind_api import CALL_FAILED
from p2p_diloco.swarm.search import Abandoned, AveragerGone, wait_for_step

logger = logging.getLogger(__name__)


def run_averaging(
    averager: DilocoAverager,
    tensors: Sequence[torch.Tensor],
    weight: float,
    outer_step: int,
    timeout_s: float,
    expected_group_size: int | None = None,
    should_abort: Callable[[], bool] | None = None,
    base: str | None = None,
    part_norms: Sequence[float] | None = None,
) -> AveragingOutcome:
    """Average ``tensors`` with the peers of ``outer_step``; never raises for network failures.

    ``base``: the sha256 of the global params the outer gradient was measured from, declared in the group
    request: a group whose members declare different bases (one of them on a fork) averages nothing here.
    ``part_norms``: the norm of each norm block of ``tensors`` (``part_norms_of``), declared in the group request:
    every member checks the results it gets back against the group's declared norms (robust.result_problem).

    ``expected_group_size``: the peers this one expects (itself included); the group starts averaging as soon
    as that many joined, and otherwise after the matchmaking time with whoever came. ``should_abort``, polled
    while no group is found yet, ends a search that cannot succeed any more (the swarm moved past this step).

    A failure before any result arrived (no group yet, a groupmate gone during matchmaking) is retried
    until ``timeout_s``. A *partial* all-reduce is not retried: some groupmates may already hold the
    complete result, and a second group at the same outer step would give different bytes (a fork).
    """
    with averager.get_tensors() as buffers:
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)
    try:
        averager.set_round(outer_step, expected_group_size)
    except Exception as e:  # the averager process is gone or stuck: no round this time
        return AveragingOutcome(None, (), 0.0, "error", f"averager did not answer: {type(e).__name__}: {e}"[:300])
    deadline = time.monotonic() + timeout_s
    while True:
        control = averager.step(
            gather=dict(outer_step=outer_step, weight=weight, **({"base": base} if base else {}),
                        **({"part_norms": list(part_norms)} if part_norms is not None else {})),
            weight=weight,
            timeout=max(1.0, deadline - time.monotonic()),
            allow_retries=False,
            wait=False,
        )
        try:
            gathered = wait_for_step(control, should_abort, alive=averager.is_alive)
        except Abandoned:
            return AveragingOutcome(None, (), 0.0, "stale", "the swarm moved past this outer step while we looked for a group")
        except AveragerGone:
            return AveragingOutcome(None, (), 0.0, "error", "the averager process is gone")
        # hivemind raises a zoo of types for a failed round, a step it cancelled on its side among them (seen right
        # after a search we abandoned): all mean "no average" (hivemind_api.CALL_FAILED)
        except CALL_FAILED as e:
            text = f"{type(e).__name__}: {e}"
            status = "partial" if "partial all-reduce" in text else "no_group" if "group" in text else "error"
            if status == "partial" or deadline - time.monotonic() < 1.0:
                return AveragingOutcome(None, (), 0.0, status, text[:300])
            if not averager.is_alive():
                return AveragingOutcome(None, (), 0.0, "error", "the averager process is gone")
            if should_abort is not None and should_abort():
                return AveragingOutcome(None, (), 0.0, "stale", "the swarm moved past this outer step")
            logger.debug("averaging attempt failed (%s); retrying", text)
            continue
        break
    if not gathered:
        return AveragingOutcome(None, (), 0.0, "no_group", "averager returned no group")
    steps = {info.get("outer_step") for info in gathered.values() if isinstance(info, dict)}
    if steps != {outer_step}:
        return AveragingOutcome(None, (), 0.0, "error", f"group mixed outer steps {sorted(map(str, steps))}")
    bases = {info.get("base") for info in gathered.values() if isinstance(info, dict)}
    if base and bases != {base}:  # outer gradients measured from other params: their mean is no outer step of ours
        return AveragingOutcome(None, (), 0.0, "error", f"group mixed global params ({len(bases)} bases)")
    with averager.get_tensors() as buffers:
        averaged = [buffer.clone() for buffer in buffers]
    weight_total = float(sum(info.get("weight", 0.0) for info in gathered.values()))
    return AveragingOutcome(averaged, tuple(str(p) for p in gathered), weight_total, "ok")
