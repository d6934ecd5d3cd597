"""A fake model runner: the real Scheduler and BlockManager, driven without torch.

``FakeEngine.step`` mirrors ``LLMEngine.step``: schedule, build the real
``ModelInput``, run a *fake model* on it, ``update_after_step``, append the
sampled token, finish at ``max_tokens`` / a stop token / ``max_model_len``.

The fake model is deterministic and pages its K/V exactly as a real one does:

* the fake K/V of position ``p`` is ``kv_value(kv[p - 1], p, token[p])`` -- a
  64-bit chain value that depends on every token up to ``p`` and on ``p``
  itself, as a deep transformer's K/V does. It is computed by reading the K/V of
  ``p - 1`` *through the block table* and written through ``slot_mapping``;
* the next token is a function of all K/V of the sequence, read through the
  block table (``attend``), so it is ``f(all previous tokens)`` when paging is
  right and something else when a slot holds wrong, stale or missing K/V.

``reference_generate`` computes ``f`` directly from the token list, so the
expected output of any request is known without running an engine: preemption,
chunking, prefix caching and batching must not change it.

With ``strict=True`` every K/V read is checked against the truth and a wrong
one raises ``KVCacheError`` naming the sequence, position and slot; with
``strict=False`` wrong K/V only changes the output (what an output comparison
sees). With ``check=True`` the step-level scheduler properties
(``check_step``) and ``Scheduler.check_invariants`` run after every step.

Pure Python: importing this module imports no torch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from nanovllm.core import model_input as _model_input  # looked up per call: mutants may patch it
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.scheduler import Scheduler, SchedulerOutput
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams

MASK64 = (1 << 64) - 1
KV_ROOT = 0x5EED_0F_C0FFEE  # the "K/V" before position 0
INF_BUDGET = 1 << 30        # "unlimited" max_num_batched_tokens


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit bijection."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def kv_value(prev: int, pos: int, token: int) -> int:
    """Fake K/V of position ``pos``: depends on the K/V before it, the position and the token."""
    return _mix(prev ^ _mix((pos << 32) ^ (token & 0xFFFFFFFF)))


def kv_chain(tokens, prev: int = KV_ROOT) -> list[int]:
    out = []
    for pos, tok in enumerate(tokens):
        prev = kv_value(prev, pos, tok)
        out.append(prev)
    return out


def attend(values) -> int:
    """Fold every K/V of a sequence (in position order) into one state."""
    acc = 0xA11
    for v in values:
        acc = _mix(acc ^ v)
    return acc


def next_token(values, vocab_size: int) -> int:
    return (attend(values) >> 7) % vocab_size


def reference_generate(prompt: list[int], max_tokens: int, vocab_size: int, *, max_model_len: int = 1 << 30,
                       stop_token_ids=(), min_tokens: int = 0) -> list[int]:
    """What the fake model outputs for ``prompt`` when paging is right: f(all previous tokens)."""
    tokens = list(prompt)
    chain = kv_chain(tokens)
    out: list[int] = []
    while True:
        tok = next_token(chain, vocab_size)
        out.append(tok)
        if len(out) >= min_tokens and tok in stop_token_ids:
            return out
        if len(out) >= max_tokens or len(tokens) + 1 >= max_model_len:
            return out
        chain.append(kv_value(chain[-1] if chain else KV_ROOT, len(tokens), tok))
        tokens.append(tok)


class KVCacheError(AssertionError):
    """The fake model read K/V that does not belong to the sequence at that position."""


class SchedulerStuck(AssertionError):
    """The scheduler returned an empty step (or ran past its step bound) with requests pending."""


@dataclass
class StepRecord:
    index: int
    scheduled: list[tuple[str, int, int]]          # (request_id, first position, num_new_tokens)
    admitted: list[tuple[str, int]]                 # (request_id, prefix-cache hit tokens)
    preempted: list[str]
    finished: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.scheduled)


def check_step(engine: FakeEngine, out: SchedulerOutput) -> None:
    """Step-level scheduler properties (catalogue item 6), checked right after ``schedule()``."""
    sched = engine.scheduler
    bs = engine.block_size
    assert out.num_tokens <= sched.max_num_batched_tokens, \
        f"token budget exceeded: {out.num_tokens} > max_num_batched_tokens={sched.max_num_batched_tokens}"
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
            assert n == remaining or remaining > sched.max_num_batched_tokens, \
                f"chunked prefill is off but {seq} was admitted with a chunk of {n} of {remaining}"
    if out.is_empty:
        assert not sched.has_unfinished(), "empty step with requests pending"


class FakeEngine:
    """Scheduler + BlockManager + a fake paged model; see the module docstring.

    Usage::

        eng = FakeEngine(num_blocks=6, block_size=2, max_num_batched_tokens=4)
        eng.add_request([0, 1, 2], max_tokens=8)          # ValueError where the scheduler refuses it
        outputs = eng.run()                                # request_id -> generated token ids
        assert outputs["r0"] == eng.expected_output("r0")  # f(all previous tokens), no paging

    Records for property checks: ``history`` (one ``StepRecord`` per step),
    ``computed`` (each request's computed position ranges, in order),
    ``admissions`` (prefix-cache hit tokens at each admission).
    """

    def __init__(self, *, num_blocks: int, block_size: int = 4, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 64, max_model_len: int = 1024,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 hash_fn=None, vocab_size: int = 11, strict: bool = True, check: bool = True):
        kwargs = {} if hash_fn is None else {"hash_fn": hash_fn}
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching, **kwargs)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, max_model_len,
                                   enable_chunked_prefill)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.strict = strict
        self.check = check
        self.kv: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)  # slot -> (pos, value)
        self.requests: dict[str, Sequence] = {}
        self.outputs: dict[str, list[int]] = {}      # finished (not aborted) requests
        self.finish_reasons: dict[str, str] = {}
        self.history: list[StepRecord] = []
        # per request: computed position ranges in order; ("preempted", -1) marks a preemption
        self.computed: dict[str, list[tuple[int, int] | tuple[str, int]]] = {}
        self.admissions: dict[str, list[int]] = {}   # per request: prefix-cache hit tokens at each admission
        self._truth: dict[int, list[int]] = {}       # seq_id -> correct K/V chain of its tokens
        self._expected: dict[str, list[int]] = {}
        self._ids = itertools.count()

    # --------------------------------------------------------------- requests
    def add_request(self, prompt: list[int], max_tokens: int = 8, *, request_id: str | None = None,
                    min_tokens: int = 0, stop_token_ids=None) -> Sequence:
        """Create and add a request; raises ValueError where the scheduler refuses it."""
        seq_id = next(self._ids)
        request_id = f"r{seq_id}" if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"duplicate request_id {request_id!r}")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=min_tokens,
                                stop_token_ids=stop_token_ids)
        seq = Sequence(seq_id, request_id, list(prompt), params)
        self.scheduler.add(seq)
        self.requests[request_id] = seq
        self.computed[request_id] = []
        self.admissions[request_id] = []
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.requests[request_id]
        if not seq.is_finished:
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"
            self.finish_reasons[request_id] = "abort"

    def expected_output(self, request_id: str) -> list[int]:
        """The reference output of a request: f(all previous tokens), computed without paging."""
        if request_id not in self._expected:
            seq = self.requests[request_id]
            p = seq.params
            self._expected[request_id] = reference_generate(
                seq.prompt_token_ids, p.max_tokens, self.vocab_size, max_model_len=self.max_model_len,
                stop_token_ids=seq.stop_token_ids, min_tokens=p.min_tokens)
        return self._expected[request_id]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step_bound(self) -> int:
        """Steps within which every unfinished request must finish.

        The first running sequence is never preempted (it fits alone) and computes
        at least one token per step, so each request finishes within
        prompt + max_tokens steps once it is first; an empty running list admits.
        """
        total = 0
        for seq in self.requests.values():
            if not seq.is_finished:
                total += seq.num_prompt_tokens + (seq.params.max_tokens or self.max_model_len) + 1
        return total + 1

    # ------------------------------------------------------------------- step
    def step(self) -> list[Sequence]:
        sched = self.scheduler
        out = sched.schedule()
        if self.check:
            check_step(self, out)
        if out.is_empty:
            if sched.has_unfinished():
                raise SchedulerStuck(f"scheduler produced an empty step with requests pending: "
                                     f"waiting={list(sched.waiting)} running={sched.running}")
            return []
        record = StepRecord(len(self.history),
                            [(s.request_id, s.num_computed_tokens, n) for s, n in zip(out.seqs, out.num_new_tokens)],
                            [(s.request_id, s.num_computed_tokens) for s in out.admitted],
                            [s.request_id for s in out.preempted])
        self.history.append(record)
        for seq in out.preempted:
            self.computed[seq.request_id].append(("preempted", -1))
        for rid, cached in record.admitted:
            self.admissions[rid].append(cached)
        for rid, start, n in record.scheduled:
            self.computed[rid].append((start, start + n))

        mi, _ = _model_input.build_model_input(out, self.block_size)
        sampled = self._execute(out, mi)
        sched.update_after_step(out)
        finished = []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            seq.append_token(sampled[seq.seq_id])
            p = seq.params
            n_out = seq.num_output_tokens
            if n_out >= p.min_tokens and seq.token_ids[-1] in seq.stop_token_ids:
                seq.finish_reason = "stop"
            elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                sched.finish(seq)
                self.outputs[seq.request_id] = seq.output_token_ids
                self.finish_reasons[seq.request_id] = seq.finish_reason
                record.finished.append(seq.request_id)
                self._truth.pop(seq.seq_id, None)
                finished.append(seq)
        if self.check:
            sched.check_invariants()
        return finished

    def run(self, max_steps: int | None = None) -> dict[str, list[int]]:
        """Step until nothing is unfinished; raises SchedulerStuck past the step bound."""
        bound = self.step_bound() if max_steps is None else max_steps
        for _ in range(bound):
            if not self.scheduler.has_unfinished():
                break
            self.step()
        if self.scheduler.has_unfinished():
            raise SchedulerStuck(f"requests still unfinished after {bound} steps: "
                                 f"waiting={list(self.scheduler.waiting)} running={self.scheduler.running}")
        return self.outputs

    # ------------------------------------------------------------ fake model
    def _truth_of(self, seq: Sequence) -> list[int]:
        chain = self._truth.setdefault(seq.seq_id, [])
        if len(chain) < seq.num_tokens:
            prev = chain[-1] if chain else KV_ROOT
            for pos in range(len(chain), seq.num_tokens):
                prev = kv_value(prev, pos, seq.token_ids[pos])
                chain.append(prev)
        return chain

    def _slot(self, table: list[int], pos: int) -> int | None:
        i = pos // self.block_size
        return table[i] * self.block_size + pos % self.block_size if i < len(table) else None

    def _read(self, seq: Sequence, table: list[int], pos: int, truth: list[int] | None) -> int:
        slot = self._slot(table, pos)
        entry = self.kv[slot] if slot is not None else None
        if truth is not None and entry != (pos, truth[pos]):
            raise KVCacheError(f"{seq}: position {pos} reads slot {slot} holding {entry}, "
                               f"expected ({pos}, {truth[pos]})")
        if entry is None or entry[0] != pos:
            return 0  # missing or misplaced K/V: contributes garbage
        return entry[1]

    def _execute(self, out: SchedulerOutput, mi) -> dict[int, int]:
        """Run the fake model on the ModelInput; return seq_id -> sampled token."""
        sample_rows = set(mi.sample_rows)
        sampled: dict[int, int] = {}
        for j, seq in enumerate(out.seqs):
            start = seq.num_computed_tokens
            lo, hi = mi.query_start_loc[j], mi.query_start_loc[j + 1]
            table = mi.block_tables[j]
            truth = self._truth_of(seq) if self.strict else None
            if self.strict:
                n = out.num_new_tokens[j]
                assert hi - lo == n, f"ModelInput has {hi - lo} rows for {seq}, scheduled {n}"
                assert mi.positions[lo:hi] == list(range(start, start + n)), \
                    f"ModelInput positions {mi.positions[lo:hi]} != [{start}, {start + n}) for {seq}"
                assert mi.input_ids[lo:hi] == seq.token_ids[start:start + n], f"ModelInput input_ids wrong for {seq}"
                assert mi.slot_mapping[lo:hi] == [self._slot(seq.block_table, p) for p in range(start, start + n)], \
                    f"ModelInput slot_mapping wrong for {seq}"
                assert mi.seq_lens[j] == start + n, f"ModelInput seq_len {mi.seq_lens[j]} != {start + n} for {seq}"
                assert ((hi - 1) in sample_rows) == (start + n == seq.num_tokens), \
                    f"ModelInput samples {seq} wrongly (chunk ends at {start + n} of {seq.num_tokens})"
                # attention of this chunk reads all earlier K/V through the block table
                for pos in range(start):
                    self._read(seq, table, pos, truth)
            value = None
            for r in range(lo, hi):
                pos, tok, slot = mi.positions[r], mi.input_ids[r], mi.slot_mapping[r]
                if pos == 0:
                    prev = KV_ROOT
                elif r > lo and mi.positions[r - 1] == pos - 1:
                    prev = value  # computed just now, in the same forward pass
                else:
                    prev = self._read(seq, table, pos - 1, truth)
                value = kv_value(prev, pos, tok)
                if 0 <= slot < len(self.kv):
                    self.kv[slot] = (pos, value)
            if (hi - 1) in sample_rows:
                seq_len = mi.seq_lens[j]
                values = [self._read(seq, table, p, truth) for p in range(seq_len)]
                sampled[seq.seq_id] = next_token(values, self.vocab_size)
        return sampled
