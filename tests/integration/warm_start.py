"""Warm starts for the integration tests' peers: a fork server that has already imported what every peer imports
(torch, ``torch._dynamo``, bitsandbytes, hivemind and this package: ~5 CPU s of a peer's start, most of a swarm
test's first 9 s on 2 cores) forks each peer from itself, where ``subprocess.Popen`` would start a fresh interpreter.

Only the harness's ``local_swarm`` peers start this way, and only when nothing would differ from a fresh start:
the peer's own command (``python -m p2p_diloco.cli peer``), in the server's working directory, with exactly the
environment the server started with (a peer given ``ATEN_CPU_CAPABILITY``, say, starts fresh). Every other start
(the launcher, the chaos and WAN runs, the bad-input and start-up tests) is a fresh interpreter, as a volunteer's.

The child is what ``Popen(start_new_session=True)`` makes: its own session and process group, stdin from
/dev/null, stdout and stderr to the peer's log, no other descriptor, the peer's argv and environment; it runs
``p2p_diloco.cli.main`` and leaves through ``sys.exit``, so the interpreter ends as a fresh one would (atexit
handlers, finalizers). The server reaps it and reports its exit code as ``Popen`` would (``-N`` for signal N).

Protocol, one JSON object per line: the client writes ``{"id", "argv", "log", "append"}`` to the server's stdin;
the server answers ``{"id", "pid"}`` (or ``{"id", "error"}``), and ``{"exited", "code"}`` when a child ends."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from p2p_diloco.cli.peer_processes import popen

SERVER = Path(__file__).resolve()


# read only by libraries the server does not import (it imports what a default peer does: test_hf_swarm.py checks
# that the Hugging Face libraries are not among them), or by nothing a peer imports: the child takes them before it
# runs, as any other variable of the environment it is given. The tests' own process sets some of them: pytest the
# test's name, whatever loads a Hugging Face tokenizer or model there the offline switches (hf_model.force_offline),
# the Hugging Face test its cache folder, torch its compiler's cache folder the first time anything there compiles
# (torch._inductor, which a peer does not load: test_layers_import.py checks it)
_NOT_READ_AT_IMPORT = ("PYTEST_CURRENT_TEST",)
_NOT_READ_AT_IMPORT_PREFIXES = ("HF_", "TRANSFORMERS_", "TORCHINDUCTOR_")


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
    """What of an environment the server's imports may have read."""
    return {key: value for key, value in env.items()
            if key not in _NOT_READ_AT_IMPORT and not key.startswith(_NOT_READ_AT_IMPORT_PREFIXES)}


def _differing(env: dict[str, str], other: dict[str, str]) -> str:
    first, second = _read_at_import(env), _read_at_import(other)
    return ", ".join(sorted(k for k in first.keys() | second.keys() if first.get(k) != second.get(k)))


class WarmProcess:
    """A peer forked by the server: what the launcher's code uses of ``subprocess.Popen``."""

    def __init__(self, starter: WarmStarter, pid: int, args: list[str]):
        self.starter, self.pid, self.args = starter, pid, args

    @property
    def returncode(self) -> int | None:
        return self.starter.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self.starter.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # as Popen: never signal a pid already reaped (it may be another process's now)
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # it ended and the server reaped it; its exit code is on its way (Popen
                pass  # would have found a zombie, waiting for its wait)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """The client: starts the server at the first peer (``spawn``), falls back to ``Popen`` where a warm start
    would differ or the server is unusable, stops the server by its pid (``close``)."""

    def __init__(self, peer_command: list[str], environment: dict[str, str]):
        self.peer_command, self.environment, self.cwd = list(peer_command), dict(environment), os.getcwd()
        self.server: subprocess.Popen | None = None
        self.broken = False
        self._lock, self._changed = threading.Lock(), threading.Condition()
        self._next_id, self._answers, self._exits = 0, {}, {}
        self.forked, self.fresh = 0, {}  # peers started each way (fresh: by why), for the session's summary

    def summary(self) -> str:
        fresh = ", ".join(f"{count} for {why}" for why, count in sorted(self.fresh.items())) or "none"
        return f"warm starts: {self.forked} peers forked from the server; started fresh: {fresh}"

    def spawn(self, command: list[str], env: dict[str, str], log_file: Path, append: bool):
        prefix = [sys.executable, *self.peer_command]
        fresh_because = (
            "another command" if command[: len(prefix)] != prefix
            else f"another environment ({_differing(env, self.environment)})"
            if _read_at_import(env) != _read_at_import(self.environment)
            else "another working directory" if os.getcwd() != self.cwd
            else "no server" if not self._serving() else None
        )
        if fresh_because is not None:
            self.fresh[fresh_because] = self.fresh.get(fresh_because, 0) + 1
            return popen(command, env, log_file, append)
        with self._lock:
            self._next_id += 1
            request_id = self._next_id
            request = {"id": request_id, "argv": command[len(prefix) - 1 :], "env": env, "log": str(log_file), "append": append}
            # argv: ["peer", *flags], what ``python -m p2p_diloco.cli`` passes to its main
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
        answer = self._wait_for(lambda: self._answers.pop(request_id, None), 30)
        if answer is None or "pid" not in answer:
            raise RuntimeError(f"the warm-start server did not fork the peer: {answer}")
        self.forked += 1  # counted once forked, for the summary
        return WarmProcess(self, answer["pid"], command)

    def start(self) -> bool:
        """Start the server now (it imports for ~5 CPU s); whether it serves. ``spawn`` starts it otherwise."""
        return self._serving()

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        return self._wait_for(lambda: self._exits.get(pid), timeout)

    def close(self) -> None:
        """Stop the server (its children, the peers, are the tests' to stop: each in its own process group)."""
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()  # EOF: the server exits
            try:
                self.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(timeout=10)

    def _serving(self) -> bool:
        if self.server is None and not self.broken:
            self.server = subprocess.Popen(
                [sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                env=self.environment, cwd=self.cwd,
            )
            if json.loads(self.server.stdout.readline() or "{}").get("ready") is not True:  # not fork-safe: refused
                self.broken = True
                self.close()
                return False
            threading.Thread(target=self._read_answers, name="warm-start answers", daemon=True).start()
        return not self.broken and self.server is not None and self.server.poll() is None

    def _read_answers(self) -> None:
        for line in self.server.stdout:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                else:
                    self._answers[message["id"]] = message
                self._changed.notify_all()

    def _wait_for(self, found, timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while (value := found()) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left if left is None else min(left, 1.0))
            return value


# ---- the server ------------------------------------------------------------------------------------------------


def _preload() -> None:
    """What every peer imports on its default path (cli/peer.py), nothing more."""
    from p2p_diloco.swarm.hivemind_api import UNUSED_IMPORTS, load_on_first_use

    for name in UNUSED_IMPORTS:  # as peer_main does, before hivemind
        load_on_first_use(name)
    import torch

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # loads torch._dynamo as a peer's first optimizer; no RNG drawn

    import p2p_diloco.cli.launch  # noqa: F401  (cli.main imports it)
    import p2p_diloco.cli.peer  # noqa: F401
    import p2p_diloco.cli.ready  # noqa: F401
    import p2p_diloco.observe.display  # noqa: F401
    import p2p_diloco.observe.metrics  # noqa: F401
    import p2p_diloco.observe.monitor  # noqa: F401
    import p2p_diloco.observe.watch  # noqa: F401
    import p2p_diloco.swarm.addresses  # noqa: F401
    import p2p_diloco.swarm.joining  # noqa: F401
    import p2p_diloco.swarm.processes  # noqa: F401
    import p2p_diloco.swarm.swarm_link  # noqa: F401
    import p2p_diloco.train.data  # noqa: F401
    import p2p_diloco.train.learner  # noqa: F401
    import p2p_diloco.train.model  # noqa: F401
    from p2p_diloco.core.compression import make_codec

    make_codec("int8")  # imports bitsandbytes as the int8 codec does


_ANSWERS = 1  # the pipe to the client: moved off stdout before anything is imported (serve)


def _answer(message: dict) -> None:
    os.write(_ANSWERS, (json.dumps(message) + "\n").encode())


def serve() -> dict:
    """Answer requests until stdin closes (then exit); returns only in a forked child, with its request."""
    global _ANSWERS
    _ANSWERS = os.dup(1)  # what an import prints goes to stderr, never into the answers
    os.dup2(2, 1)
    sys.path[0] = os.getcwd()  # as ``python -m``: the working directory first, not this file's folder
    _preload()
    if threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        print("not fork-safe: threads started while importing", flush=True)
        sys.exit(1)
    _answer({"ready": True})
    buffered = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        while True:  # reap and report every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            sys.exit(0)
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            try:
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC), 0o644)
            except OSError as e:
                _answer({"id": request["id"], "error": str(e)})
                continue
            pid = os.fork()
            if pid == 0:
                os.setsid()
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                return request
            os.close(log)
            _answer({"id": request["id"], "pid": pid})


def run_child(request: dict) -> None:
    import multiprocessing

    import numpy
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    import p2p_diloco.cli.__main__ as entry
    from p2p_diloco.cli import main

    # hivemind makes process-shared locks as it is imported (MPFuture's, SharedBytes', its executor's): a fresh
    # peer has its own, shared with its own DHT and averager only; forked, every peer would share the server's, and
    # a peer SIGKILLed holding one would wedge every other peer's calls into its background processes
    MPFuture.reset_backend()
    _AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()
    os.environ.clear()
    os.environ.update(request["env"])
    numpy.random.seed()  # a fresh interpreter's numpy draws its own seed; a fork would share the server's
    sys.argv = [entry.__file__, *request["argv"]]  # as ``python -m p2p_diloco.cli peer ...``
    sys.exit(main(request["argv"]))


if __name__ == "__main__":
    run_child(serve())
