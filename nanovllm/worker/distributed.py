"""TensorParallelExecutor: one worker process per rank, driven over pipes.

Every rank, rank 0 included, runs in a spawned worker that holds a LocalExecutor
(model shard, KV cache, and on rank 0 the sampler), so this process keeps no
torch.distributed group of its own and several TP engines can live in one
process and on one host. Invariants and the order things happen in:

- Rendezvous: this process hosts a TCPStore on a port the kernel picks (port 0),
  so there is no fixed port and no window between choosing a port and binding
  it. Workers join it as clients, then build the process group (gloo on CPU,
  NCCL on GPU with worker i on cuda:i) and one warm-up all-reduce, so NCCL's
  communicator exists before any CUDA graph is captured.
- Every call goes to every rank and waits for every rank's reply (the
  acknowledgement); rank 0's reply carries the result. Ranks run the same
  collectives in the same order, so they must all get the same work.
- Async scheduling splits a step into two messages: ``launch`` (no reply; the
  worker queues the step and reads on) and ``result`` (by ticket, replied like
  a call). Rank 0 samples and broadcasts the tokens to the other ranks on the
  device, where every rank's next step fills its placeholder rows from them.
- Any failure (a worker's exception, a worker that died, Ctrl-C while waiting)
  shuts every worker down before the error reaches the caller: after one rank
  fails the others may be stuck in a collective, so the group cannot go on.
- Workers leave when told (close), when their pipe reports the parent gone
  (EOF), or when a watchdog thread sees a new parent pid (the parent was
  killed while the worker was inside a collective).

Workers are started with 'spawn': a script that builds a TP engine at import
time needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import signal
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import EngineConfig
from nanovllm.core.model_input import ModelInput
from nanovllm.core.model_output import ModelOutput
from nanovllm.engine.lifeline import watch_parent

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_RENDEZVOUS_TIMEOUT = timedelta(minutes=5)
_CLOSE_TIMEOUT_S = 10.0


class TensorParallelExecutor:
    """The LocalExecutor interface over ``config.tensor_parallel_size`` worker processes."""

    def __init__(self, config: EngineConfig, load_format: str = "auto"):
        self.world_size = config.tensor_parallel_size
        self._error: str | None = None
        self._num_launched = 0  # async scheduling: the ticket of the last launched step
        ctx = mp.get_context("spawn")
        self._store = dist.TCPStore(
            _HOST, 0, self.world_size, is_master=True, timeout=_RENDEZVOUS_TIMEOUT, wait_for_workers=False
        )
        self.processes: list = []
        self._conns: list = []
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self._conns, self._store)
        try:
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    name=f"nanovllm-tp{rank}",
                    daemon=True,
                    args=(rank, self._store.port, os.getpid(), config, load_format, child_end),
                )
                proc.start()
                child_end.close()
                self.processes.append(proc)
                self._conns.append(parent_end)
            self._gather("init")
        except BaseException:
            self._abort("start-up failed")
            raise
        logger.info(
            "tensor parallel: %d workers (pids %s), rendezvous on port %d",
            self.world_size,
            [p.pid for p in self.processes],
            self._store.port,
        )

    # ------------------------------------------------------ executor interface
    def profile_num_blocks(self) -> int:
        """Every rank must hold the same number of KV blocks: the smallest budget wins."""
        return min(self._call("profile_num_blocks"))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def execute(self, mi: ModelInput) -> ModelOutput:
        return self._call("execute", mi)[0]

    def launch(self, mi: ModelInput) -> TensorParallelStepHandle:
        """Async scheduling: send the step to every rank and return at once (no reply is awaited).
        Each worker queues it and goes on reading its pipe, so step N+1's inputs reach it while
        step N may still run; the sampled tokens stay on the devices (rank 0 samples and
        broadcasts them, ``ModelRunner.launch``). ``result()`` fetches rank 0's output later."""
        self._check_open("launch")
        self._check_alive("launch")
        self._num_launched += 1
        try:
            self._post("launch", self._num_launched, mi)
        except BaseException as e:  # e.g. Ctrl-C halfway through a message: the pipes are unusable
            self._abort(f"launch() failed: {type(e).__name__}")
            raise
        return TensorParallelStepHandle(self, self._num_launched)

    def _result(self, ticket: int) -> ModelOutput:
        return self._call("result", ticket)[0]

    def close(self) -> None:
        """Stop every worker (idempotent; also run at interpreter exit)."""
        self._finalizer()

    # -------------------------------------------------------------------- RPC
    def _call(self, method: str, *args) -> list:
        """Run ``method`` on every rank; each rank's return value, in rank order."""
        self._check_open(method)
        try:
            self._post(method, *args)
            return self._gather(method)
        except BaseException as e:
            self._abort(f"{method}() failed: {type(e).__name__}")
            raise

    def _check_open(self, method: str) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(f"TensorParallelExecutor is closed{self._error or ''}; cannot run {method}()")

    def _post(self, method: str, *args) -> None:
        """Send one message to every rank; a dead rank is reported by the next ``_gather``."""
        message = pickle.dumps((method, args))
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:
                pass  # that worker is dead: _gather reports it

    def _check_alive(self, method: str) -> None:
        """Before a message that gets no reply: a rank that died or sent an error (a failed
        launch) is reported now, not after more work has been queued behind it."""
        ready = wait(self._conns + [p.sentinel for p in self.processes], timeout=0)
        if ready:
            try:
                self._gather(method)  # raises: any reply now is an error, any sentinel a death
                raise RuntimeError(f"tensor-parallel workers sent an unexpected reply before {method}()")
            except BaseException as e:
                self._abort(f"{method}() failed: {type(e).__name__}")
                raise

    def _gather(self, method: str) -> list:
        """One reply per rank. A worker's error or death raises RuntimeError at once."""
        replies: dict[int, object] = {}
        while len(replies) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in replies]
            ready = set(wait([self._conns[r] for r in pending] + [self.processes[r].sentinel for r in pending]))
            errors, deaths = [], []
            for r in pending:
                if self._conns[r] in ready:
                    try:
                        status, value = self._conns[r].recv()
                    except (EOFError, OSError):  # closed or reset: the worker is gone
                        deaths.append(r)
                        continue
                    if status == "ok":
                        replies[r] = value
                    else:
                        errors.append(f"{self._who(r)} raised in {method}():\n{value}")
                elif self.processes[r].sentinel in ready:
                    deaths.append(r)
            # a dead rank is the cause; its peers' errors (lost connections) are the effect
            failures = [self._death(r, method) for r in deaths] + errors
            if failures:
                raise RuntimeError("\n".join(failures))
        return [replies[r] for r in range(self.world_size)]

    def _who(self, rank: int) -> str:
        return f"tensor-parallel worker rank {rank} (pid {self.processes[rank].pid})"

    def _death(self, rank: int, method: str) -> str:
        proc = self.processes[rank]
        proc.join(1.0)
        code = proc.exitcode
        how = (
            f"was killed by signal {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        return f"{self._who(rank)} {how} during {method}()"

    def _abort(self, why: str) -> None:
        """Kill every worker now (the group is unusable) and release the rendezvous."""
        self._error = f" ({why})"
        for proc in self.processes:
            if proc.is_alive():
                proc.kill()  # workers ignore SIGTERM
        self._finalizer()


class TensorParallelStepHandle:
    """A step launched on every rank; ``result()`` asks the workers for it once (rank 0's output).
    Tickets let a worker match the request to its queued step: a handle never asked for (an
    interrupted engine) is completed and dropped by the worker when a later one is."""

    def __init__(self, executor: TensorParallelExecutor, ticket: int):
        self._executor, self._ticket = executor, ticket
        self._result: ModelOutput | None = None

    def result(self) -> ModelOutput:
        if self._result is None:
            self._result = self._executor._result(self._ticket)
        return self._result


def _shutdown(processes: list, conns: list, store) -> None:
    """Ask live workers to leave, wait a little, then terminate and kill the rest."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("close", ())))
        except OSError:
            pass
    deadline = time.monotonic() + _CLOSE_TIMEOUT_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            logger.warning(
                "tensor-parallel worker pid %d did not exit in %.0f s; killing it", proc.pid, _CLOSE_TIMEOUT_S
            )
            proc.kill()  # workers ignore SIGTERM
            proc.join()
    for conn in conns:
        conn.close()
    # the store (the rendezvous) is released when the finalizer drops its arguments


# ------------------------------------------------------------------ worker side
def _worker_main(rank: int, port: int, parent_pid: int, config: EngineConfig, load_format: str, conn) -> None:
    # Ctrl-C and SIGTERM are the parent's to handle (engine/core_process.py says why)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(parent_pid)  # leave if the parent dies while this worker is stuck (e.g. in a collective)
    try:
        executor = _init_worker(rank, port, config, load_format)
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        return
    _send(conn, ("ok", None))
    _serve(executor, conn)


def _init_worker(rank: int, port: int, config: EngineConfig, load_format: str):
    from nanovllm.worker.local_executor import LocalExecutor

    world = config.tensor_parallel_size
    if config.device == "cuda":
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // world))  # ranks share the cores
        device, backend = torch.device("cpu"), "gloo"
    store = dist.TCPStore(_HOST, port, world, is_master=False, timeout=_RENDEZVOUS_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    dist.all_reduce(torch.zeros(1, device=device))  # NCCL: create the communicator before graphs
    return LocalExecutor(config, load_format)


def _serve(executor, conn) -> None:
    """Answer calls until told to close; after an error the worker leaves (the group is broken).

    ``launch`` (async scheduling) queues a step and sends no reply, so the worker goes straight
    back to its pipe for the next message; ``result`` waits for a queued step (by ticket) and
    replies with its output. Steps run in the order they arrive on every rank."""
    launched: collections.deque = collections.deque()  # (ticket, StepHandle), oldest first
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the parent is gone
            method, args = "close", ()
        if method == "close":
            launched.clear()
            executor.close()
            dist.destroy_process_group()
            return
        try:
            if method == "launch":
                ticket, mi = args
                launched.append((ticket, executor.launch(mi)))
                continue
            if method == "result":
                result = _take_result(launched, args[0])
            else:
                result = getattr(executor, method)(*args)
        except BaseException:
            # a launch's error is read with a later message's replies: say where it came from
            where = f"(in launch() of step {args[0]})\n" if method == "launch" else ""
            _send(conn, ("error", where + traceback.format_exc()))
            return
        _send(conn, ("ok", result))


def _take_result(launched: collections.deque, ticket: int) -> ModelOutput:
    """The output of the queued step ``ticket``; older steps nobody asked for are completed and
    dropped (their results were abandoned: an interrupted engine)."""
    while launched:
        queued, handle = launched.popleft()
        output = handle.result()
        if queued == ticket:
            return output
    raise RuntimeError(f"result() of step {ticket}, which was never launched on this rank")


def _send(conn, message) -> None:
    try:
        conn.send(message)
    except OSError:
        pass  # the parent is gone; the worker is leaving anyway
