"""A call from the trainer into its DHT's or averager's process without re-sending the pipe its answer comes back on.

Every call into hivemind's DHT or averager process (a DHT read, a pushed progress record, an averaging step) carries an
``MPFuture``, and a pickled ``MPFuture`` carries the pipe on which its result goes back to the process that made it.
multiprocessing sends a pipe by its file descriptor through the sender's resource sharer: for each call the receiving
process opens a socket to the sender, both sides run the HMAC challenge of the sender's authkey, and the descriptor
is passed and closed again. That was about half of what a local DHT read costs: 2.0 ms of CPU on its two sides
together, 0.95 ms without it (docs/benchmarks.md, "Calls into the background processes").

The DHT's and the averager's processes are forked from the trainer, after its ``MPFuture`` backend has made that
pipe, so each already holds it. ``before_fork`` notes the trainer's pipe where the child will inherit the note, and
``to_child`` marks the connection on which the trainer sends commands to that child: a future the trainer made,
pickled for that connection, goes without its pipe, and the child takes the one it inherited. Any other future
(one the averager's process sends to the DHT's, or one passed on from a process that did not make it) is pickled
as hivemind pickles it. Installed once, in the trainer, before the first child is forked.
"""

from __future__ import annotations

import os
import threading
from typing import Any

_inherited: dict[int, Any] = {}  # pid -> that process's result pipe, noted before it forked the children that hold it
_sending = threading.local()  # set while a marked connection pickles a command
_hivemind: dict[str, Any] = {}  # MPFuture's own __getstate__ / __setstate__, kept by install


def _getstate(future: Any) -> dict:
    state = _hivemind["getstate"](future)
    pipe = _inherited.get(os.getpid())
    if getattr(_sending, "to_child", False) and pipe is not None and future._origin_pid == os.getpid() \
            and state["_sender_pipe"] is pipe:
        state["_sender_pipe"], state["_pipe_inherited"] = None, True
    return state


def _setstate(future: Any, state: dict) -> None:
    if state.pop("_pipe_inherited", False):
        # a child forked after its parent's note: the note (and the pipe) came with the fork
        state["_sender_pipe"] = _inherited[state["_origin_pid"]]
    _hivemind["setstate"](future, state)


def install() -> None:
    """Replace ``MPFuture``'s pickling with ``_getstate`` / ``_setstate``; a second call changes nothing."""
    if _hivemind:
        return
    from hivemind.utils.mpfuture import MPFuture

    _hivemind.update(getstate=MPFuture.__getstate__, setstate=MPFuture.__setstate__)
    MPFuture.__getstate__, MPFuture.__setstate__ = _getstate, _setstate


def before_fork() -> None:
    """Note this process's result pipe, for the children it is about to fork (call it just before one starts)."""
    from hivemind.utils.mpfuture import MPFuture

    install()
    MPFuture._maybe_initialize_mpfuture_backend()  # the pipe exists from here on, and the children inherit it
    _inherited[os.getpid()] = MPFuture._global_sender_pipe


def to_child(connection: Any) -> None:
    """Mark ``connection`` (a hivemind process's ``_outer_pipe``, its parent's end) as going to a child forked after
    ``before_fork``: the futures this process made go on it without their pipe."""
    send = connection.send

    def send_to_child(message: Any) -> None:
        _sending.to_child = True
        try:
            send(message)
        finally:
            _sending.to_child = False

    connection.send = send_to_child
