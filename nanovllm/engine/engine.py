"""LLMEngine: the step loop between the torch-free core and an executor.

``add_request`` validates a request completely and queues it; ``step`` schedules one step
(core), builds its ModelInput and StepPlan (core), runs it on the executor (worker), then
applies the output: tokens appended, logprobs recorded, full blocks published, stop rules
checked, finished requests freed. Build one with ``LLMEngine.from_engine_args(model, **args)``;
the constructor takes the parts (config, executor, tokenizer), so tests can run this very loop
over a fake executor.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.config import EngineConfig
from nanovllm.core.bad_words import bad_words_token_ids
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.model_input import StepPlan, build_model_input
from nanovllm.core.model_output import ModelOutput, ReadyOutput
from nanovllm.core.scheduler import Scheduler
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.core.stop import check_stop, reaches_length_limit
from nanovllm.engine.core_output import CoreStream, make_update
from nanovllm.engine.executor import Executor, StepHandle
from nanovllm.engine.output_processor import (
    StreamState,
    make_request_output,
    make_stream_output,
    record_logprobs,
    record_prompt_logprobs,
)
from nanovllm.engine.parallel_sampling import ParentRequest, report_through_parent
from nanovllm.engine.step_timing import OFF, PhaseTimer, _Off
from nanovllm.engine.trace import SeqStep, StepEvent, Tracer
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step queued on the device."""

    plan: StepPlan
    handle: StepHandle  # .result() -> ModelOutput
    event: StepEvent | None
    counted: bool = False  # update_after_step done already (async scheduling)
    held: list[tuple[Sequence, list[int]]] | None = None  # tracing, async: the running requests' blocks at _advance
    timer: PhaseTimer | _Off = OFF  # phase times for step_profiler (engine/step_timing.py)


def eos_token_ids(model_dir: str, hf_config, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json (a list is honoured), config.json and the tokenizer."""
    ids: list[int] = []

    def add(value):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(v for v in value if isinstance(v, int))

    from nanovllm.loader.hf_config import read_generation_eos

    add(read_generation_eos(model_dir))  # no transformers import (start-up time)
    add(getattr(hf_config, "eos_token_id", None))
    if not ids and tokenizer is not None:
        add(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def load_tokenizer(config: EngineConfig):
    if config.skip_tokenizer_init:
        return None
    from nanovllm.tokenizer import load_tokenizer as load  # transformers only where needed

    source = config.tokenizer or config.model_dir
    try:
        return load(source)
    except (OSError, ValueError, TypeError) as e:
        if config.tokenizer is not None:
            raise ValueError(f"cannot load tokenizer {config.tokenizer!r}: {e}") from None
        logger.warning("no tokenizer in %s (%s): token-id prompts only, empty output text", source, e)
        return None


class LLMEngine:
    """``LLMEngine(config, executor, tokenizer=None, eos_token_ids=(), trace=False)``.

    ``config`` is a resolved EngineConfig (``EngineConfig.resolve`` has filled the
    device-dependent defaults); ``executor`` runs the steps (see ``engine/executor.py``).
    Most callers want ``LLMEngine.from_engine_args(model, **engine_args)`` or ``LLM``.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        tokenizer=None,
        eos_token_ids: tuple[int, ...] = (),
        trace: bool | Callable = False,
    ):
        # executor defaults to None only so that LLMEngine("path") gets this message, not Python's
        if not isinstance(config, EngineConfig) or executor is None:
            got = type(config).__name__ if not isinstance(config, EngineConfig) else "no executor"
            raise TypeError(
                f"LLMEngine(config, executor, ...) takes an EngineConfig and an executor, got "
                f"{got}; to load a model use "
                f"LLMEngine.from_engine_args(model, **engine_args) or LLM(model, **engine_args)"
            )
        if config.hf_config is None or config.block_size is None:
            raise ValueError(
                "LLMEngine needs a resolved EngineConfig (call config.resolve(hf_config, "
                "model_dir) first, or use LLMEngine.from_engine_args)"
            )
        self.config = config
        self.executor: Executor | None = executor
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = config.hf_config.vocab_size
        num_blocks = config.num_kvcache_blocks or executor.profile_num_blocks()
        executor.allocate_kv_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            config.enable_chunked_prefill,
        )
        self.tracer = Tracer(enabled=bool(trace), callback=trace if callable(trace) else None)
        # None, or called once per completed step with {phase: seconds} (engine/step_timing.py)
        self.step_profiler: Callable[[dict[str, float]], None] | None = None
        self.requests: dict[str, Sequence] = {}
        self._streams: dict[str, StreamState | CoreStream] = {}  # requests whose output_kind is not FINAL_ONLY
        # core mode (the engine in its own process, engine/core_process.py): report SequenceUpdates
        # (token ids) instead of RequestOutputs; set before the first request
        self.emit_updates = False
        self.parents: dict[str, ParentRequest] = {}  # n > 1: until every child has finished
        self._seq_ids = itertools.count()
        self._finished_seq_ids: list[int] = []
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_errors = 0
        self._inflight: _Launched | None = None  # async scheduling: the step on the device
        self._buffered: list[RequestOutput] = []  # finished by a drain, returned by the next step()
        self._num_launched = 0
        self.num_pipelined_steps = 0
        logger.info(
            "engine ready: %s, %s, %d KV blocks of %d tokens",
            config.device,
            config.dtype,
            num_blocks,
            config.block_size,
        )

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineConfig | str | None = None,
        *,
        load_format: str = "auto",
        trace: bool | Callable = False,
        **kwargs,
    ) -> LLMEngine:
        """Load a model and build its engine: ``from_engine_args("path/to/model", dtype="float32")``
        or ``from_engine_args(EngineConfig(...))`` (vLLM's spelling). ``None`` = the default model."""
        if isinstance(engine_args, EngineConfig):
            if kwargs:
                raise TypeError(
                    f"from_engine_args(EngineConfig, ...) takes no engine arguments besides "
                    f"the config, got {sorted(kwargs)}"
                )
            config = engine_args
        else:
            config = EngineConfig.from_kwargs(engine_args, **kwargs)
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
        from nanovllm.engine.executor import make_executor
        from nanovllm.loader.model_loader import load_hf_config, resolve_model_dir
        from nanovllm.models.registry import get_model_class

        model_dir = resolve_model_dir(config.model)
        hf_config = load_hf_config(model_dir)
        config.resolve(hf_config, model_dir)
        # unsupported architectures and config fields fail before anything is started
        get_model_class(hf_config).check_config(hf_config)
        tokenizer = load_tokenizer(config)
        eos = eos_token_ids(model_dir, hf_config, tokenizer)
        executor = make_executor(config, load_format)
        try:
            return cls(config, executor, tokenizer, eos, trace=trace)
        except BaseException:
            executor.close()
            raise

    # --------------------------------------------------------------- requests
    def _check_open(self) -> None:
        if self.executor is None:
            raise RuntimeError("this engine is closed (close() was called); create a new LLM / LLMEngine")

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: a string, a list of token ids, or a dict."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty, got ''")
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer, and this model has none: "
                    "pass token ids ({'prompt_token_ids': [...]})"
                )
            return prompt, self._check_ids(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_ids(self, ids) -> list[int]:
        ids = list(ids)
        if not ids:
            raise ValueError("prompt must not be empty, got 0 token ids")
        # the common case in C-level passes (the GPU workload's 256 prompts: 11 -> 7 ms); any doubt takes
        # the loop below, which names the first bad id
        if set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < self.vocab_size:
            return ids
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"prompt_token_ids[{i}] must be an int, got {t!r}")
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids[{i}]={t} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _check_request_id(self, request_id) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests or request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def _check_params(self, params) -> SamplingParams:
        """The request's SamplingParams, checked against this model (vocabulary, tokenizer)."""
        params = params if params is not None else SamplingParams()
        if isinstance(params, dict):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got a dict ({params!r}); write SamplingParams(**{params!r})"
            )
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        for name in ("stop", "bad_words"):
            if getattr(params, name) and self.tokenizer is None:
                raise ValueError(f"{name}={getattr(params, name)!r} needs a tokenizer, and this model has none")
        for name, k in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name}={k} exceeds the vocabulary size {self.vocab_size}")
        for name, ids in (
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("stop_token_ids", params.stop_token_ids or ()),  # never sampled: the request would not stop
        ):
            outside = [t for t in ids if t >= self.vocab_size]
            if outside:
                raise ValueError(f"{name} holds token id(s) {outside} outside the vocabulary [0, {self.vocab_size})")
        return params

    def _bad_words(self, params: SamplingParams) -> list[list[int]] | None:
        if not params.bad_words:
            return None
        words = bad_words_token_ids(self.tokenizer, params.bad_words)
        outside = sorted({t for w in words for t in w if not 0 <= t < self.vocab_size})
        if outside:
            raise ValueError(
                f"bad_words={params.bad_words!r} tokenize to id(s) {outside} outside the "
                f"vocabulary [0, {self.vocab_size})"
            )
        return words

    def make_sequence(
        self, request_id: str, prompt, params: SamplingParams | None, parent: ParentRequest | None = None
    ) -> Sequence:
        """Validate one sequence completely (nothing is queued): a request with n == 1, or one
        child of an n > 1 request (``make_sequences``)."""
        self._check_open()
        self._check_request_id(request_id)
        params = self._check_params(params)
        if params.n != 1:
            raise ValueError(
                f"make_sequence builds one sequence; a request with n={params.n} needs make_sequences or add_request"
            )
        text, ids = self.tokenize_prompt(prompt)
        seq = Sequence(
            next(self._seq_ids),
            request_id,
            ids,
            params,
            prompt=text,
            eos_token_ids=self.eos_token_ids,
            bad_words_token_ids=self._bad_words(params),
            parent=parent,
        )
        self.scheduler.check_admissible(seq)
        return seq

    def make_sequences(self, request_id: str, prompt, params: SamplingParams | None) -> list[Sequence]:
        """Validate one request completely (nothing is queued): its one sequence, or with
        n > 1 its n child sequences (``engine/parallel_sampling.py``)."""
        self._check_open()
        params = self._check_params(params)
        if params.n == 1:
            return [self.make_sequence(request_id, prompt, params)]
        self._check_request_id(request_id)
        parent = ParentRequest(request_id, params)
        return [
            self.make_sequence(cid, prompt, parent.child_params(i), parent) for i, cid in enumerate(parent.child_ids)
        ]

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        for seq in self.make_sequences(request_id, prompt, params):
            self.add_sequence(seq)

    def add_sequence(self, seq: Sequence) -> None:
        if self.emit_updates and seq.parent is not None:
            raise ValueError("an engine core takes n = 1 requests: its front end fans out n > 1 (ParentRequest)")
        self.scheduler.add(seq)
        self.requests[seq.request_id] = seq
        if seq.params.output_kind is not RequestOutputKind.FINAL_ONLY:
            self._streams[seq.request_id] = CoreStream() if self.emit_updates else StreamState(seq, self.tokenizer)
        if seq.parent is not None:
            self.parents.setdefault(seq.parent.request_id, seq.parent)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End an unfinished request now (an n > 1 request: all its unfinished children). With a
        step in flight that computes it, its blocks are freed at once (the device finishes that
        step before any later step reuses them) and the step's token for it is discarded when
        the step completes. Returns its output (finish_reason "abort"), or None if unknown."""
        parent = self.parents.get(request_id)
        if parent is not None:
            outs = self._outputs(
                [self._abort(self.requests.pop(cid)) for cid in parent.child_ids if cid in self.requests]
            )
            if not outs or request_id in self.parents:
                raise RuntimeError(f"abort of {request_id!r} left its parent request behind")
            return parent.combine(outs)
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        outs = self._outputs([self._abort(seq)])
        if seq.parent is not None:  # a child aborted alone: its parent's output, if complete, comes next step
            self._buffered += outs
            return make_request_output(seq, self.tokenizer)
        return outs[0]

    def abort_all(self) -> list[RequestOutput]:
        """Abort every unfinished request (stopping): one output per caller, an n > 1 request's
        through its parent, and whatever a drain had finished and not yet returned."""
        top = list(self.parents) + [r for r, seq in self.requests.items() if seq.parent is None]
        outs = [o for o in (self.abort_request(r) for r in top) if o is not None]
        buffered, self._buffered = self._buffered, []
        return buffered + outs

    def _abort(self, seq: Sequence) -> Sequence:
        self.scheduler.finish(seq)
        seq.drop_placeholder()  # a step that never completed (interrupted) leaves one behind
        seq.finish_reason = "abort"
        seq.metrics.finished_time = time.time()
        self._finished_seq_ids.append(seq.seq_id)
        return seq

    def _output(self, seq: Sequence) -> RequestOutput:
        """The output a request reports now (a finished one leaves the streams)."""
        if seq.finish_reason is not None:
            state = self._streams.pop(seq.request_id, None)
        else:
            state = self._streams[seq.request_id]
        if isinstance(state, CoreStream) or (state is None and self.emit_updates):
            return make_update(seq, state)  # type: ignore[return-value]  # core mode: SequenceUpdates
        if state is None:
            return make_request_output(seq, self.tokenizer)
        return make_stream_output(seq, self.tokenizer, state)

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The outputs the sequences report now; a child of an n > 1 request reports through
        its parent (``ParentRequest.add_child_output``: FINAL_ONLY once all have finished)."""
        outs = []
        for seq in seqs:
            out = report_through_parent(self._output(seq), seq.parent, self.parents)
            if out is not None:
                outs.append(out)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._buffered)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's meaning). Only when no request holds blocks:
        returns False, changing nothing, while requests are running."""
        self.drain()
        return self.block_manager.reset_prefix_cache()

    # ------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return an output for every request that finished in it or,
        unless its ``output_kind`` is FINAL_ONLY, got new tokens in it (``finished=False``).

        With async scheduling, the step after this one is scheduled and queued on the device
        before this one's tokens are read back (see ``_advance``), so the host's bookkeeping
        overlaps the device's work; it is completed by the next call.
        """
        self._check_open()
        outputs, self._buffered = self._buffered, []
        launched, self._inflight = self._inflight, None
        if launched is None:
            launched = self._launch_next()
            if launched is None:
                return outputs
        # penalties and multi-token bad words read the tokens so far: never a placeholder there
        if self.config.async_scheduling and not launched.plan.needs_token_history:
            self._advance(launched)
            self._inflight = self._launch_next()
        return outputs + self._complete(launched)

    def _launch_next(self) -> _Launched | None:
        timer = PhaseTimer() if self.step_profiler is not None else OFF
        sched = self.scheduler.schedule()
        timer.lap("schedule")
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler produced an empty step with requests pending")
            return None
        now = time.time()
        for seq in sched.admitted:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        mi, plan = build_model_input(sched, self.config.block_size, self._finished_seq_ids)
        self._finished_seq_ids = []
        timer.lap("build_model_input")
        event = self._trace_begin(plan) if self.tracer.enabled else None
        assert self.executor is not None
        if self.config.async_scheduling:
            handle = self.executor.launch(mi)
        else:
            handle = ReadyOutput(self.executor.execute(mi))
        timer.lap("launch" if self.config.async_scheduling else "execute")
        self._num_launched += 1
        return _Launched(plan, handle, event, timer=timer)

    def _advance(self, launched: _Launched) -> None:
        """Async scheduling: account for a step in flight as if its tokens were known.

        Its K/V counts as computed (the device computes it before anything queued later);
        every sequence that samples gets a placeholder, which the next step reads from the
        device; a sequence that finishes on length whatever it draws leaves the scheduler
        now, so the next step does not compute it.
        """
        self.scheduler.update_after_step(launched.plan.sched)
        launched.counted = True
        self.num_pipelined_steps += 1
        for row, seq in enumerate(launched.plan.samplers):
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.add_placeholder(row)
            if reaches_length_limit(seq, self.config.max_model_len):
                self.scheduler.finish(seq)
        if launched.event is not None:  # who holds which blocks after this step, before the next one allocates
            launched.held = [(seq, list(seq.block_table)) for seq in self.scheduler.running]

    def _complete(self, launched: _Launched) -> list[RequestOutput]:
        timer = launched.timer
        timer.restart()
        result = launched.handle.result()
        timer.lap("wait")
        if not launched.counted:
            self.scheduler.update_after_step(launched.plan.sched)
            timer.lap("update_after_step")
        event = launched.event
        reported = self._postprocess(launched.plan, result)
        timer.lap("postprocess")
        self.num_steps += 1
        if self.step_profiler is not None and timer.phases is not None:
            self.step_profiler(timer.phases)
        if event is not None:
            finished = [s for s in reported if s.finish_reason is not None]
            event.finished = [(s.request_id, s.finish_reason) for s in finished]
            if launched.counted:  # the blocks held at _advance by requests this step did not finish
                gone = {id(s) for s in finished}
                used = {b for seq, table in launched.held if id(seq) not in gone for b in table}
                event.num_free_blocks = self.block_manager.num_blocks - len(used)
            else:
                event.num_free_blocks = self.block_manager.num_free_blocks
            assert 0 <= event.num_free_blocks <= self.block_manager.num_blocks, event.num_free_blocks
            self.tracer.record(event)
        return self._outputs(reported)

    def drain(self) -> None:
        """Complete the step in flight (async scheduling); its outputs go to the next step()."""
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self._buffered += self._complete(launched)

    def _postprocess(self, plan: StepPlan, result: ModelOutput) -> list[Sequence]:
        """Apply a step's output; return the sequences to report, in sample-row order: the
        finished ones and the streaming ones that got a token."""
        for (seq, first), rows in zip(plan.prompt_logprob_jobs, result.prompt_logprobs):
            skip = seq.num_prompt_logprobs_recorded - first  # > 0 only if recorded meanwhile
            assert skip >= 0, f"{seq}: prompt logprobs from position {first} would leave a gap"
            rows, first = rows[skip:], first + skip
            record_prompt_logprobs(seq, list(zip(seq.token_ids[first : first + len(rows)], rows)))
        sampling = {id(seq) for seq in plan.samplers}
        for seq, num_new, start in zip(plan.sched.seqs, plan.sched.num_new_tokens, plan.starts):
            # every chunk but a decode (the newest token of a request past its prompt) is prompt work:
            # prefill chunks and recomputes after a preemption, including a recompute's last chunk
            if not (num_new == 1 and id(seq) in sampling and start >= seq.num_prompt_tokens):
                self.num_prompt_tokens += num_new

        reported: list[Sequence] = []
        streams = self._streams
        sampled = result.sampled
        now = time.time()
        for row, seq in enumerate(plan.samplers):
            seq.drop_placeholder()  # async: the placeholder gets its token below
            if seq.finish_reason is not None:
                continue  # it finished (or was aborted) while this step was in flight: discard
            assert sampled is not None
            if row in sampled.nonfinite_rows:
                self.num_errors += 1
                logger.error(
                    "request %r: the model produced non-finite logits (NaN or inf) at output "
                    "token %d; the request is ended with finish_reason='error'",
                    seq.request_id,
                    seq.num_output_tokens,
                )
                seq.finish_reason = "error"
                seq.stop_reason = "non-finite logits"
            else:
                token = sampled.token_ids[row]
                seq.append_token(token)
                metrics = seq.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
                self.num_generation_tokens += 1
                record_logprobs(seq, token, sampled.logprobs[row])
                check_stop(seq, self.tokenizer, self.config.max_model_len)
            if seq.finish_reason is not None:
                if seq.status is not SequenceStatus.FINISHED:
                    self.scheduler.finish(seq)
                self.requests.pop(seq.request_id, None)
                self._finished_seq_ids.append(seq.seq_id)
                seq.metrics.finished_time = now
                reported.append(seq)
            elif seq.status is SequenceStatus.FINISHED:
                raise RuntimeError(f"{seq} left the scheduler on length but did not finish")
            elif streams and seq.request_id in streams:
                reported.append(seq)
        return reported

    def _trace_begin(self, plan: StepPlan) -> StepEvent:
        sched = plan.sched
        admitted = {id(s) for s in sched.admitted}
        seqs = []
        for seq, n, c in zip(sched.seqs, sched.num_new_tokens, plan.starts):
            decode = n == 1 and c + 1 == seq.num_tokens and c >= seq.num_prompt_tokens
            seqs.append(
                SeqStep(
                    seq.request_id,
                    "decode" if decode else "prefill",
                    n,
                    c,
                    seq.num_tokens,
                    list(seq.block_table),
                    c if id(seq) in admitted else None,
                )
            )
        phases = {s.phase for s in seqs}
        kind = phases.pop() if len(phases) == 1 else "mixed"
        return StepEvent(
            self._num_launched,
            kind,
            seqs,
            [s.request_id for s in sched.preempted],
            num_blocks=self.block_manager.num_blocks,
        )

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict:
        s = self.scheduler
        return {
            "steps": self.num_steps,
            "preemptions": s.num_preemptions,
            "prefix_cache_hit_tokens": s.num_cache_hit_tokens,
            "prefix_cache_query_tokens": s.num_cache_query_tokens,
            "prompt_tokens_computed": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "num_kv_blocks": self.block_manager.num_blocks,
            "num_free_kv_blocks": self.block_manager.num_free_blocks,
            "evictions": self.block_manager.num_evictions,
            "running": len(s.running),
            "waiting": len(s.waiting),
            "errors": self.num_errors,
            "pipelined_steps": self.num_pipelined_steps,
            # the ranks the executor runs (a check of tensor parallelism sees the knob took effect)
            "tensor_parallel_size": getattr(self.executor, "world_size", 1),
        }

    def check_invariants(self) -> None:
        self.drain()
        self.scheduler.check_invariants()
        for pid, parent in self.parents.items():
            live = sum(cid in self.requests for cid in parent.child_ids)
            if live != parent.num_unfinished or live == 0:
                raise RuntimeError(f"parent request {pid!r}: {live} live children, {parent.num_unfinished} unfinished")

    def close(self) -> None:
        self._inflight = None
        executor, self.executor = getattr(self, "executor", None), None
        if executor is not None:
            executor.close()
