"""hivemind averaging made exact: identical bytes on every peer, token weights honoured, partial rounds refused."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest
import torch
from hivemind import DHT
from hivemind.utils.mpfuture import MPFuture

from p2p_diloco.core.compression import make_codec
from p2p_diloco.core.feedback import ReducerFeedback
from p2p_diloco.core.link import codec_round_trip
from p2p_diloco.swarm.averaging import DilocoAverager, ExactAllReduceRunner
from p2p_diloco.swarm.reducer import PartReducer
from p2p_diloco.swarm.round import run_averaging
from p2p_diloco.swarm.wire import WireCodec

pytestmark = pytest.mark.integration

SHAPES = [(320, 320), (100_000,), (400, 250)]  # three parts of ~100k values: one per reducer


def _state() -> tuple[dict, list[torch.Tensor]]:
    return {}, []


class CrashingReducerRunner(ExactAllReduceRunner):
    """A reducer that accumulates its part but breaks off before sending any result, as a peer dying mid-round."""

    async def _accumulate_parts_streaming(self, stream, sender_index):
        async for _message in super()._accumulate_parts_streaming(stream, sender_index):
            raise RuntimeError("reducer crashed")
        yield  # unreachable: makes this an async generator like the method it overrides


class _UnaverageablePartReducer(PartReducer):
    def _average_current_part(self) -> torch.Tensor:
        raise RuntimeError("no average today")


class UnaverageableRunner(ExactAllReduceRunner):
    """A reducer whose average of its first part raises, as a bug or a torch error in the reducer would."""

    def _make_reducer(self) -> PartReducer:
        return _UnaverageablePartReducer(tuple(part.shape for part in self.parts_for_local_averaging),
                                         len(self.sender_peer_ids))


def _swarm(count: int, compression: str, runners: list[type] | None = None, reducer_feedback: bool = False,
           averager_class: type[DilocoAverager] = DilocoAverager):
    dhts = [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    address = [str(a) for a in dhts[0].get_visible_maddrs()]
    dhts += [DHT(start=True, initial_peers=address, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(count - 1)]
    runners = runners or [ExactAllReduceRunner] * count
    averagers = [
        averager_class(
            [torch.zeros(shape) for shape in SHAPES],
            dht,
            wire_codec=WireCodec(make_codec(compression)),
            state_provider=_state,
            prefix="exact_test",
            start=True,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            next_chunk_timeout=3.0,
            allreduce_timeout=20.0,
            target_group_size=count,
            min_group_size=count,  # all of them or nobody: the faulty peer cannot be left out by timing
            runner_class=runner,
            reducer_feedback=ReducerFeedback(make_codec(compression)) if reducer_feedback else None,
        )
        for runner, dht in zip(runners, dhts)
    ]
    return dhts, averagers


def _average_concurrently(averagers, inputs, weights, timeout_s, outer_step=5, expected_group_size=None):
    outcomes = [None] * len(averagers)

    def work(index):
        outcomes[index] = run_averaging(averagers[index], inputs[index], weights[index], outer_step=outer_step,
                                        timeout_s=timeout_s, expected_group_size=expected_group_size)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(averagers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s + 30)
    return outcomes


def _shutdown(dhts, averagers):
    for averager in averagers:
        averager.shutdown()
    for dht in dhts:
        dht.shutdown()


@pytest.mark.parametrize("compression", ["int8", "none", "int2", "topk"])
def test_every_peer_gets_the_same_bytes_and_the_weighted_average(compression):
    torch.manual_seed(0)
    inputs = [[torch.randn(shape) * (i + 1) for shape in SHAPES] for i in range(3)]
    weights = [1000.0, 2000.0, 3000.0]  # tokens
    dhts, averagers = _swarm(3, compression)
    try:
        outcomes = _average_concurrently(averagers, inputs, weights, timeout_s=40)
    finally:
        _shutdown(dhts, averagers)
    assert all(o is not None and o.status == "ok" for o in outcomes), outcomes
    assert all(len(o.peers) == 3 and o.weight_total == sum(weights) for o in outcomes)
    reference = outcomes[0].averaged
    for outcome in outcomes[1:]:
        for mine, theirs in zip(outcome.averaged, reference):
            assert torch.equal(mine, theirs)  # bit-identical, not merely close
    expected = [sum(w * x[k] for w, x in zip(weights, inputs)) / sum(weights) for k in range(len(SHAPES))]
    if compression == "none":
        for got, want in zip(reference, expected):
            torch.testing.assert_close(got, want)
    elif compression == "topk":  # two sparse hops: the reducer keeps the top 2 of 64 of the mean of what it received
        # (a peer's own share of the part it reduces never crosses the wire, so the first hop is not the same for
        # all three: what is checked is the sparsity, and that the values kept are large ones of the right sign)
        for got, want in zip(reference, expected):
            kept = got != 0
            assert 0 < int(kept.sum()) <= 2 * -(-got.numel() // 64)
            assert float((torch.sign(got[kept]) == torch.sign(want[kept])).float().mean()) > 0.99
            assert float(got[kept].abs().mean()) > 2 * float(want.abs().mean())
    elif compression == "int2":  # two 2-bit hops, each leaving about a third of the norm (error feedback is off here)
        for got, want in zip(reference, expected):
            assert (got - want).norm() / want.norm() < 0.6
            # what came back is the reducer's 2-bit encode: two magnitudes per block of 64 (a part's blocks may
            # straddle two tensors, so one more block per tensor)
            assert got.abs().unique().numel() <= 2 * (-(-got.numel() // 64) + 1)
    else:  # two int8 hops (sender part, then the reducer's result): within ~3% relative L2
        for got, want in zip(reference, expected):
            assert (got - want).norm() / want.norm() < 0.03
        assert codec_round_trip(make_codec("int8"), [expected[0]])[0].shape == expected[0].shape


def _sparse_input(seed: int) -> list[torch.Tensor]:
    """Values topk sends exactly (per block of 64: its absmax and half of it, at random places), so that only the
    reducer's re-encode of the mean (up to 6 values per block from 3 senders) drops anything."""
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for shape in SHAPES:
        blocks = -(-torch.Size(shape).numel() // 64)
        values = torch.zeros(blocks, 64)
        places = torch.rand(blocks, 64, generator=generator).argsort(dim=1)[:, :2]
        absmax = torch.rand(blocks, generator=generator) + 0.5
        signs = torch.randint(0, 2, (blocks, 2), generator=generator) * 2 - 1
        values.scatter_(1, places, torch.stack([absmax, absmax / 2], dim=1) * signs)
        tensors.append(values.view(-1)[: torch.Size(shape).numel()].reshape(shape))
    return tensors


def test_the_reducers_error_feedback_sends_what_the_last_re_encode_dropped():
    """Two rounds of the same three sparse inputs with topk: the first gives the re-encoded mean; in the second,
    each reducer adds what its first encode dropped (so every part kept its reducer: the canonical group order),
    and all peers still get the same bytes."""
    inputs = [_sparse_input(seed) for seed in range(3)]
    weights = [1000.0, 2000.0, 3000.0]
    codec = make_codec("topk")
    mean = [sum(w * x[k] for w, x in zip(weights, inputs)) / sum(weights) for k in range(len(SHAPES))]
    first = codec_round_trip(codec, mean)
    second = codec_round_trip(codec, [2 * m - f for m, f in zip(mean, first)])  # mean + (mean - first)
    dhts, averagers = _swarm(3, "topk", reducer_feedback=True)
    try:
        rounds = [_average_concurrently(averagers, [[t.clone() for t in x] for x in inputs], weights, timeout_s=40,
                                        outer_step=step) for step in (5, 6)]
    finally:
        _shutdown(dhts, averagers)
    for outcomes, want in zip(rounds, (first, second)):
        assert all(o is not None and o.status == "ok" for o in outcomes), outcomes
        for outcome in outcomes:
            for got, expected, reference in zip(outcome.averaged, want, outcomes[0].averaged):
                assert torch.equal(got, reference)
                # the reducer sums in its own order: a near-tie in a block may keep the other value, rarely
                differs = ((got - expected).abs() > 1e-5 * expected.abs() + 1e-6).float().mean()
                assert float(differs) < 1e-3, float(differs)
    # what the two rounds sent, together, is nearer to twice the mean than two plain re-encodes would be
    plain = sum(float((2 * m - 2 * f).norm()) for m, f in zip(mean, first))
    both = sum(float((2 * m - a - b).norm()) for m, a, b in zip(mean, rounds[0][0].averaged, rounds[1][0].averaged))
    assert both < 0.9 * plain, (both, plain)  # 0.85 here: top-k drops most of a mean, feedback sends it over rounds


def test_a_reducer_that_breaks_off_makes_the_round_fail_not_half_averaged():
    torch.manual_seed(1)
    inputs = [[torch.randn(shape) for shape in SHAPES] for _ in range(3)]
    runners = [ExactAllReduceRunner, ExactAllReduceRunner, CrashingReducerRunner]
    dhts, averagers = _swarm(3, "none", runners)
    try:
        outcomes = _average_concurrently(averagers, inputs, [1.0, 1.0, 1.0], timeout_s=15)
    finally:
        _shutdown(dhts, averagers)
    honest = outcomes[:2]
    assert all(o is not None for o in honest)
    # hivemind alone would report success with the crashed part left at each peer's own value
    assert all(o.status != "ok" and o.averaged is None for o in honest), [(o.status, o.reason, o.peers) for o in outcomes]
    assert any("partial" in o.reason for o in honest), [o.reason for o in honest]


def test_a_reducer_whose_average_raises_fails_the_round_at_once_not_at_its_timeout():
    # the error used to reach only the sender that completed the part: every other sender, the reducer's own part
    # included, waited for the round's timeout (docs/design.md §6)
    torch.manual_seed(2)
    inputs = [[torch.randn(shape) for shape in SHAPES] for _ in range(2)]
    dhts, averagers = _swarm(2, "none", [ExactAllReduceRunner, UnaverageableRunner])
    started = time.monotonic()
    ended: list = [None, None]  # per peer: (outcome, seconds from the start)

    def work(index):
        outcome = run_averaging(averagers[index], inputs[index], 1.0, outer_step=5, timeout_s=20)
        ended[index] = (outcome, time.monotonic() - started)

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        _shutdown(dhts, averagers)
    outcomes = [entry[0] for entry in ended]
    assert all(o.status == "partial" and o.averaged is None for o in outcomes), [(o.status, o.reason) for o in outcomes]
    # the all-reduce's timeout is 20 s (_swarm); matchmaking takes about 2 s of it
    assert all(entry[1] < 10 for entry in ended), ended


def test_state_download_skips_refused_donors_and_names_the_donor():
    dhts = [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    address = [str(a) for a in dhts[0].get_visible_maddrs()]
    dhts += [DHT(start=True, initial_peers=address, host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(2)]
    averagers = [
        DilocoAverager(
            [torch.zeros(4)], dht, wire_codec=WireCodec(make_codec("none")),
            state_provider=lambda i=i: ({"who": i}, [torch.full((4,), float(i))]),
            prefix="state_test", start=True, allow_state_sharing=True, declare_state_period=1.0,
        )
        for i, dht in enumerate(dhts)
    ]
    try:
        averagers[1].state_sharing_priority = 2.0  # the first choice
        averagers[2].state_sharing_priority = 1.0
        ids = [a.peer_id.to_base58() for a in averagers]
        deadline = threading.Event()
        for _ in range(30):  # the declarations reach the DHT within a couple of periods
            loaded = averagers[0].load_state_excluding(timeout=10)
            if loaded is not None and loaded[2] == ids[1]:
                break
            deadline.wait(1.0)
        metadata, tensors, donor = loaded
        assert (metadata, donor) == ({"who": 1}, ids[1]) and torch.equal(tensors[0], torch.full((4,), 1.0))
        # the caller's ranks (what the records say each holds) come before the declared priorities, and a declared
        # donor the caller did not rank comes after the ranked ones
        assert averagers[0].load_state_excluding(timeout=10, prefer={ids[2]: (1, 5), ids[1]: (0, 9)})[2] == ids[2]
        assert averagers[0].load_state_excluding(timeout=10, prefer={ids[2]: (0, 0)})[2] == ids[2]
        # the loads above served from the second donor too (the two ranked ones, and the loop's while the first's
        # declaration was on its way): count from here
        served_before, bytes_before = averagers[2].traffic.served()
        metadata, tensors, donor = averagers[0].load_state_excluding(timeout=10, exclude=[ids[1]])
        assert (metadata, donor) == ({"who": 2}, ids[2]) and torch.equal(tensors[0], torch.full((4,), 2.0))
        assert averagers[0].load_state_excluding(timeout=10, exclude=[ids[1], ids[2]]) is None
        # each donor counted what it served (what a peer's wire bytes hold besides its rounds): the second served
        # the download that excluded the first exactly once, its metadata and one tensor of 4 floats; the asker
        # served nothing
        assert averagers[0].traffic.served() == (0, 0)
        states, state_bytes = averagers[2].traffic.served()
        assert states - served_before == 1 and 16 < state_bytes - bytes_before < 1000
        assert averagers[1].traffic.served()[0] >= 1
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


class CollectingAverager(DilocoAverager):
    """An averager that runs the garbage collector in its process on request, and says how many of the search's
    tasks it found pending and how many of those the collection destroyed."""

    def collect(self) -> tuple[int, int]:
        future = MPFuture()
        self._outer_pipe.send(("_collect", [], dict(future=future)))
        return future.result(timeout=10)

    async def _collect(self, future: MPFuture) -> None:
        names = ("find_peers_or_notify_cancel", "_request_join_potential_leaders", "_declare_averager_periodically")
        pending = [weakref.ref(t) for t in asyncio.all_tasks() if not t.done() and any(n in repr(t) for n in names)]
        gc.collect()
        future.set_result((len(pending), sum(task() is None for task in pending)))


def test_a_search_abandoned_while_the_collector_runs_leaves_the_averager_working():
    """hivemind cancels an abandoned search's tasks without awaiting their clean-up, which awaits a DHT call that
    its process holds only weakly: the garbage collector, run then, destroyed the tasks half-way and the averager
    never found a group again (a late joiner in CI: stale 53 rounds in a row). A collection right after each
    abandoned search must destroy none of them, and the two averagers must still average together."""
    dhts, averagers = _swarm(2, "none", averager_class=CollectingAverager)
    try:
        seen = []
        for step in range(1, 9):  # until collections caught a clean-up in flight twice (the first one did, here)
            began = time.monotonic()
            outcome = run_averaging(averagers[0], [torch.ones(shape) for shape in SHAPES], 1.0, outer_step=step,
                                    timeout_s=10, expected_group_size=2,
                                    should_abort=lambda began=began: time.monotonic() > began + 0.7)
            assert outcome.status == "stale", outcome
            seen.append(averagers[0].collect())
            if sum(pending > 0 for pending, _ in seen) >= 2:
                break
        assert sum(pending > 0 for pending, _ in seen) >= 2, seen  # the collections ran while a clean-up was on
        assert all(destroyed == 0 for _, destroyed in seen), seen
        inputs = [[torch.full(shape, float(i)) for shape in SHAPES] for i in range(2)]
        outcomes = _average_concurrently(averagers, inputs, [1.0, 1.0], timeout_s=20, outer_step=100,
                                         expected_group_size=2)
    finally:
        _shutdown(dhts, averagers)
    assert all(o is not None and o.status == "ok" for o in outcomes), [(o.status, o.reason) for o in outcomes]
    assert all(torch.equal(o.averaged[0], torch.full(SHAPES[0], 0.5)) for o in outcomes)
