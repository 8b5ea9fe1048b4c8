"""run_averaging's reading of the group it got (round.py): a group whose members declared other global params
(bases) than ours is averaged here, by hivemind, but its result is not applied; the declared base goes out."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from p2p_diloco.swarm.round import run_averaging


class FakeAverager:
    """Answers ``step`` at once with the group data ``gathered`` (peer -> what it declared)."""

    def __init__(self, gathered: dict[str, dict]):
        self.gathered, self.buffers, self.requests = gathered, [torch.zeros(3)], []

    @contextmanager
    def get_tensors(self):
        yield self.buffers

    def set_round(self, outer_step: int, expected_group_size: int | None) -> None:
        pass

    def is_alive(self) -> bool:
        return True

    def step(self, gather: dict, **kwargs: object) -> SimpleNamespace:
        self.requests.append(gather)
        future: Future = Future()
        future.set_result(self.gathered)
        return SimpleNamespace(result=future.result, stage=None)


def test_a_group_of_one_base_is_applied_and_a_mixed_one_is_not():
    tensors = [torch.ones(3)]
    same = FakeAverager({"a": dict(outer_step=4, weight=1.0, base="aa"), "b": dict(outer_step=4, weight=2.0, base="aa")})
    outcome = run_averaging(same, tensors, 1.0, 4, timeout_s=5, base="aa")
    assert outcome.status == "ok" and outcome.weight_total == 3.0
    assert same.requests == [dict(outer_step=4, weight=1.0, base="aa")]

    mixed = FakeAverager({"a": dict(outer_step=4, weight=1.0, base="aa"), "b": dict(outer_step=4, weight=2.0, base="bb")})
    outcome = run_averaging(mixed, tensors, 1.0, 4, timeout_s=5, base="aa")
    assert outcome.averaged is None and "mixed global params" in outcome.reason

    # without a base of our own (a bare averager), bases are not compared and none is declared
    outcome = run_averaging(mixed, tensors, 1.0, 4, timeout_s=5)
    assert outcome.status == "ok" and mixed.requests[-1] == dict(outer_step=4, weight=1.0)


class DyingAverager(FakeAverager):
    """Its process ends (a Ctrl-C sent to the peer's whole process group) while a step is in flight."""

    def __init__(self):
        super().__init__({})
        self.alive = True

    def is_alive(self) -> bool:
        return self.alive

    def step(self, gather: dict, **kwargs: object) -> SimpleNamespace:
        self.requests.append(gather)
        self.alive = False
        return SimpleNamespace(result=Future().result, stage=None)  # a step nobody will ever answer


@pytest.mark.timeout(30)  # without the check, the wait for a step nobody answers never ends
def test_a_step_of_an_averager_that_died_ends_the_round_instead_of_waiting_for_it():
    averager = DyingAverager()
    outcome = run_averaging(averager, [torch.ones(3)], 1.0, 4, timeout_s=3600)
    assert outcome.status == "error" and outcome.averaged is None and outcome.reason == "the averager process is gone"
    assert len(averager.requests) == 1  # not tried again either


class CancellingAverager(FakeAverager):
    """Cancels its first step on its side (seen right after a search that was abandoned), then answers."""

    def step(self, gather: dict, **kwargs: object) -> SimpleNamespace:
        if self.requests:
            return super().step(gather, **kwargs)
        self.requests.append(gather)

        def cancelled(timeout: float | None = None) -> None:
            raise asyncio.CancelledError()  # what hivemind's MPFuture raises for a cancelled step: a BaseException

        return SimpleNamespace(result=cancelled, stage=None)


@pytest.mark.timeout(30)
def test_a_step_the_averager_cancelled_is_a_failed_attempt_not_a_dead_averaging_thread():
    """It raised out of run_averaging and ended the averaging thread; the learner then waited for that round forever."""
    averager = CancellingAverager({"a": dict(outer_step=4, weight=1.0), "b": dict(outer_step=4, weight=1.0)})
    outcome = run_averaging(averager, [torch.ones(3)], 1.0, 4, timeout_s=60)
    assert outcome.status == "ok" and len(averager.requests) == 2  # tried again within the round's time
    outcome = run_averaging(CancellingAverager({}), [torch.ones(3)], 1.0, 4, timeout_s=0.5)
    assert outcome.status == "error" and "CancelledError" in outcome.reason  # no time left: the round fails
