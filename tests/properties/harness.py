"""The real engine loop under test: ``LLMEngine`` over a ``FakeExecutor``, plus what the properties read.

``EngineHarness`` adds requests, steps, aborts and drains the real ``LLMEngine`` (sync or
async scheduling), checks every ``SchedulerOutput`` as the engine's scheduler returns it
(``check_step``) and the scheduler's invariants after every step, and keeps records built from
the engine's own tracer: ``history`` (one ``StepRecord`` per step), ``computed`` (each
request's computed position ranges, in order), ``admissions`` (prefix-cache hit tokens at each
admission), ``outputs`` and ``finish_reasons``.

Usage::

    h = EngineHarness(num_blocks=6, block_size=2, max_num_batched_tokens=4, async_scheduling=True)
    h.add_request([0, 1, 2], max_tokens=8)          # ValueError where the engine refuses it
    outputs = h.run()                               # request_id -> generated token ids
    assert outputs["r0"] == h.expected_output("r0")  # f(all previous tokens), no paging

Pure Python: importing this module imports no torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from nanovllm.core.scheduler import Scheduler, SchedulerOutput
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.engine.trace import StepEvent
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from tests.properties.fake_runner import make_engine, reference_generate


class SchedulerStuck(AssertionError):
    """The scheduler returned an empty step (or ran past its step bound) with requests pending."""


@dataclass
class StepRecord:
    index: int
    scheduled: list[tuple[str, int, int]]  # (request_id, first position, num_new_tokens)
    admitted: list[tuple[str, int]]  # (request_id, prefix-cache hit tokens)
    preempted: list[str]
    finished: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.scheduled)


def check_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Step-level scheduler properties (catalogue item 6), checked right after ``schedule()``."""
    sched = scheduler
    bs = sched.block_manager.block_size
    assert out.num_tokens <= sched.max_num_batched_tokens, (
        f"token budget exceeded: {out.num_tokens} > max_num_batched_tokens={sched.max_num_batched_tokens}"
    )
    assert len(out.seqs) <= sched.max_num_seqs, f"{len(out.seqs)} sequences > max_num_seqs={sched.max_num_seqs}"
    assert len(sched.running) <= sched.max_num_seqs, f"{len(sched.running)} running > max_num_seqs"
    assert len({id(s) for s in out.seqs}) == len(out.seqs), "a sequence scheduled twice in one step"
    running_ids = {id(s) for s in sched.running}
    waiting_ids = {id(s) for s in sched.waiting}
    assert not running_ids & waiting_ids, "a request both waiting and running"
    for seq, n in zip(out.seqs, out.num_new_tokens):
        assert n >= 1, f"{seq} scheduled with {n} new tokens (nothing to produce logits from)"
        assert seq.num_computed_tokens + n <= seq.num_tokens, f"{seq} scheduled past its tokens (+{n})"
        assert seq.status is SequenceStatus.RUNNING and id(seq) in running_ids, f"scheduled {seq} is not running"
        assert len(seq.block_table) * bs >= seq.num_computed_tokens + n, f"{seq} has no slots for +{n} tokens"
    scheduled = {id(s) for s in out.seqs}
    for seq in out.preempted:
        assert not seq.block_table, f"preempted {seq} still holds blocks"
        assert seq.num_computed_tokens == 0 and seq.status is SequenceStatus.WAITING, f"preempted {seq} not reset"
        assert id(seq) not in scheduled, f"preempted {seq} is scheduled in the same step"
    if out.preempted:
        assert not out.admitted, "a step that preempts admitted a request"
    if not sched.enable_chunked_prefill:
        for seq in out.admitted:
            n = out.num_new_tokens[out.seqs.index(seq)]
            remaining = seq.num_tokens - seq.num_computed_tokens
            # whole, unless it could never be taken whole (a recompute longer than the budget)
            assert n == remaining or remaining > sched.max_num_batched_tokens, (
                f"chunked prefill is off but {seq} was admitted with a chunk of {n} of {remaining}"
            )


class EngineHarness:
    """The real LLMEngine over a FakeExecutor, and the records its properties read.

    ``check=True``: ``check_step`` on every SchedulerOutput and ``Scheduler.check_invariants``
    after every step (mid-pipeline under async scheduling: nothing is drained for it).
    ``strict``: the FakeExecutor's strict row and K/V checks. ``hash_fn``: the block manager's
    block hash (a weak one makes collisions).
    """

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 1024,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        async_scheduling: bool = False,
        hash_fn=None,
        vocab_size: int = 11,
        strict: bool = True,
        check: bool = True,
    ):
        self.engine, self.executor = make_engine(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            async_scheduling=async_scheduling,
            vocab_size=vocab_size,
            strict=strict,
            trace=self._record,
        )
        self.engine.tracer.max_events = 1  # the records below are what is kept
        self.scheduler = self.engine.scheduler
        self.block_manager = self.engine.block_manager
        if hash_fn is not None:
            self.block_manager.hash_fn = hash_fn
        self.scheduler.schedule = self._schedule  # this scheduler's steps are checked as they are made
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.async_scheduling = async_scheduling
        self.check = check
        self.requests: dict[str, Sequence] = {}  # every request added, finished or not
        self.outputs: dict[str, list[int]] = {}  # finished (not aborted) requests
        self.finish_reasons: dict[str, str] = {}
        self.history: list[StepRecord] = []
        # per request: computed position ranges in order; ("preempted", -1) marks a preemption
        self.computed: dict[str, list[tuple[int, int] | tuple[str, int]]] = {}
        self.admissions: dict[str, list[int]] = {}  # per request: prefix-cache hit tokens at each admission
        self._expected: dict[str, list[int]] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------- records
    def _schedule(self) -> SchedulerOutput:
        out = Scheduler.schedule(self.scheduler)  # looked up per call: mutants patch the class
        if self.check:
            check_step(self.scheduler, out)
        if out.is_empty and self.scheduler.has_unfinished():
            raise SchedulerStuck(
                f"scheduler produced an empty step with requests pending: "
                f"waiting={list(self.scheduler.waiting)} running={self.scheduler.running}"
            )
        return out

    def _record(self, event: StepEvent) -> None:
        """The engine's tracer callback: one StepEvent per completed step, in step order."""
        record = StepRecord(
            len(self.history),
            [(s.request_id, s.num_computed_before, s.num_new_tokens) for s in event.seqs],
            [(s.request_id, s.num_cached_tokens) for s in event.seqs if s.num_cached_tokens is not None],
            list(event.preempted),
            [rid for rid, _ in event.finished],
        )
        self.history.append(record)
        for rid in record.preempted:
            self.computed[rid].append(("preempted", -1))
        for rid, cached in record.admitted:
            self.admissions[rid].append(cached)
        for rid, start, n in record.scheduled:
            self.computed[rid].append((start, start + n))

    def _collect(self, outputs: list[RequestOutput]) -> list[str]:
        """The finished requests among a step's outputs (a CUMULATIVE request -- the engine's
        default output_kind -- also reports every step it gets a token, unfinished)."""
        finished = [out for out in outputs if out.finished]
        for out in finished:
            completion = out.outputs[0]
            self.outputs[out.request_id] = list(completion.token_ids)
            self.finish_reasons[out.request_id] = completion.finish_reason
        return [out.request_id for out in finished]

    # --------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: list[int],
        max_tokens: int = 8,
        *,
        request_id: str | None = None,
        min_tokens: int = 0,
        stop_token_ids=None,
    ) -> Sequence:
        """Add a request to the engine; raises ValueError where the engine refuses it."""
        request_id = f"r{next(self._ids)}" if request_id is None else request_id
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_token_ids
        )
        self.engine.add_request(request_id, list(prompt), params)
        seq = self.engine.requests[request_id]
        self.executor.add_sequence(seq.seq_id, seq.prompt_token_ids, request_id)
        self.requests[request_id] = seq
        self.computed[request_id] = []
        self.admissions[request_id] = []
        return seq

    def abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        if out is not None:
            assert out.outputs[0].finish_reason == "abort"
            self.finish_reasons[request_id] = "abort"

    def expected_output(self, request_id: str) -> list[int]:
        """The reference output of a request: f(all previous tokens), computed without paging."""
        if request_id not in self._expected:
            seq = self.requests[request_id]
            p = seq.params
            self._expected[request_id] = reference_generate(
                seq.prompt_token_ids,
                p.max_tokens,
                self.vocab_size,
                max_model_len=self.max_model_len,
                stop_token_ids=seq.stop_token_ids,
                min_tokens=p.min_tokens,
            )
        return self._expected[request_id]

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step_bound(self) -> int:
        """Steps within which every unfinished request must finish.

        The first running sequence is never preempted (it fits alone) and computes at least one
        token per step, so each request finishes within prompt + max_tokens steps once it is
        first (async scheduling may compute one token past a stop: the + 1); an empty running
        list admits.
        """
        total = 0
        for seq in self.requests.values():
            if seq.finish_reason is None:
                total += seq.num_prompt_tokens + (seq.params.max_tokens or self.max_model_len) + 1
        return total + 1

    # ------------------------------------------------------------------- step
    def step(self) -> list[str]:
        """One engine step; the ids of the requests that finished in it (or in a drain before it)."""
        finished = self._collect(self.engine.step())
        if self.check:
            self.scheduler.check_invariants()
        return finished

    def drain(self) -> None:
        """Complete the step in flight (async scheduling); its outputs come with the next step()."""
        self.engine.drain()
        if self.check:
            self.scheduler.check_invariants()

    def run(self, max_steps: int | None = None) -> dict[str, list[int]]:
        """Step until nothing is unfinished; raises SchedulerStuck past the step bound."""
        bound = self.step_bound() if max_steps is None else max_steps
        for _ in range(bound):
            if not self.has_unfinished:
                break
            self.step()
        if self.has_unfinished:
            raise SchedulerStuck(
                f"requests still unfinished after {bound} steps: "
                f"waiting={list(self.scheduler.waiting)} running={self.scheduler.running}"
            )
        return self.outputs
