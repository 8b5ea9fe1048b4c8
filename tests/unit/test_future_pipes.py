"""swarm/future_pipes.py: a future the trainer sends to a child it forked goes without its pipe, any other as hivemind
pickles it. One process plays both sides here (an ``mp.Pipe``'s two ends): what the child would inherit is this
process's own note."""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import resource_sharer

import pytest
from hivemind.utils.mpfuture import MPFuture

from p2p_diloco.swarm import future_pipes


@pytest.fixture
def patched(monkeypatch):
    # hivemind's own pickling, whether or not a DHT started in this process (an integration test) installed ours
    originals = future_pipes._hivemind or dict(getstate=MPFuture.__getstate__, setstate=MPFuture.__setstate__)
    monkeypatch.setattr(MPFuture, "__getstate__", originals["getstate"])
    monkeypatch.setattr(MPFuture, "__setstate__", originals["setstate"])
    monkeypatch.setattr(future_pipes, "_hivemind", {})
    monkeypatch.setattr(future_pipes, "_inherited", {})
    shared = []  # the descriptors multiprocessing puts up for another process to fetch (hivemind's way)
    register = resource_sharer._resource_sharer.register
    monkeypatch.setattr(resource_sharer._resource_sharer, "register", lambda send, close: shared.append(1) or register(send, close))
    future_pipes.before_fork()
    return shared


def _through(connection_pair, message):
    sender, receiver = connection_pair
    sender.send(message)
    return receiver.recv()


def test_a_future_sent_to_a_child_goes_without_its_pipe_and_the_child_uses_the_inherited_one(patched):
    receiver, sender = mp.Pipe(duplex=False)
    future_pipes.to_child(sender)
    future = MPFuture()
    got = _through((sender, receiver), dict(future=future))["future"]
    assert patched == []  # no descriptor put up to be fetched: nothing for the child to connect back for
    assert got._sender_pipe is future_pipes._inherited[os.getpid()] is MPFuture._global_sender_pipe
    assert got._uid == future._uid and got._origin_pid == os.getpid()


def test_other_connections_and_other_processes_futures_keep_hivemind_s_pickling(patched):
    receiver, sender = mp.Pipe(duplex=False)
    got = _through((sender, receiver), MPFuture())  # an unmarked connection: the pipe goes along, as hivemind sends it
    assert len(patched) == 1 and got._sender_pipe is not MPFuture._global_sender_pipe
    marked_receiver, marked = mp.Pipe(duplex=False)
    future_pipes.to_child(marked)
    passed_on = MPFuture()
    passed_on._origin_pid = os.getpid() + 1  # made by another process (passed on): its pipe is not the one inherited
    got = _through((marked, marked_receiver), passed_on)
    assert len(patched) == 2 and got._sender_pipe is not MPFuture._global_sender_pipe


def test_the_result_set_through_the_inherited_pipe_reaches_the_future(patched):
    receiver, sender = mp.Pipe(duplex=False)
    future_pipes.to_child(sender)
    future = MPFuture()
    got = _through((sender, receiver), future)
    got._origin_pid = -1  # as the child sees it: not the process that made it, so the result goes back by the pipe
    got.set_result("answer")
    assert future.result(timeout=10) == "answer"


def test_install_twice_keeps_hivemind_s_pickling_once(patched):
    original = future_pipes._hivemind["getstate"]
    future_pipes.install()
    assert future_pipes._hivemind["getstate"] is original and MPFuture.__getstate__ is future_pipes._getstate
