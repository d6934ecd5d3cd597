"""Run a workload through an LLM and read what happened off the engine's trace.

Prompts are seeded random token ids (no tokenizer, no cache hits between distinct
prompts unless a test builds them to share a prefix); every request is greedy with
``ignore_eos`` so it produces exactly ``max_tokens`` tokens: the workload fixes the
token counts, the measurement only the times.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass

from nanovllm.engine.trace import RequestSummary, StepEvent, summarize_requests
from nanovllm.sampling_params import SamplingParams

TOKEN_RANGE = (100, 40000)  # ids drawn from here (clipped to the vocabulary): ordinary tokens


def random_prompt(vocab_size: int, length: int, rng: random.Random) -> list[int]:
    lo, hi = TOKEN_RANGE[0] % vocab_size, min(TOKEN_RANGE[1], vocab_size - 1)
    lo = min(lo, hi)
    return [rng.randint(lo, hi) for _ in range(length)]


def random_prompts(vocab_size: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(vocab_size, n, rng) for n in lengths]


@dataclass
class RequestRun:
    """One request of a run: its sizes and times (seconds from the run's start)."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    ttft_s: float | None  # first token
    latency_s: float | None  # finished
    summary: RequestSummary

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with fewer than two tokens)."""
        if self.num_output_tokens < 2 or self.ttft_s is None or self.latency_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass
class Run:
    wall_s: float
    t0: float
    events: list[StepEvent]
    requests: list[RequestRun]  # in submission order
    stats: dict  # engine stats delta over the run (counters only)
    outputs: list  # the RequestOutputs, in submission order

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)

    @property
    def output_tok_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    def step_times(self, kind: str | None = None) -> list[float]:
        return [e.duration for e in self.events if kind is None or e.kind == kind]

    def rel(self, t: float | None) -> float | None:
        return None if t is None else t - self.t0


_COUNTERS = (
    "steps",
    "preemptions",
    "prefix_cache_hit_tokens",
    "prompt_tokens_computed",
    "generation_tokens",
    "evictions",
)


def run_workload(llm, prompts: list[list[int]], max_tokens, check: bool = True) -> Run:
    """Generate greedily for ``prompts`` (``max_tokens``: one int or one per prompt) with the
    engine's tracer on; return times and per-request summaries (steps numbered from 0 at the
    run's first step). ``check``: the engine's
    invariants hold afterwards and every request produced exactly its ``max_tokens``."""
    engine = llm.llm_engine
    if not engine.tracer.enabled:
        raise ValueError("run_workload needs an LLM built with trace=True (the times come from the trace)")
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    engine.tracer.clear()
    before = engine.stats()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = engine.stats()
    events = _numbered_from_zero(engine.tracer.events)
    summaries = summarize_requests(events)
    requests = []
    for out in outputs:
        s = summaries[out.request_id]
        requests.append(
            RequestRun(
                out.request_id,
                len(out.prompt_token_ids),
                len(out.outputs[0].token_ids),
                out.outputs[0].finish_reason,
                None if s.t_first_token is None else s.t_first_token - t0,
                None if s.t_finish is None else s.t_finish - t0,
                s,
            )
        )
    run = Run(wall, t0, events, requests, {k: after[k] - before[k] for k in _COUNTERS}, outputs)
    if check:
        engine.check_invariants()
        got = [r.num_output_tokens for r in requests]
        if got != list(max_tokens):
            raise RuntimeError(f"output lengths {got} differ from the workload's max_tokens {list(max_tokens)}")
    return run


def _numbered_from_zero(events: list[StepEvent]) -> list[StepEvent]:
    """Copies of a run's events with step numbers counted from the run's first step (the
    engine counts from its start, so a warm-up on the same engine would shift them)."""
    first = events[0].step if events else 0
    return [dataclasses.replace(e, step=e.step - first) for e in events]


def warm_up(llm) -> None:
    """One short request first, so that one-time costs (allocations, lazy inits) stay out of
    the measurements."""
    vocab = llm.llm_engine.vocab_size
    run_workload(llm, random_prompts(vocab, [8], seed=12345), 2, check=False)


VARIANT_FIELDS = (
    "num_kvcache_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "enable_chunked_prefill",
)


def engine_variant(llm, **overrides) -> None:
    """Give ``llm`` a fresh LLMEngine with some scheduler or KV-cache settings changed, over the
    model already loaded (a reload takes seconds, and a sweep would spend most of its time
    there). The KV cache is allocated anew. ``max_num_seqs`` and ``max_num_batched_tokens``
    may not exceed the loaded engine's: the device's input buffers were sized for those."""
    from nanovllm.engine.engine import LLMEngine

    old = llm.llm_engine
    unknown = sorted(set(overrides) - set(VARIANT_FIELDS))
    if unknown:
        raise ValueError(f"engine_variant changes only {', '.join(VARIANT_FIELDS)}; got {', '.join(unknown)}")
    loaded = llm.__dict__.setdefault(
        "_loaded_limits", {n: getattr(old.config, n) for n in ("max_num_seqs", "max_num_batched_tokens")}
    )
    for name, limit in loaded.items():
        if name in overrides and overrides[name] > limit:
            raise ValueError(
                f"{name}={overrides[name]} exceeds the loaded engine's {limit}; "
                f"load the model with the largest value of the sweep"
            )
    if old.has_unfinished_requests():
        raise RuntimeError("engine_variant needs an idle engine (requests are still running)")
    overrides.setdefault("num_kvcache_blocks", old.block_manager.num_blocks)
    config = dataclasses.replace(old.config, **overrides)
    executor, old.executor = old.executor, None  # the old engine is closed without closing the model
    llm.llm_engine = LLMEngine(config, executor, old.tokenizer, old.eos_token_ids, trace=True)
