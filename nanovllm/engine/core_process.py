"""The engine core in its own process: the step loop, with nothing else competing for its
interpreter (vLLM's EngineCore process).

The front end (``engine/async_llm_process.py``) talks to it over a duplex pipe:

    front end -> core   ("add", token, [(request_id, prompt, params), ...])   all or none
                        ("abort", [request_id, ...])
                        ("call", token, fn)          fn(engine) between steps; fn must pickle
                        ("stop",)
    core -> front end   ("ready", info)              once, after the model loaded
                        ("failed", error)            instead of "ready": start-up failed
                        ("added", token, sequences | error)
                        ("out", [SequenceUpdate, ...], stats)   after a step or an abort
                        ("called", token, result | error)
                        ("dead", error)              a step raised: the core exits

Commands are read between steps (without waiting while requests run), so a step never waits
for the front end. The core leaves when told to stop, when the pipe closes, or when its
parent process dies (``lifeline``).

With several front ends (``nanovllm serve --api-server-count N``) the core has one pipe per
front end beside the first, the control pipe of the process that started it. Each pipe gets
"ready", the answers to its own commands and the updates of the requests it added; each front
end also gets the stats at least every ``STATS_INTERVAL_S`` while the core is busy, and when it
goes idle. A front end whose pipe closes has its requests aborted; the core leaves when the
control pipe closes or any pipe says "stop".
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import wait

from nanovllm.cpu_threads import default_threads
from nanovllm.engine.engine import LLMEngine
from nanovllm.engine.lifeline import watch_parent

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.5  # the longest a front end with no updates goes without the core's stats


def picklable_error(e: BaseException) -> BaseException:
    """``e`` if it crosses the pipe as it is, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure: send a description instead
        return RuntimeError(f"{type(e).__name__}: {e}")


def run_engine_core(conns, parent_pid: int, model, engine_args: dict, log_level: int = logging.WARNING) -> None:
    """The core process's main (a ``spawn`` target); it logs at the front end's level.
    ``conns``: its pipes, the control pipe first."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    # Ctrl-C and SIGTERM are the front end's to handle: a signal to the whole process group (a
    # terminal, `timeout`) or cgroup (systemd) must not stop the core ahead of the front end, whose
    # open streams would then fail instead of finishing within its graceful shutdown. The core
    # leaves when its front end stops it, when the pipe closes, or when its parent is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(parent_pid)
    engine_args = with_front_end_core(engine_args, front_ends=max(1, len(conns) - 1))
    try:
        engine = LLMEngine.from_engine_args(model, **engine_args)
    except BaseException as e:  # noqa: BLE001 - the front end raises it
        logger.debug("engine core start-up failed:\n%s", traceback.format_exc())
        _send(conns[0], ("failed", picklable_error(e)))  # the other pipes read EOF
        return
    engine.emit_updates = True
    info = {"config": engine.config, "vocab_size": engine.vocab_size, "stats": engine.stats()}
    try:
        core = EngineCore(engine, conns)
        for outbox in core.outboxes:
            outbox.send(("ready", info))
        core.run()
    finally:
        engine.close()


def with_front_end_core(engine_args: dict, front_ends: int = 1) -> dict:
    """The engine args with a core left for each front end (HTTP, text) where there are four or
    more cores, unless the thread count was chosen (``threads``, ``$OMP_NUM_THREADS``). The model's
    OpenMP threads spin while they wait for each other, so one that shares its core with a busy
    front end stalls every parallel region of a CPU step (``cpu_threads.py``); vLLM's CPU back end
    reserves a core for its front end likewise. On two cores the reserved core costs more than the
    stalls: the CPU workload served 58.8 tok/s on one torch thread against 92.9 on two
    (BENCHMARKS.md, 2026-12-02)."""
    if engine_args.get("threads") is not None or os.environ.get("OMP_NUM_THREADS", "").strip():
        return engine_args
    cores = default_threads()
    if cores < 4:
        return engine_args
    threads = max(1, cores - front_ends)
    logger.info("engine core: %d torch threads (%d cores left for %d front ends)", threads, cores - threads, front_ends)
    return {**engine_args, "threads": threads}


def _send(conn, message) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass  # the front end is gone; the core is leaving anyway


class EngineCore:
    """The step loop over one or more front-end pipes (``conns[0]``: the control pipe)."""

    def __init__(self, engine: LLMEngine, conns):
        self.engine = engine
        self.conns = list(conns)
        self.outboxes = [CoreOutbox(c) for c in self.conns]
        self.live = set(range(len(self.conns)))  # the pipes still open
        self.owner: dict[str, int] = {}  # request id -> the pipe that added it (several pipes only)
        self.stats_sent = [0.0] * len(self.conns)  # when each pipe last got the stats
        self.timing = CoreTiming()

    def run(self) -> None:
        engine, timing = self.engine, self.timing
        was_busy = False
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not busy:
                    timing.end_period()
                    if was_busy and len(self.conns) > 1:
                        self._send_stats()  # idle now: every front end's gauges settle
                was_busy = busy
                if (not busy or self._commands_waiting()) and not self._handle_commands(block=not busy):
                    self._abort_all()  # stopped: each caller hears its request ended, as in-process
                    break
                if engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    updates = engine.step()
                    t1 = time.perf_counter()
                    self._send_updates(updates)
                    timing.add_step(t0, t1 - t0, time.perf_counter() - t1)
        except (EOFError, OSError, BrokenPipeError):
            logger.info("the front end closed the pipe; the engine core leaves")
        except BaseException as e:  # noqa: BLE001 - the engine is dead: say why, then leave
            logger.exception("the engine core's step loop failed")
            dead = ("dead", picklable_error(e))
            for i in self.live:
                self.outboxes[i].send(dead)
        finally:
            for outbox in self.outboxes:
                outbox.close()
            logger.info("engine core: %s", timing.summary())

    def _abort_all(self) -> None:
        updates = self.engine.abort_all()
        if updates:
            self._send_updates(updates)

    def _commands_waiting(self) -> bool:
        if len(self.conns) == 1:
            return self.conns[0].poll()
        return bool(wait([self.conns[i] for i in self.live], timeout=0))

    def _send_updates(self, updates: list) -> None:
        """Each update to the pipe that added its request; the stats with them."""
        if len(self.conns) == 1:
            if updates:
                self.outboxes[0].send(("out", updates, self.engine.stats()))
            return
        routed: dict[int, list] = {}
        for u in updates:
            request_id = u[0]  # SequenceUpdate.request_id; u[4]: its finish_reason
            i = self.owner.pop(request_id, None) if u[4] is not None else self.owner.get(request_id)
            if i is not None:
                routed.setdefault(i, []).append(u)
        now = time.perf_counter()
        stale = [i for i in self.live if i and i not in routed and now - self.stats_sent[i] >= STATS_INTERVAL_S]
        if not routed and not stale:
            return
        stats = self.engine.stats()
        for i, mine in routed.items():
            if i in self.live:
                self.outboxes[i].send(("out", mine, stats))
                self.stats_sent[i] = now
        for i in stale:
            self.outboxes[i].send(("out", [], stats))
            self.stats_sent[i] = now

    def _send_stats(self) -> None:
        """An empty "out" with the stats to every live front end (not the control pipe)."""
        stats, now = self.engine.stats(), time.perf_counter()
        for i in self.live:
            if i:
                self.outboxes[i].send(("out", [], stats))
                self.stats_sent[i] = now

    def _handle_commands(self, block: bool) -> bool:
        """Apply the commands waiting (the first one waited for when ``block``); False on stop
        (or the control pipe closed: raises EOFError)."""
        if len(self.conns) == 1:
            return self._handle_pipe(0, block)
        t0 = time.perf_counter()
        ready = wait([self.conns[i] for i in self.live], timeout=None if block else 0)
        if block:
            self.timing.woke(t0)
        for conn in ready:
            i = self.conns.index(conn)
            try:
                if not self._handle_pipe(i, block=False):
                    return False
            except (EOFError, OSError):
                if i == 0:
                    raise
                self._front_end_gone(i)
        return True

    def _handle_pipe(self, i: int, block: bool) -> bool:
        engine, conn, outbox = self.engine, self.conns[i], self.outboxes[i]
        while block or conn.poll():
            t0 = time.perf_counter()
            cmd = conn.recv()
            if block:
                self.timing.woke(t0)
            block = False
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "add":
                outbox.send(("added", cmd[1], self._add(cmd[2], i)))
            elif kind == "abort":
                updates = [u for u in (engine.abort_request(r) for r in cmd[1]) if u is not None]
                for request_id in cmd[1]:
                    self.owner.pop(request_id, None)
                outbox.send(("out", updates, engine.stats()))
            elif kind == "call":
                try:
                    result = cmd[2](engine)
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    result = picklable_error(e)
                outbox.send(("called", cmd[1], result))
            else:
                raise ValueError(f"unknown engine-core command {kind!r}")
        return True

    def _front_end_gone(self, i: int) -> None:
        """Front end ``i`` closed its pipe: abort its requests (their blocks free at once)."""
        self.live.discard(i)
        self.outboxes[i].close(timeout_s=0.0)
        mine = [r for r, owner in self.owner.items() if owner == i]
        for request_id in mine:
            self.engine.abort_request(request_id)
            del self.owner[request_id]
        log = logger.warning if mine else logger.info
        log("front end %d closed its pipe; %d of its requests aborted", i, len(mine))

    def _add(self, items, i: int = 0):
        """Validate every sequence, then queue them all: a request's children go in together or
        not at all. Returns the sequences (the front end's mirrors) or the error."""
        engine = self.engine
        try:
            ids = [request_id for request_id, _, _ in items]
            if len(set(ids)) != len(ids):
                raise ValueError(f"request ids {ids} repeat")
            seqs = [engine.make_sequence(request_id, prompt, params) for request_id, prompt, params in items]
        except Exception as e:  # noqa: BLE001 - a refused request is its caller's error
            return picklable_error(e)
        for seq in seqs:
            engine.add_sequence(seq)
            if len(self.conns) > 1:
                self.owner[seq.request_id] = i
        return seqs


def write_pipe(conn, outbox: queue.SimpleQueue) -> None:
    """A writer thread's loop, for both ends of the pipe: send each pickled message from
    ``outbox`` until None; stop quietly when the other end is gone (its reader reports it)."""
    while (data := outbox.get()) is not None:
        try:
            conn.send_bytes(data)
        except (OSError, ValueError):
            return


class CoreOutbox:
    """The core's messages, pickled on the step loop's thread and written to the pipe by a
    thread of their own: a front end busy with HTTP work never stalls a step (a blocking send
    on a full pipe would). Order is kept; ``close`` sends what is queued, then stops."""

    def __init__(self, conn):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=write_pipe, args=(conn, self.queue), name="nanovllm-core-outbox")
        self.thread.daemon = True
        self.thread.start()

    def send(self, message) -> None:
        self.queue.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def close(self, timeout_s: float = 10.0) -> None:
        self.queue.put(None)
        self.thread.join(timeout_s)


class CoreTiming:
    """Where the core's time goes: steps, the work after each (stats, pickling outputs), idle
    time waiting for a request, and its busy periods (from the request that woke it to when
    nothing is left; the longest is a benchmark's run). Logged when the core stops."""

    def __init__(self):
        self.steps = 0
        self.step_s = self.after_step_s = self.idle_s = 0.0
        self.woke_at: float | None = None  # when the command that ended the last idle wait came
        self.period: list[float] | None = None  # open period: [start, steps, step seconds, first step delay]
        # [duration, steps, step seconds, first step delay, start and end in Unix time (so a client
        # on the same host can place the period in its own timeline)]
        self.longest: list[float] | None = None

    def woke(self, wait_started: float) -> None:
        self.woke_at = time.perf_counter()
        self.idle_s += self.woke_at - wait_started

    def add_step(self, started: float, step_s: float, after_s: float) -> None:
        self.steps += 1
        self.step_s += step_s
        self.after_step_s += after_s
        if self.period is None:
            start = self.woke_at if self.woke_at is not None else started
            self.period = [start, 0, 0.0, started - start]
        self.period[1] += 1
        self.period[2] += step_s

    def end_period(self) -> None:
        if self.period is None:
            return
        start, steps, step_s, delay = self.period
        duration = time.perf_counter() - start
        if self.longest is None or duration > self.longest[0]:
            wall_end = time.time()
            self.longest = [duration, steps, step_s, delay, wall_end - duration, wall_end]
        self.period = None

    def summary(self) -> str:
        self.end_period()
        per_step_us = 1e6 * self.after_step_s / max(self.steps, 1)
        text = (
            f"{self.steps} steps in {self.step_s:.2f} s, {self.after_step_s:.3f} s sending outputs "
            f"({per_step_us:.0f} us/step), {self.idle_s:.1f} s idle"
        )
        if self.longest is not None:
            duration, steps, step_s, delay, wall_start, wall_end = self.longest
            text += (
                f"; longest busy period {duration:.2f} s: {steps:.0f} steps taking {step_s:.2f} s, "
                f"the first {1e3 * delay:.1f} ms after the request that started it; "
                f"busy from {wall_start:.3f} to {wall_end:.3f} (Unix time)"
            )
        return text
