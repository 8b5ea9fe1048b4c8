"""The portable arithmetic of portable.py in one process: SHAKE-256 draws and their statistics, the seeded init
that leaves torch's generator and methods alone, decoders equal to bitsandbytes' to the byte, and a learner that
says so when its own group's outer step came out other bytes here. (The same bytes under every CPU kernel set and
thread count are checked in subprocesses: tests/integration/test_portable_arithmetic.py.)"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Sequence

import pytest
import torch

from p2p_diloco.core import compression
from p2p_diloco.core.config import InnerConfig, ModelConfig, RunConfig
from p2p_diloco.core.history import Target
from p2p_diloco.core.link import AveragingOutcome, SwarmState
from p2p_diloco.core.outer import params_sha256, state_sha256
from p2p_diloco.core.portable import portable_init, seeded_normal, seeded_uniform
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.learner import Learner
from p2p_diloco.train.model import GPT, build_model

from .helpers import make_dataset, snapshot
from .test_learner_catch_up import AheadLink


def test_seeded_draws_are_fixed_by_their_key_and_look_like_their_distribution():
    normal = seeded_normal(1_000_000, "a")
    assert normal.dtype == torch.float32 and normal.shape == (1_000_000,)
    assert torch.equal(normal, seeded_normal(1_000_000, "a")) and not torch.equal(normal, seeded_normal(1_000_000, "b"))
    assert abs(float(normal.double().mean())) < 0.005 and abs(float(normal.double().std()) - 1.0) < 0.005
    assert 3.5 < float(normal.abs().max()) < 6.0  # Irwin-Hall(12) stops at 6 standard deviations
    uniform = seeded_uniform(1_000_000, "a")
    assert float(uniform.min()) >= 0.0 and float(uniform.max()) < 1.0
    assert abs(float(uniform.double().mean()) - 0.5) < 0.005
    # a draw longer than one SHAKE stream is the concatenation of the streams: its prefix is the shorter draw
    assert torch.equal(seeded_normal(3_000_000, "a")[:1_000_000], normal)


def test_the_seeded_init_is_portable_and_leaves_torch_as_it_was():
    methods = (torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_)
    generator_state = torch.random.get_rng_state()
    first, again, other = (build_model(ModelConfig(n_layers=2, d_model=64, n_heads=2), seed) for seed in (5, 5, 6))
    assert torch.equal(torch.random.get_rng_state(), generator_state)
    assert (torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_) == methods
    params = list(first.parameters())
    assert params_sha256(params) == params_sha256(list(again.parameters()))
    assert params_sha256(params) != params_sha256(list(other.parameters()))
    weights = {name: param.detach() for name, param in first.named_parameters()}
    assert abs(float(weights["token_embedding.weight"].std()) - 0.02) < 0.001  # the GPT's init: normal, std 0.02
    assert float(weights["blocks.0.attn.qkv.bias"].abs().max()) == 0.0 and bool((weights["ln_f.weight"] == 1).all())


def test_portable_init_draws_every_call_anew_and_restores_the_methods_on_error():
    originals = (torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_)
    with pytest.raises(RuntimeError), portable_init(1) as draws:
        a, b = torch.empty(10).normal_(), torch.empty(10).normal_()
        assert not torch.equal(a, b) and draws.calls == 2
        torch.nn.init.trunc_normal_(c := torch.empty(1000), std=5.0, a=-1.0, b=1.0)
        assert float(c.abs().max()) <= 1.0
        raise RuntimeError("the model's constructor failed")
    assert (torch.Tensor.normal_, torch.Tensor.uniform_, torch.nn.init.trunc_normal_) == originals
    with portable_init(1):
        GPT(ModelConfig(n_layers=1, d_model=32, n_heads=2, seq_len=16))  # builds inside, as build_model does


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 257, 10_001])
def test_decoders_give_the_bytes_of_bitsandbytes_own_dequantize(name: str, numel: int):
    from bitsandbytes.functional import QuantState, dequantize_4bit, dequantize_blockwise

    codec = compression.make_codec(name)
    values = seeded_normal(numel, f"{name} {numel}") * 3.0
    data = codec.encode(values)
    blocks = -(-numel // codec.block_size)
    absmax = torch.frombuffer(bytearray(data), dtype=torch.float32, count=blocks)
    if name == "int8":
        indices = torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=4 * blocks, count=numel)
        reference = dequantize_blockwise(indices, absmax=absmax, code=compression.dynamic_code(), blocksize=codec.block_size)
    else:
        packed = torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=4 * blocks, count=-(-numel // 2)).view(-1, 1)
        state = QuantState(absmax=absmax, shape=torch.Size([numel]), code=compression.nf4_code(),
                           blocksize=codec.block_size, quant_type="nf4", dtype=torch.float32)
        reference = dequantize_4bit(packed, state).view(-1)[:numel]
    decoded = codec.decode(data, numel)
    assert torch.equal(decoded.view(torch.int32), reference.contiguous().view(torch.int32))
    assert float((decoded - values).norm() / values.norm()) < (0.02 if name == "int8" else 0.12)


def test_the_fixed_code_books_are_bitsandbytes_own():
    from bitsandbytes.functional import create_dynamic_map, get_4bit_type

    assert torch.equal(compression.dynamic_code(), create_dynamic_map(signed=True))
    assert torch.equal(compression.nf4_code(), get_4bit_type("nf4", device="cpu"))


class GroupmatesLink(AheadLink):
    """A swarm in which this peer's groupmates of the last round report ``theirs`` for its current outer step, and
    serve that state: the fork heals by download. ``reports`` overrides what a groupmate reports: other bytes
    (ours: it agrees with us), or ``None``: it is still at the step before, applying the step. What each says it
    computed for the step (``made``) is what it reports, but for the groupmates in ``downloaded``."""

    def __init__(self, state: SwarmState, groupmates: Sequence[str], theirs: str, how: str = "fork"):
        super().__init__(state.outer_step, state)
        self.groupmates, self.theirs, self.how = tuple(groupmates), theirs, how
        self.reports: dict[str, str | None] = {}
        self.downloaded: set[str] = set()

    def swarm_target(self, chain, fresh) -> Target | None:
        return Target(self.state.outer_step, self.theirs, self.how) if self.theirs != chain[-1][1] else None

    def reported_sha256(self, outer_step: int) -> dict[str, str]:
        at = {peer: self.reports.get(peer, self.theirs) for peer in self.groupmates}
        if outer_step == self.state.outer_step:
            return {peer: sha for peer, sha in at.items() if sha is not None} | {"stranger": "0" * 64}
        return {peer: "3" * 64 for peer, sha in at.items() if sha is None and outer_step == self.state.outer_step - 1}

    def made_sha256(self, outer_step: int) -> dict[str, str]:
        reported = self.reported_sha256(outer_step) if outer_step == self.state.outer_step else {}
        return {peer: sha for peer, sha in reported.items() if peer in self.groupmates and peer not in self.downloaded}


def _forked_at_step_4(make_config, group: tuple[str, ...], run: RunConfig | None = None,
                      **link) -> tuple[Learner, GroupmatesLink, str]:
    """A learner at outer step 4, which it averaged with ``group`` (this peer, "fake", among them), and a swarm whose
    groupmates report other bytes for step 4: the same step, one ulp or so apart, another arithmetic."""
    config = make_config(inner=InnerConfig(inner_steps=1, batch_size=2), **({"run": run} if run else {}))
    learner = Learner(config, make_dataset(make_config()), NullSink())
    learner.outer_step = 4
    learner.round_history[3] = group
    momentum = snapshot(learner.outer.momentum_buffers)
    theirs = [p + 1e-7 for p in learner.global_params]
    state = SwarmState(4, theirs, momentum, 4, 0, state_sha256(theirs, momentum), donor=group[1])
    return learner, GroupmatesLink(state, [peer for peer in group if peer != "fake"], state.global_sha256, **link), \
        learner.global_sha256


def test_a_peer_whose_own_group_computed_its_step_otherwise_says_so_once_and_counts_it(make_config, caplog):
    learner = Learner(make_config(inner=InnerConfig(inner_steps=1, batch_size=2)), make_dataset(make_config()), NullSink())
    learner.outer_step = 4
    learner.round_history[3] = ("fake", "peerA", "peerB")  # this peer averaged step 3 -> 4 with A and B
    momentum = snapshot(learner.outer.momentum_buffers)
    theirs = [p + 1e-7 for p in learner.global_params]  # the same step, one ulp or so apart: another arithmetic
    state = SwarmState(4, theirs, momentum, 4, 0, state_sha256(theirs, momentum), donor="peerA")
    link = GroupmatesLink(state, ["peerA", "peerB"], state.global_sha256)
    ours = learner.global_sha256

    with caplog.at_level(logging.WARNING, logger="p2p_diloco.train.learner"):
        assert learner.catch_up(link) is True
    lines = [r.getMessage() for r in caplog.records if "differently" in r.getMessage()]
    assert lines == [f"this peer's hardware computed outer step 4 differently from 2 of 2 groupmates (ours {ours[:12]}, "
                     f"theirs {state.global_sha256[:12]}): same inputs, other bytes; taking the swarm's state"]
    assert learner.arithmetic_mismatches == [4] and learner.forks_healed == 1
    assert learner.global_sha256 == state.global_sha256

    # a fork at a step this peer's group did not make (another group's) is a plain fork: no such line
    learner.round_history.clear()
    learner.global_sha256, learner.chain = ours, deque([(4, ours)])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.train.learner"):
        learner.catch_up(link)
    assert not [r for r in caplog.records if "differently" in r.getMessage()]
    assert learner.arithmetic_mismatches == [4] and learner.forks_healed == 2
    record = {}
    learner.metrics = type("Sink", (), {"write": lambda self, r: record.update(r)})()
    learner.write(link, AveragingOutcome(None, (), 0.0, "no_group"))
    assert record["arithmetic_mismatches"] == 1


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "other bytes" in r.getMessage()]


def _heals(learner: Learner, link, caplog) -> list[str]:
    """Catch up, which must take the swarm's state, and the fork lines it said."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert learner.catch_up(link) is True
    return _said(caplog)


def test_a_group_of_two_or_split_evenly_blames_nobody_s_hardware(make_config, caplog):
    """Two peers that computed their step otherwise cannot tell whose arithmetic differs (a CI run's portable peer
    blamed its own hardware for a round it made with the odd one alone): the line says so, and still counts it."""
    learner, link, ours = _forked_at_step_4(make_config, ("fake", "peerA"))
    theirs = link.theirs
    said = _heals(learner, link, caplog)
    assert said == [f"outer step 4 came out as other bytes on this peer than on its one groupmate (ours "
                    f"{ours[:12]}, theirs {theirs[:12]}): same inputs, other bytes, and a group of two cannot "
                    "tell whose hardware differs; taking the swarm's state"]
    assert learner.arithmetic_mismatches == [4] and learner.forks_healed == 1 and learner.global_sha256 == theirs

    # a group of four, split two and two: said, and counted
    learner, link, ours = _forked_at_step_4(make_config, ("fake", "peerA", "peerB", "peerC"))
    link.reports = {"peerB": ours}
    said = _heals(learner, link, caplog)
    assert said == [f"outer step 4 came out as other bytes on this peer than on 2 of the 3 groupmates that say "
                    f"what they computed, in a group of 4 (ours {ours[:12]}, theirs {link.theirs[:12]}): same "
                    "inputs, other bytes, and as many of those that say hold ours, so nobody can tell whose "
                    "hardware differs; taking the swarm's state"]
    assert learner.arithmetic_mismatches == [4]
    # three (this peer, B and C) against A, whom the swarm followed all the same: A's line, not ours
    learner, link, ours = _forked_at_step_4(make_config, ("fake", "peerA", "peerB", "peerC"))
    link.reports = {"peerB": ours, "peerC": ours}
    assert _heals(learner, link, caplog) == [] and learner.arithmetic_mismatches == [] and learner.forks_healed == 1

    # a group of three whose B did not compute the step (its round failed) but downloaded A's bytes since: not two
    # against one (a CI run's portable peer blamed its own hardware so)
    learner, link, ours = _forked_at_step_4(make_config, ("fake", "peerA", "peerB"))
    link.downloaded = {"peerB"}
    assert [line.split(" (")[0] for line in _heals(learner, link, caplog)] == [
        "outer step 4 came out as other bytes on this peer than on 1 of the 1 groupmates that say what they computed, "
        "in a group of 3"]
    assert _said(caplog)[0].endswith("as many of those that say hold ours, so nobody can tell whose hardware differs; "
                                     "taking the swarm's state")

    # a fork that another group made at our step, which no groupmate computed: a plain fork, no line
    learner, link, ours = _forked_at_step_4(make_config, ("fake", "peerA", "peerB"))
    link.downloaded = {"peerA", "peerB"}
    assert learner.catch_up(link) is True and learner.arithmetic_mismatches == [] and learner.forks_healed == 1


def test_a_fork_at_our_groups_step_waits_once_for_the_groupmates_still_applying_it(make_config, caplog):
    """The first of a group of three to look saw one groupmate's other bytes against its own and took them on a tie
    (a CI run): the odd peer's bytes went on. Now it waits a round while a groupmate is still at the step before, so
    that the group's majority decides; once per step, and never at the planned end."""
    learner, link, ours = _forked_at_step_4(make_config, ("fake", "peerA", "peerB"), how="tie")
    link.reports = {"peerB": None}  # B is still applying step 4
    with caplog.at_level(logging.INFO):
        assert learner.catch_up(link) is False
    assert link.downloads == 0 and learner.global_sha256 == ours and learner.fork_waited == 4
    waited = "outer step 4: other bytes are reported for it; waiting a round for the 1 groupmate(s) still applying it"
    assert waited in [r.getMessage() for r in caplog.records]
    assert _said(caplog) == [] and learner.arithmetic_mismatches == []
    link.reports = {}  # B reports A's bytes: two of three, so it was this peer's hardware
    said = _heals(learner, link, caplog)
    assert said == [f"this peer's hardware computed outer step 4 differently from 2 of 2 groupmates (ours "
                    f"{ours[:12]}, theirs {link.theirs[:12]}): same inputs, other bytes; taking the swarm's state"]

    # B still applying at the next look: the fork heals all the same, and blames nobody
    learner, link, ours = _forked_at_step_4(make_config, ("fake", "peerA", "peerB"), how="tie")
    link.reports = {"peerB": None}
    assert learner.catch_up(link) is False
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert learner.catch_up(link) is True
    assert link.downloads == 1 and learner.forks_healed == 1
    assert [line.split(" (")[0] for line in _said(caplog)] == [
        "outer step 4 came out as other bytes on this peer than on 1 of the 1 groupmates that say what they computed, "
        "in a group of 3"]

    # nothing to wait for when every groupmate has reported, nor at the planned end (confirm_last_step waited)
    for run, reports in ((None, {}), (RunConfig(eval_batches=1, seed=3, max_outer_steps=4), {"peerB": None})):
        learner, link, ours = _forked_at_step_4(make_config, ("fake", "peerA", "peerB"), run=run)
        link.reports = reports
        assert learner.catch_up(link) is True and learner.fork_waited == -1 and learner.global_sha256 == link.theirs


class MadeLink(AheadLink):
    """An ``AheadLink`` whose live peers say what they computed for each step (``made``: step -> {peer: sha256})."""

    def __init__(self, swarm_step: int, state: SwarmState, made: dict[int, dict[str, str]] | None = None):
        super().__init__(swarm_step, state)
        self.made = made or {}

    def made_sha256(self, outer_step: int) -> dict[str, str]:
        return dict(self.made.get(outer_step, {}))


def test_a_step_our_group_computed_otherwise_is_said_when_the_swarm_moved_on_before_we_saw_it(make_config, caplog):
    """The groupmates took the next step (without us: our base differed) before our catch-up looked, so the swarm is
    ahead rather than at our step with other bytes: the downloaded state's history shows the fork at our step, and
    what the groupmates say they computed for it says whose arithmetic differs."""
    def at_step_5(group_of_step_3: tuple[str, ...], made: dict | None = None) -> tuple[Learner, MadeLink, str]:
        learner = Learner(make_config(inner=InnerConfig(inner_steps=1, batch_size=2)), make_dataset(make_config()),
                          NullSink())
        learner.outer_step = 4
        learner.round_history[3] = ("fake", "peerA", "peerB")  # this peer averaged step 3 -> 4 with A and B
        momentum = snapshot(learner.outer.momentum_buffers)
        theirs = [p + 1e-7 for p in learner.global_params]
        state = SwarmState(5, theirs, momentum, 5, 0, state_sha256(theirs, momentum), donor="peerA",
                           round_history={3: group_of_step_3, 4: ("peerA", "peerB")},
                           chain=((3, "3" * 64), (4, "4" * 64), (5, state_sha256(theirs, momentum))))
        return learner, MadeLink(5, state, {4: made or {}}), learner.global_sha256

    learner, link, ours = at_step_5(("fake", "peerA", "peerB"), made={"peerA": "4" * 64, "peerB": "4" * 64})
    said = _heals(learner, link, caplog)
    assert said == [f"this peer's hardware computed outer step 4 differently from 2 of 2 groupmates (ours "
                    f"{ours[:12]}, theirs {'4' * 12} in peerA's history): same inputs, other bytes; taking the "
                    "swarm's state"]
    assert learner.arithmetic_mismatches == [4] and learner.forks_healed == 1 and learner.outer_step == 5

    # B computed our bytes, and the swarm went on with A's all the same: A's line, not ours
    learner, link, ours = at_step_5(("fake", "peerA", "peerB"))
    link.made = {4: {"peerA": "4" * 64, "peerB": ours}}
    assert _heals(learner, link, caplog) == [] and learner.arithmetic_mismatches == [] and learner.forks_healed == 1
    # groupmates that say nothing of step 4 (their lists no longer reach back to it): said, blaming nobody
    learner, link, ours = at_step_5(("fake", "peerA", "peerB"))
    said = _heals(learner, link, caplog)
    assert said == [f"outer step 4 came out as other bytes on this peer than in the swarm, in a group of 3 (ours "
                    f"{ours[:12]}, theirs {'4' * 12} in peerA's history): same inputs, other bytes, and no "
                    "groupmate says what it computed; taking the swarm's state"]
    assert learner.arithmetic_mismatches == [4] and learner.forks_healed == 1

    # a step this peer made with A alone: nobody can tell whose hardware differs
    learner, link, ours = at_step_5(("fake", "peerA"), made={"peerA": "4" * 64})
    learner.round_history[3] = ("fake", "peerA")
    said = _heals(learner, link, caplog)
    assert said == [f"outer step 4 came out as other bytes on this peer than on its one groupmate (ours "
                    f"{ours[:12]}, theirs {'4' * 12} in peerA's history): same inputs, other bytes, and a group "
                    "of two cannot tell whose hardware differs; taking the swarm's state"]
    assert learner.arithmetic_mismatches == [4] and learner.forks_healed == 1

    # the donor's history says another group made step 4 (A and B alone): a plain fork, healed, not our arithmetic
    learner, link, ours = at_step_5(("peerA", "peerB"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert learner.catch_up(link) is True
    assert not [r for r in caplog.records if "differently" in r.getMessage()]
    assert learner.arithmetic_mismatches == [] and learner.forks_healed == 1

    # the donor's history holds our bytes for step 4: we were merely behind
    learner, link, ours = at_step_5(("fake", "peerA", "peerB"))
    link.state = dataclasses.replace(link.state, chain=((4, ours), (5, link.state.global_sha256)))
    assert learner.catch_up(link) is True
    assert learner.arithmetic_mismatches == [] and learner.forks_healed == 0
