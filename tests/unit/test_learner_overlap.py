"""Decoupled DiLoCo: averaging runs in the background while inner steps continue.

A fake link hands the learner futures that the test completes by hand (or after a set number of inner
steps), so every interleaving of training and averaging is driven deterministically on one thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch

from p2p_diloco.core.config import InnerConfig, OuterConfig, RunConfig
from p2p_diloco.core.link import AveragingOutcome, RoundView, SwarmState
from p2p_diloco.core.outer import OuterOptimizer, state_sha256
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.learner import Learner

from .helpers import assert_all_close, flat, make_dataset, plain_adamw, snapshot

H, BATCH, SEQ = 2, 2, 16
BATCH_TOKENS = BATCH * SEQ


class FakeLink:
    """A swarm seen through the ``Link`` protocol, with no network.

    ``average_async`` records each call and returns a future: with ``complete_after=None`` the test completes
    it by hand; otherwise it is completed, as a group of one (the tensors it got), once that many inner steps
    (progress publications) have followed, 0 meaning at once. ``view`` is what ``round_view`` answers."""

    peer_id = "fake"

    def __init__(self, complete_after: int | None = None, view: RoundView | None = None):
        self.complete_after = complete_after
        self.view = view or RoundView(live_peers=0, tokens_by_others=0, peers_ahead=0)
        self.calls: list[dict] = []
        self.futures: list[Future] = []
        self.views_asked: list[int] = []
        self.behind: list[int] = []  # what peers_behind answers, one call after the other (then 0)
        self.behind_asked: list[int] = []
        self.published: list[dict] = []
        self._due: list[tuple[int, Future, AveragingOutcome]] = []  # (inner steps left, future, outcome)

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        return AveragingOutcome(snapshot(tensors), (self.peer_id,), weight, "ok")

    def average_async(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> Future:
        self.calls.append(dict(tensors=snapshot(tensors), weight=weight, outer_step=outer_step))
        future: Future = Future()
        self.futures.append(future)
        if self.complete_after == 0:
            future.set_result(self.average(tensors, weight, outer_step))
        elif self.complete_after is not None:
            self._due.append((self.complete_after, future, self.average(tensors, weight, outer_step)))
        return future

    def round_view(self, round_index: int) -> RoundView:
        self.views_asked.append(round_index)
        return self.view

    def swarm_target(self, chain, fresh):
        return None  # alone: nobody is ahead, nobody holds other bytes

    def peers_behind(self, outer_step: int) -> int:
        self.behind_asked.append(outer_step)
        return self.behind.pop(0) if self.behind else 0

    def reported_sha256(self, outer_step: int) -> dict[str, str]:
        return {}

    def made_sha256(self, outer_step: int) -> dict[str, str]:
        return {}

    def download_state(self, shapes, target) -> SwarmState | None:
        return None

    def publish(self, **fields: object) -> None:
        self.published.append(fields)
        if "round_tokens" in fields:  # one inner step done
            due = [(left - 1, future, outcome) for left, future, outcome in self._due]
            for _, future, outcome in (d for d in due if d[0] <= 0):
                future.set_result(outcome)
            self._due = [d for d in due if d[0] > 0]

    def traffic(self) -> tuple[int, int]:
        return 0, 0

    def states_served(self) -> tuple[int, int]:
        return 0, 0

    def background_cpu_s(self) -> float | None:
        return None

    def close(self) -> None:
        pass


class ListSink:
    def __init__(self):
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


def _config(
    make_config,
    inner: InnerConfig | None = None,
    outer: OuterConfig | None = None,
    max_outer_steps: int = 0,
    straggler_wait_s: float = 20.0,
):
    return make_config(
        inner=inner or InnerConfig(inner_steps=H, batch_size=BATCH, lr=1e-2, grad_clip_norm=1.0),
        outer=outer or OuterConfig(lr=0.7, momentum=0.9),
        run=RunConfig(max_outer_steps=max_outer_steps, eval_batches=1, seed=3, straggler_wait_s=straggler_wait_s),
    )


def _learner(config, metrics=None) -> Learner:
    assert config.model.seq_len == SEQ and config.inner.batch_size == BATCH
    return Learner(config, make_dataset(config), metrics=metrics or NullSink())


def _known_average(learner: Learner) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [0.01 * torch.randn(p.shape, generator=generator) for p in learner.global_params]



# (a) training continues while an averaging is in flight ------------------------------------------------------


def test_inner_steps_run_while_averaging_and_their_work_is_kept(make_config):
    config = _config(make_config)
    learner = _learner(config)
    link = FakeLink()
    for _ in range(H):
        learner.inner_step(link)
    global_before, local_at_round_end = snapshot(learner.global_params), snapshot(learner.params)

    learner.end_round(link)

    pending = learner.pending
    assert pending is not None and not pending.future.done()
    assert len(link.calls) == 1
    assert link.calls[0]["outer_step"] == 0 and link.calls[0]["weight"] == float(H * BATCH_TOKENS)
    assert_all_close(pending.snapshot, [t.reshape(-1) for t in local_at_round_end], rtol=0, atol=0)
    assert_all_close(link.calls[0]["tensors"], flat([g - s for g, s in zip(global_before, local_at_round_end, strict=True)]))
    assert learner.round_index == 1 and learner.rounds.tokens == 0  # our tokens now count towards the next round

    during = 3
    for _ in range(during):
        learner.inner_step(link)
    assert learner.pending is pending and pending.steps_during == during
    assert learner.outer_step == 0
    assert_all_close(learner.global_params, global_before, rtol=0, atol=0)  # untouched until the outcome arrives
    assert any(not torch.equal(p.reshape(-1), s) for p, s in zip(learner.params, pending.snapshot, strict=True))
    assert link.published[-1]["round"] == 1
    assert learner.tokens_unsynced == (H + during) * BATCH_TOKENS

    averaged = _known_average(learner)
    local_before_completion = snapshot(learner.params)
    pending.future.set_result(AveragingOutcome(flat(averaged), ("fake", "other"), 2.0 * pending.weight, "ok"))
    learner.complete_averaging(link)

    expected_global = snapshot(global_before)
    reference = OuterOptimizer(expected_global, config.outer)
    reference.step(averaged)
    assert learner.pending is None and learner.outer_step == 1 and learner.outer.steps_taken == 1
    assert_all_close(learner.global_params, expected_global)
    assert_all_close(learner.outer.state_tensors(), reference.state_tensors())
    assert learner.global_sha256 == state_sha256(learner.global_params, learner.outer.momentum_buffers)
    expected_local = [
        g + (lo - s.view(g.shape)) for g, lo, s in zip(expected_global, local_before_completion, pending.snapshot, strict=True)
    ]
    assert_all_close(learner.params, expected_local)
    assert_all_close(list(learner.model.parameters()), expected_local)
    assert learner.tokens_unsynced == during * BATCH_TOKENS  # only the work done meanwhile is left unsynced
    assert learner.round_index == 1 and [f for f in link.published if "outer_step" in f][-1]["outer_step"] == 1


def test_failed_averaging_in_flight_keeps_everything_for_the_next_round(make_config):
    config = _config(make_config)
    learner = _learner(config)
    link = FakeLink()
    for _ in range(H):
        learner.inner_step(link)
    global_before = snapshot(learner.global_params)
    learner.end_round(link)
    for _ in range(H):
        learner.inner_step(link)
    local_before = snapshot(learner.params)

    learner.pending.future.set_result(AveragingOutcome(None, (), 0.0, "no_group", "nobody came"))
    learner.complete_averaging(link)

    assert learner.pending is None and learner.outer_step == 0 and learner.round_index == 0
    assert_all_close(learner.global_params, global_before, rtol=0, atol=0)
    assert_all_close(learner.params, local_before, rtol=0, atol=0)
    assert learner.tokens_unsynced == 2 * H * BATCH_TOKENS

    learner.end_round(link)  # the next outer gradient carries both rounds' progress and tokens (a retry of step 0)
    assert link.calls[1]["outer_step"] == 0 and link.calls[1]["weight"] == float(2 * H * BATCH_TOKENS)
    assert learner.pending is not None and learner.pending.tokens_behind == 2 * H * BATCH_TOKENS
    assert_all_close(link.calls[1]["tensors"], flat([g - lo for g, lo in zip(global_before, local_before, strict=True)]))


def test_a_retry_of_the_same_step_ended_at_once_still_weighs_the_whole_round(make_config):
    """Peers still averaging the step end our retry's round at the next inner step; the weight is the tokens of the
    step's rounds together, not of that one step."""
    learner = _learner(_config(make_config))
    link = FakeLink()
    for _ in range(H):
        learner.inner_step(link)
    learner.end_round(link)
    learner.inner_step(link)  # one step while the averaging is in flight
    learner.pending.future.set_result(AveragingOutcome(None, (), 0.0, "no_group", "nobody came"))
    learner.complete_averaging(link)
    link.view = RoundView(live_peers=2, tokens_by_others=0, peers_ahead=2)  # the others average step 0 still
    learner.inner_step(link)
    assert learner.round_is_over(link)
    learner.end_round(link)
    assert [c["outer_step"] for c in link.calls] == [0, 0]
    assert link.calls[1]["weight"] == float((H + 2) * BATCH_TOKENS) == learner.pending.tokens_behind


def test_a_fragment_is_weighted_by_the_rounds_since_its_last_averaging(make_config):
    inner = InnerConfig(inner_steps=H, batch_size=BATCH, lr=1e-2, grad_clip_norm=1.0, fragments=2)
    learner = _learner(_config(make_config, inner=inner))
    link = FakeLink()
    outcomes = ["ok", "ok", "no_group", "ok", "ok"]  # outer steps 0, 1, 2 (fails: fragment 0 carries it), 2, 3
    for status in outcomes:
        for _ in range(H):
            learner.inner_step(link)
        learner.end_round(link)
        averaged = link.calls[-1]["tensors"] if status == "ok" else None
        learner.pending.future.set_result(AveragingOutcome(averaged, ("fake",), 1.0, status, ""))
        learner.complete_averaging(link)
    round_tokens = H * BATCH_TOKENS
    weights = [c["weight"] for c in link.calls]
    # steps 0 and 1: every token since the start; then the two rounds since the fragment's last averaging; the
    # retry of step 2 (fragment 0) and step 3 (fragment 1) each stand for the two attempts at step 2 and one more
    assert weights == [round_tokens, 2 * round_tokens, 2 * round_tokens, 3 * round_tokens, 3 * round_tokens]
    assert learner.fragments.unsynced == [round_tokens, 0]  # fragment 0: the round at step 3, sent at step 4


def test_round_end_waits_for_the_averaging_still_in_flight(make_config):
    """The one place compute waits: a new round cannot start before the previous outcome is applied."""
    config = _config(make_config)
    learner = _learner(config)
    link = FakeLink()
    for _ in range(H):
        learner.inner_step(link)
    learner.end_round(link)
    for _ in range(H):
        learner.inner_step(link)
    first = learner.pending
    outcome = AveragingOutcome(flat(_known_average(learner)), ("fake",), first.weight, "ok")
    timer = threading.Timer(0.2, first.future.set_result, args=(outcome,))
    timer.start()
    try:
        learner.end_round(link)
    finally:
        timer.join()

    assert learner.outer_step == 1 and learner.blocked_s >= 0.1
    assert len(link.calls) == 2 and link.calls[1]["outer_step"] == 1
    assert link.calls[1]["weight"] == float(H * BATCH_TOKENS)
    assert learner.pending is not None and learner.pending.outer_step == 1 and learner.round_index == 2


# (b) token weighting ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("complete_after", [0, 1, H])
def test_weights_add_up_to_the_tokens_processed(make_config, complete_after: int):
    steps = 4
    config = _config(make_config, max_outer_steps=steps)
    sink = ListSink()
    learner = _learner(config, sink)
    link = FakeLink(complete_after=complete_after)

    learner.run(link)

    assert learner.outer_step == steps and learner.pending is None
    assert len(link.calls) == steps and [c["outer_step"] for c in link.calls] == list(range(steps))
    assert learner.tokens_total == learner.dataset.train.position * BATCH_TOKENS
    weights = [c["weight"] for c in link.calls]
    # every token is in exactly one successful outer gradient, or still unsynced in the unfinished round
    assert learner.tokens_unsynced == learner.rounds.tokens == complete_after * BATCH_TOKENS
    assert sum(weights) == learner.tokens_total - learner.tokens_unsynced
    ok = [r for r in sink.records if r["status"] == "ok"]
    assert [r["weight"] for r in ok] == weights
    assert all(r["steps_during_averaging"] == complete_after for r in ok)


def test_overlap_loses_no_work_with_outer_lr1_no_momentum(make_config):
    """With outer SGD lr 1 and no momentum a group of one sets global <- snapshot, so however the averaging
    overlaps, local params are plain AdamW over every step and global params are AdamW up to the last snapshot."""
    steps = 3
    config = _config(make_config, outer=OuterConfig(lr=1.0, momentum=0.0), max_outer_steps=steps)
    learner = _learner(config)

    learner.run(FakeLink(complete_after=1))

    position = learner.dataset.train.position
    assert position == steps * H + 1  # one step ran while the last averaging was in flight
    # the rebase local += new_global - snapshot is exact only up to float rounding, which AdamW's normalised
    # steps amplify a little; a lost or repeated step would move elements by about the inner lr (1e-2)
    tolerance = dict(rtol=1e-4, atol=1e-4)
    assert_all_close(learner.params, plain_adamw(config, position), **tolerance)
    assert_all_close(learner.global_params, plain_adamw(config, position - 1), **tolerance)
    with pytest.raises(AssertionError):  # negative control: one step of work fewer is told apart
        assert_all_close(learner.params, plain_adamw(config, position - 1), **tolerance)


# (c) when a round ends ----------------------------------------------------------------------------------------


def test_round_is_over_at_once_when_a_peer_is_ahead(make_config):
    config = _config(make_config, inner=InnerConfig(inner_steps=1000, batch_size=BATCH))
    learner = _learner(config)
    assert not learner.round_is_over(FakeLink())
    link = FakeLink(view=RoundView(live_peers=1, tokens_by_others=0, peers_ahead=1))
    assert learner.round_is_over(link)
    assert link.views_asked == [0]


def test_run_ends_every_round_after_one_step_when_peers_are_ahead(make_config):
    config = _config(make_config, inner=InnerConfig(inner_steps=1000, batch_size=BATCH), max_outer_steps=3)
    learner = _learner(config)
    learner.run(FakeLink(complete_after=0, view=RoundView(live_peers=1, tokens_by_others=0, peers_ahead=1)))
    assert learner.outer_step == 3 and learner.dataset.train.position == 3


def test_round_is_over_when_the_swarm_tokens_reach_the_budget(make_config):
    config = _config(make_config)
    learner = _learner(config)
    budget = H * BATCH_TOKENS * (1 + 2)  # default budget: H steps of our batch per live peer, us included
    almost = FakeLink(view=RoundView(live_peers=2, tokens_by_others=budget - BATCH_TOKENS - 1, peers_ahead=0))
    enough = FakeLink(view=RoundView(live_peers=2, tokens_by_others=budget - BATCH_TOKENS, peers_ahead=0))
    alone = FakeLink()
    assert not learner.round_is_over(enough)
    learner.inner_step(alone)
    assert not learner.round_is_over(almost) and not learner.round_is_over(alone)
    assert learner.round_is_over(enough)
    # the budget is published when it changes (the beacon paces its records by the round's end): 3 peers, then 1
    assert enough.published == [{"round_budget": budget}] * 2 and almost.published == []  # only when it changed
    assert alone.published[-1] == {"round_budget": H * BATCH_TOKENS}
    # others' tokens count only once this peer is in the round they report: the link is asked for our round
    learner.end_round(alone)
    assert learner.pending is not None
    assert not learner.round_is_over(enough) and enough.views_asked[-1] == 1


def test_our_own_tokens_count_towards_the_round_at_most_the_share_cap(make_config):
    """The cap the others' tokens are held to (SwarmView.round_view) holds ours too, so that every peer reading
    the same records ends the round at the same tokens (docs/design.md §4)."""
    learner = _learner(_config(make_config))
    for _ in range(3):
        learner.inner_step(FakeLink())
    budget = H * BATCH_TOKENS * (1 + 2)
    enough = RoundView(live_peers=2, tokens_by_others=budget - 3 * BATCH_TOKENS, peers_ahead=0)
    assert learner.round_is_over(FakeLink(view=enough))
    assert learner.round_is_over(FakeLink(view=RoundView(2, enough.tokens_by_others, 0, share_cap=3 * BATCH_TOKENS)))
    assert not learner.round_is_over(FakeLink(view=RoundView(2, enough.tokens_by_others, 0, share_cap=2 * BATCH_TOKENS)))


def test_configured_tokens_per_round_replace_the_default_budget(make_config):
    config = _config(make_config, inner=InnerConfig(inner_steps=H, batch_size=BATCH, tokens_per_round=5 * BATCH_TOKENS))
    learner = _learner(config)
    learner.inner_step(FakeLink())
    many_peers = FakeLink(view=RoundView(live_peers=9, tokens_by_others=3 * BATCH_TOKENS, peers_ahead=0))
    assert not learner.round_is_over(many_peers)
    many_peers.view = RoundView(live_peers=9, tokens_by_others=4 * BATCH_TOKENS, peers_ahead=0)
    assert learner.round_is_over(many_peers)
    for _ in range(H):  # alone, the default budget would be over by now
        learner.inner_step(FakeLink())
    assert not learner.round_is_over(FakeLink())


def test_round_ends_at_the_deadline(make_config):
    config = _config(make_config, inner=InnerConfig(inner_steps=1000, batch_size=BATCH, round_deadline_s=0.2))
    learner = _learner(config)
    link = FakeLink()
    learner.rounds.started = time.monotonic()
    assert not learner.round_is_over(link)
    time.sleep(0.25)
    assert learner.round_is_over(link)
    learner.end_round(link)  # a new round starts its own deadline
    assert not learner.round_is_over(link)


# (d) throttle -------------------------------------------------------------------------------------------------


def test_throttle_below_one_is_rejected():
    with pytest.raises(ValueError, match="throttle"):
        InnerConfig(throttle=0.5)


def test_throttle_multiplies_the_compute_time_of_a_step(make_config, monkeypatch):
    learners = {
        throttle: _learner(
            _config(make_config, inner=InnerConfig(inner_steps=1000, batch_size=BATCH, throttle=throttle))
        )
        for throttle in (1.0, 3.0)
    }
    slept: list[tuple[float, float]] = []  # (asked for, taken), each throttled step's sleep
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        started = time.monotonic()
        real_sleep(seconds)
        slept.append((seconds, time.monotonic() - started))

    monkeypatch.setattr("p2p_diloco.train.learner.time.sleep", sleep)
    link = FakeLink()
    for learner in learners.values():  # warm-up: first calls allocate
        learner.inner_step(link)
    step_s: dict[float, list[float]] = {throttle: [] for throttle in learners}
    for _ in range(10):
        for throttle, learner in learners.items():
            before, sleeps = learner.compute_s, len(slept)
            learner.inner_step(link)
            step_s[throttle].append(learner.compute_s - before)
            assert len(slept) == sleeps + (throttle > 1)  # only the throttled peer sleeps, once a step
    # each throttled step sleeps twice its own compute (measured within the step, so load on the machine that slows
    # one step's compute lengthens its sleep alike), and counts the sleep as compute: 3x its work in all
    # (a step's work is measured up to its sleep; anything after the sleep, a preemption say, only adds to it)
    work = [total - taken for (_, taken), total in zip(slept[1:], step_s[3.0], strict=True)]
    asked = [seconds for seconds, _ in slept[1:]]
    assert all(a <= 2 * w * 1.001 for a, w in zip(asked, work)), (asked, work)
    assert sum(asked) >= 1.6 * sum(work), (asked, work)
    assert sum(step_s[3.0]) >= 2.5 * sum(work)  # the sleep counts as the step's compute
    assert not any(s > 0.5 for s in step_s[1.0])  # no sleep in the unthrottled peer's steps


# (e) at the planned end, a peer stays a while as a donor for peers still behind ---------------------------------


def test_at_the_planned_end_the_peer_waits_while_a_peer_is_behind_then_leaves(make_config):
    learner = _learner(_config(make_config, max_outer_steps=1))
    link = FakeLink(complete_after=0)
    link.behind = [1, 1, 1]  # one peer behind for three looks, then caught up
    started = time.monotonic()
    learner.run(link)
    assert learner.outer_step == 1
    assert link.behind_asked == [1, 1, 1, 1]  # asked until nobody was behind, never past that
    assert time.monotonic() - started >= 3 * 0.5  # it polled every 0.5 s meanwhile


class ForkedGroupmateLink(FakeLink):
    """Our last round's groupmate "odd" reports other bytes for the step it made with us, ``looks`` times, then ours
    (it healed by downloading them)."""

    def __init__(self, learner: Learner, looks: int):
        super().__init__(complete_after=0)
        self.learner, self.looks, self.sha_asked = learner, looks, 0

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        return AveragingOutcome(snapshot(tensors), (self.peer_id, "odd"), weight, "ok")

    def reported_sha256(self, outer_step: int) -> dict[str, str]:
        self.sha_asked += 1
        return {"odd": "f" * 64 if self.sha_asked <= self.looks else self.learner.global_sha256}


def test_at_the_planned_end_the_peer_waits_while_a_groupmate_holds_other_bytes_for_the_last_step(make_config):
    # a groupmate whose hardware computed the last step differently heals by downloading it: the peers that hold it
    # stay as donors until it reports their bytes (a CI failure: they had left, and it ended on its own bytes)
    learner = _learner(_config(make_config, max_outer_steps=1))
    link = ForkedGroupmateLink(learner, looks=5)
    started = time.monotonic()
    learner.run(link)
    assert learner.outer_step == 1 and learner.round_history[0] == ("fake", "odd")
    assert link.sha_asked > 5 and time.monotonic() - started >= 1.0  # it waited, polling every 0.5 s
    # bounded like any straggler wait: a groupmate that never heals is served straggler_wait_s, not for ever
    stuck = _learner(_config(make_config, max_outer_steps=1, straggler_wait_s=1.0))
    started = time.monotonic()
    stuck.run(ForkedGroupmateLink(stuck, looks=1000))
    assert 1.0 <= time.monotonic() - started < 10


def test_the_straggler_wait_is_bounded_and_skipped_on_a_stop_request_or_when_disabled(make_config):
    learner = _learner(_config(make_config, max_outer_steps=1, straggler_wait_s=1.0))
    link = FakeLink(complete_after=0)
    link.behind = [1] * 100  # somebody behind for good (a dead peer whose record has not expired, say)
    started = time.monotonic()
    learner.run(link)
    assert 1.0 <= time.monotonic() - started < 10 and 2 <= len(link.behind_asked) <= 4

    disabled = _learner(_config(make_config, max_outer_steps=1, straggler_wait_s=0.0))
    link = FakeLink(complete_after=0)
    link.behind = [1] * 100
    disabled.run(link)
    assert link.behind_asked == []

    stopped = _learner(_config(make_config, max_outer_steps=0))  # no planned end: it stops on request only
    link = FakeLink(complete_after=0)
    link.behind = [1] * 100
    threading.Timer(0.5, stopped.stop.set).start()
    stopped.run(link)
    assert link.behind_asked == []


def test_a_peer_publishes_the_steps_it_computed_itself_as_made(make_config):
    """Every averaged step goes into ``made`` (its step and the bytes it came out as), published with the head, for
    groupmates to tell whose arithmetic differs at a fork (train/catch_up.py); the last MADE of them."""
    learner = _learner(_config(make_config, max_outer_steps=2))
    link = FakeLink(complete_after=0)
    learner.run(link)
    heads = [(fields["outer_step"], fields["global_sha256"]) for fields in link.published if "outer_step" in fields]
    assert list(learner.made) == [node for node in dict.fromkeys(heads) if node[0] > 0] and len(learner.made) == 2
    assert [fields for fields in link.published if "made" in fields][-1]["made"] == [list(node) for node in learner.made]
