"""AsyncLLM with the engine core in its own process (vLLM's multiprocess front end).

    engine = AsyncLLM.from_engine_args(model, engine_process=True, **engine_args)

The core process runs the step loop and sends, per step, the new token ids of every request
(``engine/core_output.py``); this process keeps a mirror ``Sequence`` of each request and does
the text work: incremental detokenization, stop-string hold-back, logprob dicts, n > 1 fan-out
(``ParentRequest``), building the ``RequestOutput``s. So the server's event loop and the step
loop no longer share one interpreter lock, and the outputs are the in-process engine's (same
functions, same mirror state).

The core's messages are read by a reader thread of this process (blocking reads of whole
messages), which hands them to the event loop; commands leave through the client's sender
thread. The event loop never touches the pipe: uvloop's ``add_reader`` (libuv's ``uv_poll``)
would switch the pipe to non-blocking, and then a read of a message that has not fully arrived,
or the sender's write to a full pipe, fails with EAGAIN. If the core process dies, every caller
gets ``EngineDeadError`` and so does every later call.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import pickle
import threading
from collections.abc import Callable

from nanovllm.core.sequence import Sequence
from nanovllm.engine.async_llm import AsyncLLM, EngineDeadError, PendingOutput
from nanovllm.engine.core_client import AttachedCoreClient, EngineCoreClient
from nanovllm.engine.core_output import apply_update
from nanovllm.engine.engine import load_tokenizer
from nanovllm.engine.output_processor import StreamState, make_request_output, make_stream_output
from nanovllm.engine.parallel_sampling import ParentRequest, report_through_parent
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
_PIPE_CLOSED = object()  # the reader thread's last message: (_PIPE_CLOSED, the error)


class ProcessAsyncLLM(AsyncLLM):
    def __init__(self, client: EngineCoreClient | AttachedCoreClient):  # noqa: D107 - the base's state, less the engine
        self.client = client
        self.engine = None  # type: ignore[assignment]  # lives in the core process
        self.config = client.config
        self.tokenizer = load_tokenizer(client.config)
        self.stats = client.stats
        self.output_observers: list[Callable[[RequestOutput], None]] = []
        self.errored: BaseException | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # unfinished sequences: (mirror, stream state, its queue entry) for a streaming one
        self._mirrors: dict[str, tuple[Sequence, StreamState | None, _StreamReady | None]] = {}
        self._parents: dict[str, ParentRequest] = {}  # n > 1 requests with an unfinished child
        self._adding: dict[str, ParentRequest] = {}  # n > 1 requests whose "add" is not answered yet
        # command token -> (the future of its answer, the ParentRequest an "add" fans out)
        self._pending: dict[int, tuple[asyncio.Future, ParentRequest | None]] = {}
        self._tokens = itertools.count()
        self._closed = False
        self._inbox: collections.deque = collections.deque()  # the reader thread's messages, in order
        self._drain_scheduled = False  # a _drain call is on the loop (set and cleared under _inbox_lock)
        self._inbox_lock = threading.Lock()

    @classmethod
    def from_engine_args(cls, model: str | None = None, engine_process: bool = True, **engine_args) -> AsyncLLM:
        return cls(EngineCoreClient(model, engine_args))

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def model_dir(self) -> str:
        return self.config.model_dir

    @property
    def vocab_size(self) -> int:
        return self.client.vocab_size

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._closed and self.errored is None and self.client.is_alive

    def _start(self) -> None:
        if self.errored is not None:
            raise EngineDeadError(f"the engine failed: {self.errored!r}") from self.errored
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            reader = threading.Thread(target=self._read_core, args=(loop,), name="nanovllm-core-reader", daemon=True)
            reader.start()
        elif loop is not self._loop:
            raise RuntimeError("an AsyncLLM serves one event loop; this call came from another")

    # ------------------------------------------------------------ commands
    def _submit_add(self, request_id: str, prompt, params, added: asyncio.Future) -> None:
        prompt = self._tokenized(prompt)
        parent = None
        if isinstance(params, SamplingParams) and isinstance(params.n, int) and params.n > 1:
            parent = ParentRequest(request_id, params)  # the core sees its n children
            items = [(cid, prompt, parent.child_params(i)) for i, cid in enumerate(parent.child_ids)]
        else:
            items = [(request_id, prompt, params)]
        token = next(self._tokens)
        self.client.send(("add", token, items))
        self._pending[token] = (added, parent)
        if parent is not None:
            self._adding[request_id] = parent

    def _tokenized(self, prompt):
        """A text prompt with its token ids, so the core does not spend a step's time on the
        tokenizer (vLLM's front end tokenizes likewise); anything else (token ids, a prompt the
        core will refuse) goes as it is, and the core checks it."""
        text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
        if not isinstance(text, str) or not text or self.tokenizer is None:
            return prompt
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text)}

    def _submit_abort(self, request_id: str) -> None:
        """Abort a request; an n > 1 one by its children's ids (the core never knew the parent's),
        every child if its "add" is still unanswered (the core applies the add first)."""
        parent = self._parents.get(request_id)
        if request_id in self._adding:
            ids = list(self._adding[request_id].child_ids)
        else:
            ids = [request_id] if parent is None else [c for c in parent.child_ids if c in self._mirrors]
        if ids:
            self.client.send(("abort", ids))

    async def call(self, fn: Callable):
        """Run ``fn(engine)`` in the core process between steps; ``fn`` must pickle (a
        module-level function): a closure or lambda raises TypeError here."""
        self._start()
        try:
            pickle.dumps(fn)
        except Exception as e:  # noqa: BLE001 - pickle raises several kinds
            raise TypeError(
                f"with the engine in its own process, call() needs a function that pickles "
                f"(a module-level def), got {fn!r}: {e}"
            ) from None
        done = self._loop.create_future()  # type: ignore[union-attr]  # set by _start
        token = next(self._tokens)
        self._pending[token] = (done, None)
        self.client.send(("call", token, fn))
        return await done

    async def check_health(self) -> None:
        if self.errored is None and not self._closed and not self.client.is_alive:
            self._core_died(EngineDeadError(self.client.exit_description()))
        await super().check_health()

    def shutdown(self) -> None:
        self._closed = True
        self.client.shutdown()  # the core closes its end: the reader thread reads EOF and leaves

    # ------------------------------------------------------------ core -> here
    def _read_core(self, loop: asyncio.AbstractEventLoop) -> None:
        """The reader thread: each whole message from the core goes into ``_inbox``, and one
        ``_drain`` call at a time is put on the loop; EOF or a broken pipe ends the thread (and,
        unless this side is shutting down, fails every caller)."""
        conn = self.client.conn
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError) as e:
                msg = (_PIPE_CLOSED, e)
            except Exception as e:  # noqa: BLE001 - the thread must end in a message, or callers wait forever
                # this side closed the connection while recv waited on it (a front end of several:
                # multiprocessing's handle is None then, a TypeError), or a message did not unpickle
                if not self._closed:
                    logger.exception("reading the engine core's messages failed")
                msg = (_PIPE_CLOSED, e)
            with self._inbox_lock:
                self._inbox.append(msg)
                schedule = not self._drain_scheduled
                self._drain_scheduled = True
            if schedule:
                try:
                    loop.call_soon_threadsafe(self._drain)
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    return
            if msg[0] is _PIPE_CLOSED:
                return

    def _drain(self) -> None:
        """On the loop: dispatch what the reader thread has queued, in order."""
        with self._inbox_lock:
            msgs = list(self._inbox)
            self._inbox.clear()
            self._drain_scheduled = False
        for msg in msgs:
            if msg[0] is _PIPE_CLOSED:
                if not self._closed:
                    e = msg[1]
                    gone = isinstance(e, (EOFError, OSError))
                    what = (
                        "the engine-core process is gone" if gone else "a message from the engine core was unreadable"
                    )
                    self._core_died(EngineDeadError(f"{what} ({type(e).__name__})"))
                return
            self._dispatch(msg)

    def _dispatch(self, msg) -> None:
        kind = msg[0]
        if kind == "out":
            self.stats = msg[2]
            self._deliver(self._outputs(msg[1]))
        elif kind == "added":
            fut, parent = self._pending.pop(msg[1])
            if parent is not None:
                self._adding.pop(parent.request_id, None)
            result = msg[2]
            if isinstance(result, BaseException):
                self._settle(fut, None, result)
                return
            if parent is not None:
                self._parents[parent.request_id] = parent
            for seq in result:
                seq.parent = parent
                if seq.params.output_kind is RequestOutputKind.FINAL_ONLY:
                    self._mirrors[seq.request_id] = (seq, None, None)
                else:
                    state = StreamState(seq, self.tokenizer)
                    ready = _StreamReady(self, seq, state) if parent is None else None  # n > 1: built eagerly
                    self._mirrors[seq.request_id] = (seq, state, ready)
            self._settle(fut)
        elif kind == "called":
            fut, _ = self._pending.pop(msg[1])
            result = msg[2]
            if isinstance(result, BaseException):
                self._settle(fut, None, result)
            else:
                self._settle(fut, result)
        elif kind == "dead":
            self._core_died(msg[1])
        else:
            raise RuntimeError(f"unknown message from the engine core: {kind!r}")

    def _outputs(self, updates) -> list[RequestOutput]:
        """The RequestOutputs the core's updates make (``LLMEngine._outputs``, here). A streaming
        n = 1 request (what the server sends) gets a ``_StreamReady`` in its queue instead, once
        until its caller reads it: the output is built then, from the mirror, with everything
        new since the caller's last one."""
        outs = []
        tokenizer = self.tokenizer
        for update in updates:
            mirror = self._mirrors.get(update[0])  # SequenceUpdate.request_id
            if mirror is None:
                continue  # an abort raced a finish: the request already ended
            seq, state, ready = mirror
            apply_update(seq, update)
            if seq.finish_reason is not None:
                del self._mirrors[seq.request_id]
            q = self._queues.get(seq.request_id)
            if ready is not None and q is not None:
                if not ready.queued:
                    ready.queued = True
                    q.put_nowait(ready)
                continue
            # built now: FINAL_ONLY, an n > 1 child, or a request nobody listens to any more
            # (its abort still reaches the observers: the server's metrics count it)
            built = make_request_output(seq, tokenizer) if state is None else make_stream_output(seq, tokenizer, state)
            out = report_through_parent(built, seq.parent, self._parents)
            if out is not None:
                outs.append(out)
        return outs

    def _core_died(self, error: BaseException) -> None:
        if self.errored is not None:
            return
        logger.error("the engine core failed: %r", error)
        self.errored = error
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(f"the engine failed: {error!r}")
        for fut, _ in self._pending.values():
            self._settle(fut, None, dead)
        self._pending.clear()
        self._fail_all(error)


class _StreamReady(PendingOutput):
    """A streaming request's one queue entry, in its queue (``queued``) while it has news its
    caller has not read: its output is built when the caller reads it. One per request, not per
    request id: a caller that leaves with news unread does not mute a later request of that id."""

    __slots__ = ("engine", "seq", "state", "queued")

    def __init__(self, engine: ProcessAsyncLLM, seq: Sequence, state: StreamState):
        self.engine, self.seq, self.state = engine, seq, state
        self.queued = False

    def build(self) -> RequestOutput:
        self.queued = False
        out = make_stream_output(self.seq, self.engine.tokenizer, self.state)
        self.engine._observe(out)
        return out
