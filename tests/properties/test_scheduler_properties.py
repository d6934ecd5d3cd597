"""Property-based conformance checks of the Scheduler, through the real engine loop (catalogue items 6-8).

Every check drives the real ``LLMEngine`` (``add_request`` / ``step`` / ``abort_request`` /
``drain`` / ``check_invariants``) over a fake executor (``tests/properties/fake_runner.py``),
with async scheduling off and on (drawn by hypothesis).

6. a hypothesis state machine over the engine (add / step / abort / drain / run to the end):
   token budget and max_num_seqs every step, no request both waiting and
   running, preempted requests hold no blocks, everything finishes within a
   step bound, nothing leaks after draining; chunked prefill on and off, prefix
   caching on and off, async scheduling on and off, tiny KV caches that force preemption;
7. preemption exactness: outputs under a starved KV cache equal those under an
   ample one (and the reference f(all previous tokens));
8. chunk coverage: for budgets {1, 7, bs-1, bs, bs+1, inf} every position is
   computed exactly once, in order.

Each property has a negative control: a mutant from ``tests.mutants.core``
under which the property check fails (and the async pipeline one: placeholders
reading the wrong sample row).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from nanovllm.core.sequence import Sequence
from tests.mutants.core import MUTANTS
from tests.properties.fake_runner import INF_BUDGET
from tests.properties.harness import EngineHarness


def negative_settings() -> settings:
    """For negative controls: stop at the first failure, no shrinking, no example database."""
    return settings(
        settings.default,
        max_examples=max(settings.default.max_examples, 200),
        phases=[Phase.explicit, Phase.generate],
        database=None,
        derandomize=True,
        report_multiple_bugs=False,
        print_blob=False,
    )


STEMS = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [1, 1, 1, 1, 1, 1, 1, 1], [2, 0, 2, 0, 2, 0]]
prompt_st = st.tuples(st.sampled_from(STEMS), st.integers(0, 12), st.lists(st.integers(0, 2), max_size=4)).map(
    lambda t: (t[0][: t[1]] + t[2]) or [0]
)


@st.composite
def config_st(draw, **fixed) -> dict:
    """Mostly tiny caches: one request of max_model_len always fits, two often do not (preemption).

    ``fixed`` narrows a field to a strategy (negative controls aim at a corner this way).
    """

    def pick(name, default):
        return draw(fixed.get(name, default))

    bs = pick("block_size", st.integers(1, 4))
    max_model_len = pick("max_model_len", st.sampled_from([8, 12, 16, 24]))
    one_request = -(-(max_model_len - 1) // bs)
    return {
        "block_size": bs,
        "num_blocks": pick(
            "num_blocks", st.one_of(st.integers(one_request, one_request + 3), st.integers(1, 2 * one_request))
        ),
        "max_num_seqs": pick("max_num_seqs", st.integers(1, 4)),
        "max_num_batched_tokens": pick(
            "max_num_batched_tokens", st.sampled_from([1, 2, 3, 4, 5, 7, 8, 12, 16, INF_BUDGET])
        ),
        "max_model_len": max_model_len,
        "enable_chunked_prefill": pick("enable_chunked_prefill", st.booleans()),
        "enable_prefix_caching": pick("enable_prefix_caching", st.booleans()),
        "async_scheduling": pick("async_scheduling", st.booleans()),
    }


def admissible(cfg: dict, prompt_len: int, max_tokens: int) -> bool:
    """The admission model: what the scheduler must accept (and refuse)."""
    if prompt_len >= cfg["max_model_len"]:
        return False
    if not cfg["enable_chunked_prefill"] and prompt_len > cfg["max_num_batched_tokens"]:
        return False
    final_len = min(prompt_len + max_tokens, cfg["max_model_len"])
    return -(-(final_len - 1) // cfg["block_size"]) <= cfg["num_blocks"]


def check_drained(eng: EngineHarness) -> None:
    """After draining: nothing waiting, running or in flight, every block free, outputs = reference."""
    sched, bm = eng.scheduler, eng.block_manager
    assert not sched.waiting and not sched.running, "requests left after draining"
    assert not eng.engine.has_unfinished_requests() and not eng.engine.requests, "the engine still holds requests"
    eng.engine.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks leaked"
    sched.check_invariants()
    bm.check_invariants([])
    if not bm.enable_prefix_caching:
        assert not bm.cached, "prefix caching is off but blocks were published"
    for rid, out in eng.outputs.items():
        assert out == eng.expected_output(rid), f"{rid}: output {out} != reference {eng.expected_output(rid)}"


def check_worker_state_released(eng: EngineHarness) -> None:
    """The executor keeps per-sequence state (the fake: each sequence's tokens and K/V chain; the
    CPU runner: a seeded request's torch.Generator) until a step's ``finished_seq_ids`` names the
    sequence. Every sequence that left the engine on any path (finished, aborted running or
    waiting) must be named in the next step: the executor may hold only live sequences and those
    the engine will name. An abort that never named its sequence kept its seeded generator on the
    worker for the process's life (hunt 3, B6)."""
    live = {seq.seq_id for seq in eng.engine.requests.values()}
    announced = set(eng.engine._finished_seq_ids)  # named in the next step's ModelInput
    for what, state in (("tokens", eng.executor.tokens), ("K/V chains", eng.executor._chains)):
        leaked = set(state) - live - announced
        assert not leaked, (
            f"per-sequence state ({what}) of seq_ids {sorted(leaked)} is held by the executor, but "
            "they left the engine without being named in finished_seq_ids"
        )


# ================================================= 6. scheduler state machine
class SchedulerMachine(RuleBasedStateMachine):
    """The real engine under random requests, steps, aborts and drains; a model of which requests are live."""

    requests = Bundle("requests")

    @initialize(cfg=config_st())
    def setup(self, cfg):
        self.cfg = cfg
        self.harness = EngineHarness(**cfg, vocab_size=3, strict=True, check=True)
        self.live: set[str] = set()
        self.finished: set[str] = set()
        self.aborted: set[str] = set()
        self.clean = True  # False while a rule or invariant is failing: teardown then skips the drain

    def _steps(self, n: int) -> None:
        for _ in range(n):
            if not self.harness.has_unfinished:
                break
            for rid in self.harness.step():
                assert rid in self.live, f"{rid} finished but was not live"
                self.live.discard(rid)
                self.finished.add(rid)

    def _run_to_end(self) -> None:
        h = self.harness
        bound = h.step_bound()
        steps_before = len(h.history)
        self._steps(bound)  # raises SchedulerStuck on an empty step with requests pending
        assert not h.has_unfinished, f"requests unfinished after {bound} steps (the bound)"
        assert len(h.history) - steps_before <= bound
        assert not self.live, f"{self.live} never finished"
        check_drained(h)

    @rule(target=requests, prompt=prompt_st, max_tokens=st.integers(1, 16))
    def add(self, prompt, max_tokens):
        self.clean = False
        ok = admissible(self.cfg, len(prompt), max_tokens)
        try:
            seq = self.harness.add_request(prompt, max_tokens)
        except ValueError as e:
            assert not ok, f"an admissible request was refused: {e}"
            self.clean = True
            return multiple()
        assert ok, f"an inadmissible request (prompt {len(prompt)}, max_tokens {max_tokens}) was accepted"
        self.live.add(seq.request_id)
        self.clean = True
        return seq.request_id

    @rule(target=requests, batch=st.lists(st.tuples(prompt_st, st.integers(1, 16)), min_size=2, max_size=5))
    def add_batch(self, batch):
        """Several requests at once: they compete for the cache (preemption)."""
        rids = []
        for prompt, max_tokens in batch:
            rid = self.add(prompt, max_tokens)
            if isinstance(rid, str):
                rids.append(rid)
        return multiple(*rids)

    @precondition(lambda self: self.harness.has_unfinished)
    @rule(n=st.integers(1, 6), drain=st.booleans())
    def step(self, n, drain):
        """n engine steps; then, with ``drain``, complete the step in flight (async scheduling: its
        outputs come with the next step) and run the engine's own check_invariants."""
        self.clean = False
        self._steps(n)
        if drain:
            self.harness.drain()
            self.harness.engine.check_invariants()
        self.clean = True

    @rule(rid=consumes(requests))
    def abort(self, rid):
        self.clean = False
        if rid in self.live:
            self.harness.abort(rid)
            seq = self.harness.requests[rid]
            if seq.finish_reason == "abort":
                self.live.discard(rid)
                self.aborted.add(rid)
            else:  # it had finished in a drain; its output comes with the next step
                assert seq.finish_reason is not None, f"abort_request left live {seq} running"
            assert not seq.block_table, f"aborted {seq} still holds blocks"
        self.clean = True

    @precondition(lambda self: self.harness.has_unfinished)
    @rule()
    def run_to_end(self):
        self.clean = False
        self._run_to_end()
        self.clean = True

    @invariant()
    def consistent(self):
        self.clean = False
        h = self.harness
        sched = h.scheduler
        sched.check_invariants()
        waiting = [s.request_id for s in sched.waiting]
        running = [s.request_id for s in sched.running]
        assert not set(waiting) & set(running), "a request both waiting and running"
        assert len(waiting) + len(running) == len(set(waiting) | set(running)), "a request queued twice"
        # finished in a drain: out of the scheduler, its output not returned by a step yet
        done = {rid for rid in self.live if h.requests[rid].finish_reason is not None}
        assert set(waiting) | set(running) == self.live - done, (
            f"scheduler holds {set(waiting) | set(running)}, the model expects {self.live - done}"
        )
        assert len(running) <= sched.max_num_seqs
        for seq in sched.waiting:
            assert not seq.block_table and seq.num_computed_tokens == 0, f"waiting {seq} holds blocks"
        for rid in self.finished:
            assert h.outputs[rid] == h.expected_output(rid), f"{rid}: output differs from the reference"
        check_worker_state_released(h)
        self.clean = True

    def teardown(self):
        if self.clean and hasattr(self, "harness"):
            self._run_to_end()
            sched = self.harness.scheduler
            mode = (
                f"chunked={sched.enable_chunked_prefill} prefix={self.harness.block_manager.enable_prefix_caching}"
                f" async={self.harness.async_scheduling}"
            )
            event(f"{mode}: {'preempted' if sched.num_preemptions else 'no preemption'}")
            event("cache hits" if sched.num_cache_hit_tokens else "no cache hits")
            if self.harness.async_scheduling:
                event("pipelined" if self.harness.engine.num_pipelined_steps else "not pipelined")


TestSchedulerMachine = SchedulerMachine.TestCase


def narrowed(**fixed) -> type[SchedulerMachine]:
    """The same machine, rules and invariants, with some config fields narrowed to a corner."""

    class Narrowed(SchedulerMachine):
        @initialize(cfg=config_st(**fixed))
        def setup(self, cfg):
            SchedulerMachine.setup(self, cfg)

    return Narrowed


# one request of max_model_len 8 fits in 7 blocks of 1 token; two running ones soon do not: preemption
TINY = {
    "max_num_seqs": st.integers(2, 4),
    "max_model_len": st.just(8),
    "block_size": st.just(1),
    "num_blocks": st.integers(7, 8),
}
# mutant -> the corner its negative control searches (the full space finds it too, in more examples)
SCHEDULER_NEGATIVE_CORNERS = {
    "free_no_decref": {},
    "budget_off_by_one": {},
    "max_num_seqs_off_by_one": {},
    "preempt_keeps_block_table": TINY,
    "preempt_oldest": TINY,
    "chunked_off_recompute_stuck": {
        **TINY,
        "enable_chunked_prefill": st.just(False),
        "max_num_batched_tokens": st.integers(1, 4),
    },
}


@pytest.mark.parametrize("mutant", list(SCHEDULER_NEGATIVE_CORNERS))
def test_negative_scheduler_machine(mutant):
    machine = narrowed(**SCHEDULER_NEGATIVE_CORNERS[mutant])
    with MUTANTS[mutant](), pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=negative_settings())


def test_negative_async_placeholder_row(monkeypatch):
    """With async scheduling the machine checks the real pipeline: placeholders that all read the
    previous step's sample row 0 (the wrong token for every other sequence) are caught."""
    add_placeholder = Sequence.add_placeholder
    monkeypatch.setattr(Sequence, "add_placeholder", lambda self, row: add_placeholder(self, 0))
    with pytest.raises(AssertionError, match="input ids"):
        run_state_machine_as_test(narrowed(async_scheduling=st.just(True)), settings=negative_settings())


def test_negative_aborted_sequence_not_released(monkeypatch):
    """Negative control of ``check_worker_state_released``: an engine whose abort does not name
    the sequence in ``finished_seq_ids`` (the executor keeps its state) is caught."""
    from nanovllm.engine.engine import LLMEngine

    abort = LLMEngine._abort

    def abort_without_release(self, seq):
        out = abort(self, seq)
        if seq.seq_id in self._finished_seq_ids:
            self._finished_seq_ids.remove(seq.seq_id)
        return out

    monkeypatch.setattr(LLMEngine, "_abort", abort_without_release)
    with pytest.raises(AssertionError, match="per-sequence state"):
        run_state_machine_as_test(SchedulerMachine, settings=negative_settings())


# ===================================================== 7. preemption exactness
workload_st = st.tuples(
    st.integers(1, 4),  # block size
    st.lists(st.tuples(prompt_st, st.integers(1, 12)), min_size=1, max_size=6),  # (prompt, max_tokens)
    st.integers(1, 4),  # max_num_seqs
    st.sampled_from([1, 3, 8, INF_BUDGET]),  # token budget
    st.booleans(),  # prefix caching
    st.integers(0, 2),  # blocks beyond the minimum
    st.tuples(st.booleans(), st.booleans()),  # async: (ample, starved)
)


def run_workload(
    case, num_blocks: int | None = None, *, async_scheduling=False, strict=True, check=True
) -> EngineHarness:
    bs, reqs, max_num_seqs, budget, prefix, extra, _ = case
    need = max(-(-(len(p) + m - 1) // bs) for p, m in reqs)
    eng = EngineHarness(
        num_blocks=need + extra if num_blocks is None else num_blocks,
        block_size=bs,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix,
        async_scheduling=async_scheduling,
        vocab_size=3,
        strict=strict,
        check=check,
    )
    for prompt, max_tokens in reqs:
        eng.add_request(prompt, max_tokens)
    eng.run()
    return eng


def check_preemption_exactness(case, *, strict=True, check=True) -> int:
    """Starved cache (preempts) and ample cache give the same tokens, each with or without async
    scheduling; returns the preemptions seen."""
    async_ample, async_starved = case[-1]
    ample = run_workload(case, num_blocks=1000, async_scheduling=async_ample, strict=strict, check=check)
    starved = run_workload(case, async_scheduling=async_starved, strict=strict, check=check)
    assert ample.scheduler.num_preemptions == 0
    assert starved.outputs == ample.outputs, (
        f"outputs differ under a starved KV cache ({starved.scheduler.num_preemptions} preemptions): "
        f"{starved.outputs} != {ample.outputs}"
    )
    return starved.scheduler.num_preemptions


@given(workload_st)
def test_preemption_exactness(case):
    preemptions = check_preemption_exactness(case)
    event("preempted" if preemptions else "no preemption")
    note(f"preemptions: {preemptions}")


def test_preemption_exactness_forced():
    """Fixed starved workloads that must preempt (so the property above is not vacuous), sync and async."""
    for modes in ((False, False), (False, True), (True, True)):
        case = (2, [([0, 1, 2, 0, 1], 12), ([1, 1, 1], 12), ([2, 0, 2, 0], 12), ([0, 1], 12)], 4, 8, False, 0, modes)
        assert check_preemption_exactness(case) > 0
        case = (2, [([0, 1, 2, 0, 1], 12), ([0, 1, 2, 0, 1, 2], 12), ([0, 1, 2, 1], 12)], 3, 3, True, 1, modes)
        assert check_preemption_exactness(case) > 0


@pytest.mark.parametrize("mutant", ["stale_hash_after_eviction", "position_after_preemption"])
def test_negative_preemption_exactness(mutant):
    """The output comparison alone (no invariants, no strict K/V reads) catches wrong K/V after preemption."""

    @negative_settings()
    @given(workload_st)
    def prop(case):
        check_preemption_exactness(case, strict=False, check=False)

    with MUTANTS[mutant](), pytest.raises(AssertionError, match="outputs differ under a starved KV cache"):
        prop()


# ========================================================== 8. chunk coverage
BUDGETS = ["1", "7", "bs-1", "bs", "bs+1", "inf"]


def budget_of(kind: str, bs: int) -> int:
    return {"1": 1, "7": 7, "bs-1": max(bs - 1, 1), "bs": bs, "bs+1": bs + 1, "inf": INF_BUDGET}[kind]


def check_chunk_coverage(eng: EngineHarness) -> None:
    """Every position of every request is cached or computed exactly once, in order, within the budget."""
    budget = eng.scheduler.max_num_batched_tokens
    for step in eng.history:
        assert step.num_tokens <= budget, f"step {step.index} computes {step.num_tokens} > budget {budget}"
    for rid, seq in eng.requests.items():
        ranges = eng.computed[rid]
        assert ("preempted", -1) not in ranges, "coverage is checked without preemption"
        cached = eng.admissions[rid][0]
        assert cached % eng.block_size == 0 and cached < seq.num_prompt_tokens
        positions = list(range(cached))  # prefix-cache hits: computed before, by another request
        for start, end in ranges:
            assert start == len(positions), (
                f"{rid}: chunk [{start}, {end}) does not start where the last one ended ({len(positions)})"
            )
            positions.extend(range(start, end))
        # every token but the last sampled one has its K/V computed, once, in order
        assert positions == list(range(seq.num_tokens - 1)), (
            f"{rid}: computed positions {positions} != 0..{seq.num_tokens - 2} exactly once"
        )
        prompt_chunks = [(s, e) for s, e in ranges if s < seq.num_prompt_tokens]
        assert prompt_chunks and prompt_chunks[-1][1] >= seq.num_prompt_tokens, f"{rid}: prompt never completed"


chunk_case_st = st.tuples(
    st.integers(1, 6),  # block size
    st.lists(st.tuples(prompt_st, st.integers(1, 6)), min_size=1, max_size=5),
    st.integers(1, 4),  # max_num_seqs
    st.booleans(),  # prefix caching
    st.booleans(),  # async scheduling
)


def run_chunk_case(case, budget_kind: str, *, strict=True, check=True) -> EngineHarness:
    bs, reqs, max_num_seqs, prefix, async_scheduling = case
    eng = EngineHarness(
        num_blocks=1000,
        block_size=bs,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget_of(budget_kind, bs),
        enable_prefix_caching=prefix,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        vocab_size=3,
        strict=strict,
        check=check,
    )
    for prompt, max_tokens in reqs:
        eng.add_request(prompt, max_tokens)
    eng.run()
    return eng


@pytest.mark.parametrize("budget_kind", BUDGETS)
@given(case=chunk_case_st)
def test_chunk_coverage(budget_kind, case):
    eng = run_chunk_case(case, budget_kind)
    check_chunk_coverage(eng)
    for rid, out in eng.outputs.items():
        assert out == eng.expected_output(rid)


def test_negative_chunk_coverage():
    """The coverage check alone (no strict K/V reads, no invariants) catches an off-by-one chunk boundary."""

    @negative_settings()
    @given(case=chunk_case_st, budget_kind=st.sampled_from(BUDGETS))
    def prop(case, budget_kind):
        check_chunk_coverage(run_chunk_case(case, budget_kind, strict=False, check=False))

    with MUTANTS["chunk_boundary_off_by_one"](), pytest.raises(AssertionError, match="does not start where"):
        prop()


# ===================================================== chunked prefill off
def check_chunked_prefill_off_recompute(async_scheduling: bool) -> None:
    """Prompts fit the budget, but after decoding a preempted request has more tokens than
    max_num_batched_tokens; it must resume (not wait forever: an empty step)."""
    eng = EngineHarness(
        num_blocks=7,
        block_size=1,
        max_num_seqs=2,
        max_num_batched_tokens=2,
        max_model_len=8,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
        vocab_size=3,
    )
    eng.add_request([0], 4)
    eng.add_request([0], 4)
    eng.run()
    assert eng.scheduler.num_preemptions > 0
    check_drained(eng)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_off_recompute_longer_than_budget(async_scheduling):
    """Regression (found by the scheduler state machine): chunked prefill off + preemption livelock."""
    check_chunked_prefill_off_recompute(async_scheduling)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_negative_chunked_prefill_off_recompute(async_scheduling):
    with MUTANTS["chunked_off_recompute_stuck"](), pytest.raises(AssertionError, match="empty step"):
        check_chunked_prefill_off_recompute(async_scheduling)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_stop_rules_match_reference(async_scheduling):
    """The engine's stop rules agree with the reference's (stop token, min_tokens, max_model_len)."""
    eng = EngineHarness(num_blocks=64, block_size=2, max_model_len=12, async_scheduling=async_scheduling, vocab_size=3)
    for i, prompt in enumerate(([0, 1], [1, 2, 0], [2, 2, 2, 2, 2])):
        eng.add_request(prompt, 9, stop_token_ids=[i], min_tokens=i)
    eng.add_request([0] * 10, 16)  # ends at max_model_len
    outputs = eng.run()
    for rid, out in outputs.items():
        assert out == eng.expected_output(rid)
    assert set(eng.finish_reasons.values()) == {"stop", "length"}
    assert len(eng.requests["r3"].token_ids) == 12
