"""A search for a group looks the round's declared averagers up at a bounded pace (averaging.paced_lookup).

hivemind's ``PotentialLeaders`` asks the DHT again as soon as an answer comes while its queue of leaders is empty:
a peer that waits to be joined reads the DHT once per round trip for its whole matchmaking time."""

from __future__ import annotations

import asyncio
import types

from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.p2p import PeerID

from p2p_diloco.swarm.averaging import paced_lookup


class _Keys:
    """A group key manager whose DHT holds no other averager: every lookup answers at once, empty."""

    current_key = "run_averaging.0b1"

    def __init__(self) -> None:
        self.calls = 0

    async def get_averagers(self, group_key: str, only_active: bool) -> list:
        self.calls += 1
        await asyncio.sleep(0)  # a DHT read that answers at once
        return []


def _lookups_while_waiting(wait_s: float, interval_s: float | None) -> int:
    """How many lookups a lone peer's search makes while it waits ``wait_s`` for a leader."""
    keys = _Keys()
    if interval_s is not None:
        keys.get_averagers = paced_lookup(keys.get_averagers, interval_s)

    async def search() -> None:
        leaders = PotentialLeaders(PeerID(b"\x00" * 34), min_matchmaking_time=5.0, target_group_size=None)
        step = types.SimpleNamespace(deadline=None)
        async with leaders.begin_search(step, keys, declare=False):
            try:
                await asyncio.wait_for(leaders.pop_next_leader(), wait_s)
            except TimeoutError:
                pass

    asyncio.run(search())
    return keys.calls


def test_hivemind_looks_up_again_at_once_and_the_paced_lookup_bounds_it():
    unpaced = _lookups_while_waiting(0.3, None)
    paced = _lookups_while_waiting(0.3, 0.1)
    assert unpaced > 50, unpaced  # the loop this guards against (thousands on an idle machine)
    assert 2 <= paced <= 4, paced  # at 0, 0.1, 0.2 (and perhaps 0.3) s


def test_the_first_lookup_goes_at_once_and_later_ones_keep_the_interval():
    now = [100.0]
    slept: list[float] = []
    started: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    async def lookup(key: str) -> str:
        started.append(now[0])
        return key

    paced = paced_lookup(lookup, 0.5, clock=lambda: now[0], sleep=sleep)

    async def calls() -> list[str]:
        answers = [await paced("a")]
        now[0] += 0.2  # the answer came 0.2 s later: wait the rest of the interval
        answers.append(await paced("b"))
        now[0] += 3.0  # long after: no wait
        answers.append(await paced("c"))
        return answers

    assert asyncio.run(calls()) == ["a", "b", "c"]
    assert [round(s, 9) for s in slept] == [0.3]
    assert [round(t - 100.0, 9) for t in started] == [0.0, 0.5, 3.5]
