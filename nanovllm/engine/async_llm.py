"""AsyncLLM: the engine for asyncio callers (a server), vLLM's ``AsyncLLM`` interface.

    engine = AsyncLLM.from_engine_args(model, **engine_args)
    async for out in engine.generate(prompt, SamplingParams(...), request_id):
        print(out.outputs[0].text)          # CUMULATIVE by default; DELTA for pieces

One background thread owns the LLMEngine: it takes commands (add, abort, call) from a queue
between steps, runs ``step()`` while requests are unfinished, and hands each step's outputs to
the event loop, which routes them to the callers' queues (a caller that fell behind gets what
queued up merged into one output: ``RequestOutput.add``). So every concurrent caller is batched
into the same steps, the event loop never blocks on the model, and the engine (and its
tokenizer) is only ever touched by one thread. The front end has its own copy of the tokenizer
(``get_tokenizer()``: text prompts, chat templates, /tokenize), used on the event loop's thread.

A caller that stops listening (its task is cancelled, or it closes the generator) aborts its
request: the engine frees its KV blocks before the next step. If a step raises, the engine is
dead: every caller gets ``EngineDeadError`` and so does every later call.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable

from nanovllm.engine.engine import LLMEngine
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; this AsyncLLM serves no more requests."""


class PendingOutput:
    """A queue entry whose output is built when its caller reads it (``build()``), so a caller
    that falls behind costs one output for everything new, not one per step."""

    def build(self) -> RequestOutput:
        raise NotImplementedError


def _ready(item):
    return item.build() if isinstance(item, PendingOutput) else item


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the front end's: never used by the engine thread
        self.stats: dict = engine.stats()  # a snapshot, refreshed after each step
        self.output_observers: list[Callable[[RequestOutput], None]] = []  # see each output (metrics)
        self.errored: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_engine_args(cls, model: str | None = None, engine_process: bool = False, **engine_args) -> AsyncLLM:
        """``engine_process=True``: the engine runs in its own process, and this one keeps the
        text work (``engine/async_llm_process.py``); else it runs on a thread of this process."""
        if engine_process:
            from nanovllm.engine.async_llm_process import ProcessAsyncLLM

            return ProcessAsyncLLM.from_engine_args(model, **engine_args)
        return cls(LLMEngine.from_engine_args(model, **engine_args))

    # ------------------------------------------------------------ front end
    def get_tokenizer(self):
        return self.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.errored is None

    def _start(self) -> None:
        if self.errored is not None:
            raise EngineDeadError(f"the engine failed: {self.errored!r}") from self.errored
        loop = asyncio.get_running_loop()
        if self._thread is None:
            self._loop = loop
            self._thread = threading.Thread(target=self._run, name="nanovllm-engine", daemon=True)
            self._thread.start()
        elif loop is not self._loop:
            raise RuntimeError("an AsyncLLM serves one event loop; this call came from another")
        elif not self._thread.is_alive():
            raise EngineDeadError("the engine was shut down")

    def encode_prompt(self, prompt):
        """A text prompt becomes {'prompt', 'prompt_token_ids'} with the front end's tokenizer
        (so the engine thread only checks ids); other forms pass as they are."""
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
            prompt = prompt["prompt"]
        if isinstance(prompt, str) and prompt and self.tokenizer is not None:
            return {"prompt": prompt, "prompt_token_ids": self.tokenizer.encode(prompt)}
        return prompt

    async def generate(
        self, prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and yield its outputs as steps produce them; the last has finished=True.
        A bad request raises ValueError/TypeError (from the engine's validation) before any output."""
        self._start()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        outputs: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = outputs
        finished = False
        try:
            added = self._loop.create_future()  # type: ignore[union-attr]  # set by the first call
            self._submit_add(request_id, self.encode_prompt(prompt), sampling_params, added)
            await added
            delta = sampling_params is not None and sampling_params.output_kind == RequestOutputKind.DELTA
            while True:
                out = _ready(await outputs.get())
                # a caller that fell behind gets what queued up as one output (fewer, larger
                # stream chunks under load instead of a growing backlog)
                while not outputs.empty() and not isinstance(out, BaseException) and not out.finished:
                    later = _ready(outputs.get_nowait())
                    out = later if isinstance(later, BaseException) else out.add(later, delta)
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.is_running:
                self._submit_abort(request_id)

    async def abort(self, request_id: str) -> None:
        """End a request now (its generator gets the 'abort' output and ends)."""
        self._start()
        self._submit_abort(request_id)

    # what a back end implements: here, the engine thread's command queue
    def _submit_add(self, request_id: str, prompt, params, added: asyncio.Future) -> None:
        self._commands.put(("add", request_id, prompt, params, added))

    def _submit_abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len  # type: ignore[return-value]  # resolved by from_engine_args

    @property
    def model_dir(self) -> str:
        return self.engine.config.model_dir  # type: ignore[return-value]  # resolved by from_engine_args

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run ``fn(engine)`` on the engine thread between steps; return its result."""
        self._start()
        done = self._loop.create_future()  # type: ignore[union-attr]  # set by the first call
        self._commands.put(("call", fn, done))
        return await done

    async def check_health(self) -> None:
        if self.errored is not None:
            raise EngineDeadError(f"the engine failed: {self.errored!r}") from self.errored

    def shutdown(self) -> None:
        """Stop the step loop (unfinished requests are aborted) and close the engine."""
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._commands.put(("stop",))
            thread.join(timeout=60)
        self.engine.close()

    # -------------------------------------------------- event loop side of the handoff
    def _observe(self, out: RequestOutput) -> None:
        for observe in self.output_observers:
            try:
                observe(out)
            except Exception:  # noqa: BLE001 - an observer must not break serving
                logger.exception("output observer failed")

    def _deliver(self, outputs: list) -> None:
        for out in outputs:
            if isinstance(out, RequestOutput):
                self._observe(out)
                q = self._queues.get(out.request_id)
            else:  # (request_id, exception)
                q = self._queues.get(out[0])
                out = out[1]
            if q is not None:
                q.put_nowait(out)

    @staticmethod
    def _settle(fut: asyncio.Future, result=None, error: BaseException | None = None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)  # type: ignore[union-attr]  # set by the first call
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                if not self._handle_commands(block=idle):
                    break
                if not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
                self.stats = engine.stats()
                if outputs:
                    self._to_loop(self._deliver, outputs)
        except BaseException as e:  # noqa: BLE001 - the engine is dead: tell everyone
            logger.exception("the engine's step loop failed")
            self.errored = e
            self._to_loop(self._fail_all, e)
            self._fail_pending(e)
            return
        aborted = engine.abort_all()  # stop: no request keeps blocks, every caller hears it ended
        if aborted:
            self._to_loop(self._deliver, aborted)

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; False on 'stop'."""
        engine = self.engine
        handled = 0
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=None)
            except queue.Empty:
                if handled:
                    self.stats = engine.stats()
                return True
            block, handled = False, handled + 1
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, request_id, prompt, params, fut = cmd
                try:
                    engine.add_request(request_id, prompt, params)
                except Exception as e:  # noqa: BLE001 - a refused request is its caller's error, not the engine's
                    self._to_loop(self._settle, fut, None, e)
                else:
                    self._to_loop(self._settle, fut, None, None)
            elif kind == "abort":
                out = engine.abort_request(cmd[1])
                if out is not None:
                    self._to_loop(self._deliver, [out])
            elif kind == "call":
                _, fn, fut = cmd
                try:
                    result = fn(engine)
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    self._to_loop(self._settle, fut, None, e)
                else:
                    self._to_loop(self._settle, fut, result, None)

    def _fail_pending(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine failed: {error!r}")
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] in ("add", "call"):
                self._to_loop(self._settle, cmd[-1], None, dead)

    def _fail_all(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine failed: {error!r}")
        for q in self._queues.values():
            q.put_nowait(dead)
