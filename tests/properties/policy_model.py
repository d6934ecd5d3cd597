"""An independent model of nanovllm's scheduling and prefix-cache policy, for exact expectations.

The real scheduler and block manager keep physical blocks, hashes, serials and an OrderedDict
free queue. This model keeps none of that: it states the documented policy over *content* and
predicts, step by step, everything an observer can see:

* what each step computes: ``(request, first position, number of tokens)`` in scheduling order,
  who is admitted with how many prefix-cache tokens, who is preempted, who finishes and why;
* the free KV blocks after each step, the evictions, the prefix-cache counters;
* each request's ``num_cached_tokens`` (its hit at *first* admission) and ``num_preemptions``.

Policy (scheduler.py and block_manager.py docstrings, vLLM's FCFS with recompute preemption):

* Running requests are served first, in admission order, each taking ``min(tokens not yet
  computed, budget left)``; when one cannot get its blocks, the most recently admitted running
  request is preempted (repeatedly, possibly the one asking); it frees its blocks, forgets what
  it computed, and goes to the *front* of the waiting queue. A step that preempts admits no one.
* Then waiting requests are admitted in queue order while the budget, ``max_num_seqs`` and the
  free blocks allow (without chunked prefill a request is taken whole, unless even the whole
  budget could never hold it). An admitted request starts after its prefix-cache hit.
* A request's block i may be served from the cache when the *same token prefix* (blocks 0..i)
  was published and its K/V was computed after the block served as i-1 (a publication is
  identified by its serial). At most ``(num_tokens - 1) // block_size`` blocks: the last token
  is always computed. Requests with prompt logprobs neither hit nor publish.
* After a step, each computed request publishes its newly completed full blocks in order; a
  block whose prefix is already published by another request stays private and the chain
  continues from the published one (when it was computed after the same parent), else stops.
* Free blocks: blocks holding nothing published are used first; then published free blocks are
  evicted least recently released first. A finished or preempted request releases its blocks
  last block first (so a prefix's tail is evicted before its head). A hit takes a free published
  block back out of the free pool.

Counters (engine.stats()): ``prefix_cache_hit_tokens`` / ``prefix_cache_query_tokens`` add the
hit and the request's token count at *every* admission (re-admissions too); prompt tokens
computed are the tokens of every chunk that is not a decode (a decode computes exactly the
newest token of a request past its prompt); generation tokens are the tokens sampled.

Pure Python, no torch. ``next_token(request_id, tokens)`` supplies the model's tokens (the fake
runner's reference function, or a real engine's tokens from an ample run).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ModelRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    no_prefix_cache: bool = False  # requests with prompt logprobs neither hit nor publish
    tokens: list[int] = field(init=False)
    computed: int = 0
    table: list[tuple | None] = field(default_factory=list)  # per block: the published prefix it holds, or None
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None

    def __post_init__(self):
        self.tokens = list(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass
class _Published:
    serial: int
    parent_serial: int | None
    holders: int = 0


@dataclass
class ModelStep:
    scheduled: list[tuple[str, int, int]]  # (request, first position, tokens) in order
    phases: list[str]  # "prefill" | "decode", per scheduled entry
    admitted: list[tuple[str, int]]  # (request, prefix-cache hit tokens)
    preempted: list[str]
    finished: list[tuple[str, str]]  # (request, finish reason)
    num_free_blocks: int


class PolicyModel:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        next_token: Callable[[str, list[int]], int],
    ):
        self.num_blocks = num_blocks
        self.bs = block_size
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.caching = enable_prefix_caching
        self.chunked = enable_chunked_prefill
        self.next_token = next_token
        self.published: dict[tuple, _Published] = {}  # token prefix (whole blocks) -> publication
        self.free_plain = num_blocks  # free blocks holding nothing published
        self.free_published: list[tuple] = []  # free published prefixes, least recently released first
        self._serials = itertools.count()
        self.waiting: list[ModelRequest] = []
        self.running: list[ModelRequest] = []
        self.requests: dict[str, ModelRequest] = {}
        self.steps: list[ModelStep] = []
        self.counters = {
            "steps": 0,
            "preemptions": 0,
            "prefix_cache_hit_tokens": 0,
            "prefix_cache_query_tokens": 0,
            "prompt_tokens_computed": 0,
            "generation_tokens": 0,
            "evictions": 0,
        }

    # ---------------------------------------------------------------- requests
    def add(self, req: ModelRequest) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    @property
    def num_free_blocks(self) -> int:
        return self.free_plain + len(self.free_published)

    # ------------------------------------------------------------ prefix cache
    def _prefix(self, req: ModelRequest, i: int) -> tuple:
        return tuple(req.tokens[: (i + 1) * self.bs])

    def _hits(self, req: ModelRequest) -> list[tuple]:
        if not self.caching or req.no_prefix_cache:
            return []
        hits: list[tuple] = []
        parent = None
        for i in range((req.num_tokens - 1) // self.bs):
            pub = self.published.get(self._prefix(req, i))
            if pub is None or pub.parent_serial != parent:
                break
            hits.append(self._prefix(req, i))
            parent = pub.serial
        return hits

    def _take(self, req: ModelRequest, num_new: int, hits: list[tuple]) -> bool:
        """Blocks for num_new more tokens after the hits; all or nothing."""
        have = len(req.table) + len(hits)
        need = -(-(req.computed + len(hits) * self.bs + num_new) // self.bs) - have
        revived = [h for h in hits if self.published[h].holders == 0]
        if need > self.num_free_blocks - len(revived):
            return False
        for h in hits:
            if self.published[h].holders == 0:
                self.free_published.remove(h)
            self.published[h].holders += 1
            req.table.append(h)
        for _ in range(max(need, 0)):
            if self.free_plain:
                self.free_plain -= 1
            else:
                del self.published[self.free_published.pop(0)]
                self.counters["evictions"] += 1
            req.table.append(None)
        return True

    def _release(self, req: ModelRequest) -> None:
        for entry in reversed(req.table):
            if entry is None:
                self.free_plain += 1
                continue
            pub = self.published[entry]
            pub.holders -= 1
            if pub.holders == 0:
                self.free_published.append(entry)
        req.table = []

    def _publish(self, req: ModelRequest) -> None:
        if not self.caching or req.no_prefix_cache:
            return
        full = req.computed // self.bs
        if full == 0 or req.table[full - 1] is not None:
            return
        start = full
        while start > 0 and req.table[start - 1] is None:
            start -= 1
        parent = self.published[req.table[start - 1]].serial if start else None
        for i in range(start, full):
            prefix = self._prefix(req, i)
            pub = self.published.get(prefix)
            if pub is None:
                pub = self.published[prefix] = _Published(next(self._serials), parent, holders=1)
                req.table[i] = prefix
            elif pub.parent_serial != parent:
                return  # computed after another parent: nothing later can be published safely
            parent = pub.serial

    # -------------------------------------------------------------------- step
    def _preempt(self, req: ModelRequest) -> None:
        self._release(req)
        req.computed = 0
        req.num_preemptions += 1
        self.counters["preemptions"] += 1
        self.waiting.insert(0, req)

    def step(self) -> ModelStep | None:
        if not self.waiting and not self.running:
            return None
        scheduled: list[tuple[ModelRequest, int, int]] = []
        preempted: list[str] = []
        admitted: list[tuple[str, int]] = []
        budget = self.budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.computed, budget)
            if self._take(req, num_new, []):
                scheduled.append((req, req.computed, num_new))
                budget -= num_new
                i += 1
                continue
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                break
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self._hits(req)
            cached = len(hits) * self.bs
            remaining = req.num_tokens - cached
            if not self.chunked and self.budget >= remaining > budget:
                break
            num_new = min(remaining, budget)
            if not self._take(req, num_new, hits):
                break
            self.waiting.pop(0)
            self.running.append(req)
            req.computed = cached
            if req.num_cached_tokens is None:
                req.num_cached_tokens = cached
            self.counters["prefix_cache_hit_tokens"] += cached
            self.counters["prefix_cache_query_tokens"] += req.num_tokens
            admitted.append((req.request_id, cached))
            scheduled.append((req, cached, num_new))
            budget -= num_new
        if not scheduled:
            raise AssertionError("the policy model scheduled nothing with requests pending")

        phases = []
        for req, start, n in scheduled:
            decode = n == 1 and start + 1 == req.num_tokens and start >= len(req.prompt)
            phases.append("decode" if decode else "prefill")
            if not decode:
                self.counters["prompt_tokens_computed"] += n
        for req, _start, n in scheduled:
            req.computed += n
            self._publish(req)
        finished: list[tuple[str, str]] = []
        for req, _, _ in scheduled:
            if req.computed < req.num_tokens:
                continue
            tok = self.next_token(req.request_id, list(req.tokens))
            req.tokens.append(tok)
            self.counters["generation_tokens"] += 1
            if req.num_output >= req.min_tokens and tok in req.stop_token_ids:
                req.finish_reason = "stop"
            elif req.num_output >= req.max_tokens or req.num_tokens >= self.max_model_len:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                self.running.remove(req)
                self._release(req)
                finished.append((req.request_id, req.finish_reason))
        self.counters["steps"] += 1
        record = ModelStep(
            [(r.request_id, s, n) for r, s, n in scheduled], phases, admitted, preempted, finished, self.num_free_blocks
        )
        self.steps.append(record)
        return record

    def run(self, max_steps: int = 100_000) -> list[ModelStep]:
        for _ in range(max_steps):
            if self.step() is None:
                return self.steps
        raise AssertionError(f"the policy model did not finish within {max_steps} steps")

    def outputs(self) -> dict[str, list[int]]:
        return {rid: r.tokens[len(r.prompt) :] for rid, r in self.requests.items()}
