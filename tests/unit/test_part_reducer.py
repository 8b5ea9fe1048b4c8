"""A sender that gives up while it waits for a part must not wedge the reducer for the others (docs/design.md §6)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.partition import AllreduceException, TensorPartReducer

from p2p_diloco.core.robust import RobustPolicy
from p2p_diloco.swarm.guarded import RobustPartReducer
from p2p_diloco.swarm.reducer import PartReducer

SHAPE = torch.Size([64])


def _reducer(kind: str, senders: int) -> TensorPartReducer:
    if kind == "plain":
        return PartReducer([SHAPE, SHAPE], senders)
    if kind == "robust":
        return RobustPartReducer([SHAPE, SHAPE], senders, RobustPolicy(), [None] * senders, lambda *_: None)
    return TensorPartReducer([SHAPE, SHAPE], senders)


async def _one_sender_gives_up(kind: str) -> tuple[list, TensorPartReducer]:
    """Three senders, two parts; sender 0 sends part 0 and its RPC is cancelled while it waits for the average
    (its peer left the round), then it is dropped as ``_ban_sender`` drops it. Returns what senders 1 and 2 got."""
    reducer = _reducer(kind, 3)
    values = {s: [torch.full(SHAPE, float(s + 1) * (k + 1)) for k in range(2)] for s in range(3)}

    async def send(sender: int, parts: int) -> list[torch.Tensor]:
        return [await reducer.accumulate_part(sender, k, values[sender][k]) for k in range(parts)]

    leaver = asyncio.create_task(send(0, 1))
    stayer = asyncio.create_task(send(1, 2))
    await asyncio.sleep(0.01)
    leaver.cancel()
    await asyncio.sleep(0.01)
    reducer.on_sender_failed(0)
    late = asyncio.create_task(send(2, 2))
    results = await asyncio.wait_for(asyncio.gather(stayer, late, return_exceptions=True), 5)
    return results, reducer


@pytest.mark.parametrize("kind", ["plain", "robust"])
def test_a_sender_cancelled_mid_part_leaves_the_part_to_the_others(kind):
    (stayer, late), reducer = asyncio.run(_one_sender_gives_up(kind))
    assert isinstance(stayer, list) and isinstance(late, list), (stayer, late)
    for k in range(2):
        assert torch.equal(stayer[k], late[k])  # one average per part, the same for every sender
    # part 0 had all three (the leaver's part arrived before it left); part 1 the two that stayed
    if kind == "plain":
        torch.testing.assert_close(stayer[0], torch.full(SHAPE, 2.0))
        torch.testing.assert_close(stayer[1], torch.full(SHAPE, 5.0))
    else:  # the robust average (clipped, norm-limited) of constant parts lies within the senders' values
        assert 1.0 <= float(stayer[0][0]) <= 3.0 and 4.0 <= float(stayer[1][0]) <= 6.0
    assert reducer.finished.is_set() and reducer.num_parts_received == [1, 2, 2]


def test_hivemind_own_reducer_is_wedged_by_the_same_sender():
    # what PartReducer changes: with hivemind's, the stayer's wait is cancelled with the leaver's, and the late
    # sender's part can no longer be accumulated: the round would hang until its timeout
    (stayer, late), reducer = asyncio.run(_one_sender_gives_up("hivemind"))
    assert isinstance(stayer, asyncio.CancelledError)
    assert isinstance(late, asyncio.InvalidStateError)
    reducer.finalize()


@pytest.mark.parametrize("own", [0, 1])
def test_a_group_of_two_whose_other_member_never_sends_averages_our_parts_alone(own):
    # the CI failure after the fix above: the other member was dropped before its first part, the robust reducer's
    # average of our part alone raised, and our own part waited for the round's timeout (30 s)
    ours = [torch.randn(SHAPE) for _ in range(2)]

    async def run() -> tuple[list[torch.Tensor], TensorPartReducer]:
        reducer = RobustPartReducer([SHAPE, SHAPE], 2, RobustPolicy(), [None, None], lambda *_: None, own=own)
        task = asyncio.create_task(_send_all(reducer, own, ours))
        await asyncio.sleep(0.01)
        reducer.on_sender_failed(1 - own)  # what _ban_sender does when a sender never started
        return await asyncio.wait_for(task, 5), reducer

    results, reducer = asyncio.run(run())
    assert all(torch.equal(result, part) for result, part in zip(results, ours, strict=True))
    assert reducer.finished.is_set()


async def _send_all(reducer: TensorPartReducer, sender: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [await reducer.accumulate_part(sender, k, part) for k, part in enumerate(parts)]


class _FailingReducer(PartReducer):
    """A reducer whose average of part 0 raises (anything: a bug, memory, a torch error)."""

    def _average_current_part(self) -> torch.Tensor:
        if self.current_part_index == 0:
            raise RuntimeError("no average today")
        return super()._average_current_part()


@pytest.mark.parametrize("completed_by", ["the last sender", "a dropped sender"])
def test_a_part_whose_average_raises_fails_every_sender_at_once(completed_by):
    parts = [torch.ones(SHAPE), torch.ones(SHAPE)]

    async def run() -> tuple[list, TensorPartReducer]:
        reducer = _FailingReducer([SHAPE, SHAPE], 3)
        senders = [asyncio.create_task(_send_all(reducer, s, parts)) for s in range(2)]
        await asyncio.sleep(0.01)
        if completed_by == "the last sender":
            senders.append(asyncio.create_task(_send_all(reducer, 2, parts)))
        else:
            reducer.on_sender_failed(2)  # must not raise into whoever dropped the sender
        return await asyncio.wait_for(asyncio.gather(*senders, return_exceptions=True), 5), reducer

    results, reducer = asyncio.run(run())
    assert results and all(isinstance(r, AllreduceException) and "no average today" in str(r) for r in results), results
    assert reducer.finished.is_set()  # no later part waits either
