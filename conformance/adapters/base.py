"""The adapter protocol: how a check reaches an engine, whichever engine it is.

A check asks for an engine by name and knobs, generates from token-id prompts
with per-request :class:`Sampling`, and reads :class:`Result` objects. It never
imports the engine. An engine that lacks something a check needs says so in
``capabilities``; the check is then skipped with the capability named
(``require``), never silently passed.

Engine knobs (``load(model_dir, **knobs)``) are engine-agnostic names; each
adapter maps them to its own arguments and refuses (``Unsupported``) the ones
it cannot honour:

========================  ====================  ==========================================
knob                      capability            meaning
========================  ====================  ==========================================
block_size                block_size            tokens per KV block
kv_blocks                 kv_budget             number of KV blocks (starve it to preempt)
kv_cache_gib              kv_budget             KV cache size in GiB (engines sharing a GPU)
max_batched_tokens        chunk_budget          token budget of one step (chunk size)
chunked_prefill           chunk_budget          False: a prompt is prefilled whole
prefix_cache              prefix_cache          prefix caching on / off
tp                        tp                    tensor-parallel size
cuda_graph                cuda_graph            True: decode through CUDA graphs
max_num_seqs              max_num_seqs          sequences in one step
max_model_len             max_model_len         context limit
seed, dtype, device       (always)              engine seed, "float32", "cpu" / "cuda"
========================  ====================  ==========================================
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

# What a check may need. Knob capabilities are listed in the table above.
GREEDY = "greedy"                   # temperature 0 = argmax
SAMPLING = "sampling"               # temperature > 0
SEED = "seed"                       # per-request seeds (reproducible, batch-independent)
TOP_K, TOP_P, MIN_P = "top_k", "top_p", "min_p"
LOGPROBS = "logprobs"               # top-k logprobs of the raw distribution, with ranks, per step
SAMPLED_LOGPROB = "sampled_logprob"  # only the sampled token's logprob per step
PROMPT_LOGPROBS = "prompt_logprobs"
STOP_STRINGS = "stop_strings"       # text trimmed at a stop string (include_stop_str_in_output)
STOP_TOKEN_IDS = "stop_token_ids"
MIN_TOKENS = "min_tokens"
EOS = "eos"                         # stops at the model's EOS ids unless ignore_eos
TEXT = "text"                       # detokenized output text
PREFIX_CACHE_STATS = "prefix_cache_stats"  # per-request cached-token counter
PREEMPTION_STATS = "preemption_stats"      # engine-wide preemption counter
ADMISSION_CONTROL = "admission_control"    # refuses a request that can never fit

KNOB_CAPABILITY = {
    "block_size": "block_size", "kv_blocks": "kv_budget", "kv_cache_gib": "kv_budget", "max_batched_tokens": "chunk_budget",
    "chunked_prefill": "chunk_budget", "prefix_cache": "prefix_cache", "tp": "tp",
    "cuda_graph": "cuda_graph", "max_num_seqs": "max_num_seqs", "max_model_len": "max_model_len",
    "async_scheduling": "async_scheduling",
}
ALWAYS_KNOBS = {"seed", "dtype", "device"}


class Unsupported(Exception):
    """The engine cannot do what was asked; ``capability`` names what it lacks."""

    def __init__(self, capability: str, detail: str = ""):
        super().__init__(f"lacks capability {capability}" + (f" ({detail})" if detail else ""))
        self.capability = capability
        self.detail = detail


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling and stopping, with vLLM's meanings (temperature 0 = greedy,
    top_k 0 = off, logprobs=k: top-k of the raw distribution plus the sampled token)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @staticmethod
    def greedy(max_tokens: int, ignore_eos: bool = True, **kw) -> "Sampling":
        return Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, **kw)

    def with_(self, **kw) -> "Sampling":
        return replace(self, **kw)

    def needs(self) -> set[str]:
        """The capabilities this request needs."""
        caps = {GREEDY} if self.temperature == 0 else {SAMPLING}
        for name, cap in ((self.top_k, TOP_K), (self.top_p < 1.0, TOP_P), (self.min_p > 0, MIN_P),
                          (self.seed is not None, SEED), (self.stop, STOP_STRINGS),
                          (self.stop_token_ids, STOP_TOKEN_IDS), (self.min_tokens, MIN_TOKENS),
                          (self.logprobs is not None, LOGPROBS),
                          (self.prompt_logprobs is not None, PROMPT_LOGPROBS)):
            if name:
                caps.add(cap)
        return caps


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when the engine does not say


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str | None            # "stop" | "length" | ... (engine's words, normalised to vLLM's)
    text: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None         # per generated token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, {..}, ...] per prompt token
    num_cached_tokens: int | None = None  # prefix-cache hit at admission, when the engine tells
    num_preemptions: int | None = None
    extra: dict = field(default_factory=dict)


@runtime_checkable
class EngineAdapter(Protocol):
    name: str
    capabilities: frozenset[str]

    def load(self, model_dir: str, **knobs) -> None: ...

    def generate(self, prompts: list[list[int]], params: list[Sampling]) -> list[Result]: ...

    def stats(self) -> dict: ...  # engine-wide counters: "preemptions", "cached_tokens" where known

    def close(self) -> None: ...


def check_knobs(name: str, capabilities: frozenset[str], knobs: dict) -> None:
    """Raise Unsupported for a knob the engine cannot take (None values mean 'default')."""
    for knob, value in knobs.items():
        if value is None or knob in ALWAYS_KNOBS:
            continue
        cap = KNOB_CAPABILITY.get(knob)
        if cap is None:
            raise TypeError(f"unknown engine knob {knob!r}; known: {sorted(KNOB_CAPABILITY) + sorted(ALWAYS_KNOBS)}")
        if cap not in capabilities:
            raise Unsupported(cap, f"knob {knob}={value!r}")


def check_params(capabilities: frozenset[str], params: Sequence[Sampling]) -> None:
    for p in params:
        missing = sorted(p.needs() - capabilities)
        if missing:
            raise Unsupported(missing[0], f"needed by {p}")
