"""A peer's background work yields to its training (swarm/processes.py, docs/benchmarks.md "Where a peer's time
goes"): the processes it starts (and theirs) and its background threads get a higher nice value; the trainer's
own does not change. ``p2pd`` runs Go code on the threads ``--p2pd-threads`` gives it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from p2p_diloco.core.config import SwarmConfig
from p2p_diloco.swarm.joining import start_dht
from p2p_diloco.swarm.processes import descendants, lower_priority, lower_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values of threads are Linux's")


def test_background_processes_and_threads_are_lowered_and_the_trainer_is_not():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    # the child runs a second thread, as the averager's event loop and p2pd's Go threads do
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                               "'import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); "
                               "time.sleep(30)'])"])
    try:
        for _ in range(200):  # its child starts a moment later, and its second thread after that
            if descendants(parent.pid) and len(os.listdir(f"/proc/{descendants(parent.pid)[0]}/task")) >= 2:
                break
            threading.Event().wait(0.05)
        family = [parent.pid, *descendants(parent.pid)]
        assert len(family) == 2
        threads = [int(tid) for pid in family for tid in os.listdir(f"/proc/{pid}/task")]
        assert len(threads) >= 3
        assert lower_priority(5, [parent.pid]) == 2
        assert [os.getpriority(os.PRIO_PROCESS, tid) for tid in threads] == [min(19, own + 5)] * len(threads)
        assert lower_priority(0, [parent.pid]) == 0  # 0 leaves them
        seen: list[int] = []

        def background() -> None:
            lower_this_thread(3)
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

        thread = threading.Thread(target=background)
        thread.start()
        thread.join()
        assert seen == [min(19, own + 3)] and os.getpriority(os.PRIO_PROCESS, 0) == own
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


def _p2pd_environment(dht_pid: int) -> dict[str, str]:
    (p2pd,) = [pid for pid in descendants(dht_pid) if open(f"/proc/{pid}/comm").read().strip() == "p2pd"]
    pairs = open(f"/proc/{p2pd}/environ", "rb").read().split(b"\0")
    return dict(pair.decode().split("=", 1) for pair in pairs if b"=" in pair)


def test_p2pd_runs_on_the_go_threads_it_is_given_and_the_trainer_keeps_its_environment(monkeypatch):
    """--p2pd-threads reaches p2pd (started by the DHT's process) as GOMAXPROCS; 0 leaves Go's default."""
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    for threads, expected in ((1, "1"), (3, "3"), (0, None)):
        dht = start_dht(SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), p2pd_threads=threads))
        try:
            assert _p2pd_environment(dht.pid).get("GOMAXPROCS") == expected
            assert "GOMAXPROCS" not in os.environ  # set in the DHT's process only
        finally:
            dht.shutdown()
