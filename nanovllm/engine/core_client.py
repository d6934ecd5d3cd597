"""The front end's handle on an engine-core process: start it, wait until its model is loaded,
send it commands without blocking the caller, stop it.

    client = EngineCoreClient(model, engine_args)   # returns once the core is ready
    client.send(("add", token, items))               # queued; a sender thread writes the pipe
    client.conn                                      # read the core's messages from it
    client.shutdown()

With ``front_ends=N`` the core also gets N more pipes, one per front-end process of a server
(``entrypoints/openai/api_server_pool.py``): ``client.front_end_conns`` holds their other ends, to
hand to those processes (``AttachedCoreClient``); the client's own pipe is then the control pipe,
used only to stop the core.

Commands go through a sender thread, so the event loop never blocks on a full pipe while the
core is busy sending outputs (which it could not, the event loop being blocked: a deadlock).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import threading
import weakref
from multiprocessing.connection import Connection

from nanovllm.engine.core_process import run_engine_core, write_pipe

logger = logging.getLogger(__name__)
_STOP_TIMEOUT_S = 30.0


class EngineCoreError(RuntimeError):
    """The engine-core process died or could not start."""


class _CoreHandle:
    """What a handle on a ready core holds (its config, vocabulary size, first stats) and how
    commands leave: pickled by the caller, written by a sender thread."""

    conn: Connection
    _outbox: queue.SimpleQueue

    def _take_ready(self, info: dict) -> None:
        self.config = info["config"]
        self.vocab_size: int = info["vocab_size"]
        self.stats: dict = info["stats"]

    def _start_sender(self) -> threading.Thread:
        sender = threading.Thread(target=write_pipe, args=(self.conn, self._outbox), name="nanovllm-core-sender")
        sender.daemon = True
        sender.start()
        return sender

    def send(self, message) -> None:
        """Queue a command. It is pickled here, so what cannot cross the pipe (a lambda given to
        ``call``) raises in the caller, not in the sender thread."""
        self._outbox.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


class EngineCoreClient(_CoreHandle):
    def __init__(self, model, engine_args: dict, start_timeout_s: float | None = None, front_ends: int = 0):
        ctx = mp.get_context("spawn")  # CUDA and threads: never fork
        pipes = [ctx.Pipe() for _ in range(1 + front_ends)]
        self.conn = pipes[0][0]
        self.front_end_conns = [ours for ours, _ in pipes[1:]]
        children = [theirs for _, theirs in pipes]
        # not a daemon: a core with tensor parallelism starts worker processes of its own
        self.process = ctx.Process(
            target=run_engine_core,
            name="nanovllm-engine-core",
            args=(children, os.getpid(), model, engine_args, logging.getLogger().getEffectiveLevel()),
        )
        self.process.start()
        for child in children:
            child.close()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: list[threading.Thread] = []  # started once the core is ready
        self._finalizer = weakref.finalize(self, _stop, self.process, self.conn, self._outbox, self._sender)
        try:
            info = self._wait_ready(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._take_ready(info)
        self._sender.append(self._start_sender())
        logger.info("engine core ready in process %d", self.process.pid)

    def _wait_ready(self, timeout_s: float | None) -> dict:
        waited = 0.0
        while not self.conn.poll(1.0):
            waited += 1.0
            if not self.process.is_alive():
                raise EngineCoreError(
                    f"the engine-core process exited with code {self.process.exitcode} while loading the model"
                )
            if timeout_s is not None and waited >= timeout_s:
                raise EngineCoreError(f"the engine core did not start within {timeout_s:.0f} s")
        try:
            kind, payload = self.conn.recv()
        except EOFError:
            raise EngineCoreError(
                f"the engine-core process closed its pipe while loading the model (exit code {self.process.exitcode})"
            ) from None
        if kind == "failed":
            raise payload  # the start-up error itself (a bad argument: ValueError naming it)
        if kind != "ready":
            raise EngineCoreError(f"the engine core sent {kind!r} before it was ready")
        return payload

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()

    def exit_description(self) -> str:
        return f"the engine-core process exited (code {self.process.exitcode})"

    def shutdown(self) -> None:
        """Ask the core to stop (it aborts what runs), wait for it, then make sure it is gone."""
        self._finalizer()


class AttachedCoreClient(_CoreHandle):
    """A front-end process's handle on an engine core another process started (with
    ``EngineCoreClient(front_ends=N)``): its own pipe to the core, whose "ready" message waits in
    it. ``shutdown`` closes the pipe (the core aborts this front end's requests); stopping the
    core is the starter's part."""

    def __init__(self, conn, core_pid: int, start_timeout_s: float = 60.0):
        self.conn = conn
        self.core_pid = core_pid
        if not conn.poll(start_timeout_s):
            raise EngineCoreError(f"the engine core (pid {core_pid}) sent nothing in {start_timeout_s:.0f} s")
        try:
            kind, info = conn.recv()
        except EOFError:
            raise EngineCoreError(f"the engine core (pid {core_pid}) closed this front end's pipe") from None
        if kind != "ready":
            raise EngineCoreError(f"the engine core sent {kind!r} before it was ready")
        self._take_ready(info)
        self._outbox = queue.SimpleQueue()
        self._sender = self._start_sender()
        self._closed = False

    @property
    def is_alive(self) -> bool:
        if self._closed:
            return False
        try:
            os.kill(self.core_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # pragma: no cover - a pid reused by another user's process
            return False
        return True

    def exit_description(self) -> str:
        return f"the engine-core process (pid {self.core_pid}) is gone"

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._outbox.put(None)  # after what is queued (an abort of what this front end ran)
        self._sender.join(5.0)
        self.conn.close()


def _stop(process, conn, outbox: queue.SimpleQueue, sender: list[threading.Thread]) -> None:
    stop = pickle.dumps(("stop",))
    if sender and sender[0].is_alive():  # after what is queued; the sender leaves then
        outbox.put(stop)
        outbox.put(None)
        sender[0].join(5.0)
    elif process.is_alive():
        try:
            conn.send_bytes(stop)
        except (OSError, ValueError):
            pass
    process.join(_STOP_TIMEOUT_S)
    if process.is_alive():  # it ignores SIGTERM (core_process.py): kill it
        logger.warning("the engine core (pid %d) did not stop in %.0f s; killing it", process.pid, _STOP_TIMEOUT_S)
        process.kill()
        process.join()
    conn.close()
