"""The adapter contract: how a check reaches an engine, whichever engine it is.

A check asks for an engine by name and knobs, generates from token-id prompts
with per-request :class:`Sampling`, and reads :class:`Result` objects. It never
imports the engine. An engine that lacks something a check needs says so in
``capabilities`` (members of :class:`Capability`); the check is then skipped
with the capability named, never silently passed, and a run where too many
checks were skipped that way fails (see ``conformance.plugin``).

Every adapter subclasses :class:`EngineAdapter`, which holds everything the
harness calls: ``unavailable()``, ``describe()``, ``preferred_block_size``,
``max_live``, ``load``, ``generate``, ``stats``, ``close``.

Engine knobs (``load(model_dir, **knobs)``) are engine-agnostic names; each
adapter maps them to its own arguments and refuses (``Unsupported``) the ones
it cannot honour:

========================  ====================  ==========================================
knob                      capability            meaning
========================  ====================  ==========================================
block_size                BLOCK_SIZE            tokens per KV block
kv_blocks                 KV_BUDGET             number of KV blocks (starve it to preempt)
kv_cache_gib              KV_BUDGET             KV cache size in GiB (engines sharing a GPU)
max_batched_tokens        CHUNK_BUDGET          token budget of one step (chunk size)
chunked_prefill           CHUNK_BUDGET          False: a prompt is prefilled whole
prefix_cache              PREFIX_CACHE          prefix caching on / off
tp                        TP                    tensor-parallel size
cuda_graph                CUDA_GRAPH            True: decode through CUDA graphs
max_num_seqs              MAX_NUM_SEQS          sequences in one step
max_model_len             MAX_MODEL_LEN         context limit
async_scheduling          ASYNC_SCHEDULING      overlap scheduling with the model step
seed, dtype, device       (always)              engine seed, "float32", "cpu" / "cuda"
========================  ====================  ==========================================
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar


class Capability(str, enum.Enum):
    """What a check may need from an engine. The value is the name used in messages and reports."""

    # requests
    GREEDY = "greedy"  # temperature 0 = argmax
    SAMPLING = "sampling"  # temperature > 0
    SEED = "seed"  # per-request seeds (reproducible, batch-independent)
    TOP_K = "top_k"
    TOP_P = "top_p"
    MIN_P = "min_p"
    LOGPROBS = "logprobs"  # top-k logprobs of the raw distribution, with ranks, per step
    SAMPLED_LOGPROB = "sampled_logprob"  # only the sampled token's logprob per step
    PROMPT_LOGPROBS = "prompt_logprobs"
    STOP_STRINGS = "stop_strings"  # text trimmed at a stop string (include_stop_str_in_output)
    STOP_TOKEN_IDS = "stop_token_ids"
    MIN_TOKENS = "min_tokens"
    EOS = "eos"  # stops at the model's EOS ids unless ignore_eos
    IGNORE_EOS = "ignore_eos"  # generates on past EOS (every 64-token greedy comparison needs it)
    TEXT = "text"  # detokenized output text
    TOKEN_IDS = "token_ids"  # takes token-id prompts, returns the output's ids (text-only APIs lack it)
    # engine-wide counters and behaviour
    PREFIX_CACHE_STATS = "prefix_cache_stats"  # per-request cached-token counter
    PREEMPTION_STATS = "preemption_stats"  # engine-wide preemption counter
    ADMISSION_CONTROL = "admission_control"  # refuses a request that can never fit
    # models
    ANY_MODEL = "any_model"  # loads whichever model a check names, not one fixed model or format
    # engine knobs (see the table above)
    BLOCK_SIZE = "block_size"
    KV_BUDGET = "kv_budget"
    CHUNK_BUDGET = "chunk_budget"
    PREFIX_CACHE = "prefix_cache"
    TP = "tp"
    CUDA_GRAPH = "cuda_graph"
    MAX_NUM_SEQS = "max_num_seqs"
    MAX_MODEL_LEN = "max_model_len"
    ASYNC_SCHEDULING = "async_scheduling"
    # claims
    BATCH_INVARIANT = "batch_invariant"  # a request's logprobs do not depend on its batch-mates (bitwise)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value) -> Capability:
        """A member from a member or its value; ValueError naming the value and the known ones."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown capability {value!r}; known: {', '.join(c.value for c in cls)}") from None

    @classmethod
    def set_of(cls, values: Iterable) -> frozenset[Capability]:
        return frozenset(cls.parse(v) for v in values)


C = Capability
# module-level names kept for checks written against them
GREEDY, SAMPLING, SEED = C.GREEDY, C.SAMPLING, C.SEED
TOP_K, TOP_P, MIN_P = C.TOP_K, C.TOP_P, C.MIN_P
LOGPROBS, SAMPLED_LOGPROB, PROMPT_LOGPROBS = C.LOGPROBS, C.SAMPLED_LOGPROB, C.PROMPT_LOGPROBS
STOP_STRINGS, STOP_TOKEN_IDS, MIN_TOKENS, EOS, TEXT = C.STOP_STRINGS, C.STOP_TOKEN_IDS, C.MIN_TOKENS, C.EOS, C.TEXT
PREFIX_CACHE_STATS, PREEMPTION_STATS, ADMISSION_CONTROL = C.PREFIX_CACHE_STATS, C.PREEMPTION_STATS, C.ADMISSION_CONTROL

KNOB_CAPABILITY: dict[str, Capability] = {
    "block_size": C.BLOCK_SIZE,
    "kv_blocks": C.KV_BUDGET,
    "kv_cache_gib": C.KV_BUDGET,
    "max_batched_tokens": C.CHUNK_BUDGET,
    "chunked_prefill": C.CHUNK_BUDGET,
    "prefix_cache": C.PREFIX_CACHE,
    "tp": C.TP,
    "cuda_graph": C.CUDA_GRAPH,
    "max_num_seqs": C.MAX_NUM_SEQS,
    "max_model_len": C.MAX_MODEL_LEN,
    "async_scheduling": C.ASYNC_SCHEDULING,
}
ALWAYS_KNOBS = {"seed", "dtype", "device"}


class Unsupported(Exception):
    """The engine cannot do what was asked; ``capability`` names what it lacks."""

    def __init__(self, capability, detail: str = ""):
        capability = Capability.parse(capability)
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
    def greedy(max_tokens: int, ignore_eos: bool = True, **kw) -> Sampling:
        return Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, **kw)

    def with_(self, **kw) -> Sampling:
        return replace(self, **kw)

    def needs(self) -> set[Capability]:
        """The capabilities this request needs."""
        caps = {C.GREEDY} if self.temperature == 0 else {C.SAMPLING}
        for used, cap in (
            (self.top_k, C.TOP_K),
            (self.top_p < 1.0, C.TOP_P),
            (self.min_p > 0, C.MIN_P),
            (self.seed is not None, C.SEED),
            (self.ignore_eos, C.IGNORE_EOS),
            (self.stop, C.STOP_STRINGS),
            (self.stop_token_ids, C.STOP_TOKEN_IDS),
            (self.min_tokens, C.MIN_TOKENS),
            (self.logprobs is not None, C.LOGPROBS),
            (self.prompt_logprobs is not None, C.PROMPT_LOGPROBS),
        ):
            if used:
                caps.add(cap)
        return caps


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when the engine does not say


@dataclass
class Result:
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | ... (engine's words, normalised to vLLM's)
    text: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, {..}, ...] per prompt token
    num_cached_tokens: int | None = None  # prefix-cache hit at admission, when the engine tells
    num_preemptions: int | None = None
    extra: dict = field(default_factory=dict)


class EngineAdapter:
    """Base class of every adapter: what the harness calls, with defaults where one makes sense.

    A subclass sets ``name`` and ``capabilities`` (a set of :class:`Capability`, or their
    values) and implements ``load`` and ``generate``. Override ``unavailable`` when the engine
    may be missing here (the run then fails and says why, instead of passing on skips), and
    ``describe`` to name the engine's version in reports.
    """

    name: ClassVar[str] = ""
    capabilities: frozenset[Capability] = frozenset()
    # the KV block size the suite uses for this engine (None: the suite's 16, which the golden
    # prompts are built around); an engine whose attention needs another sets its smallest one
    preferred_block_size: ClassVar[int | None] = None
    # engines of this kind the harness keeps loaded at once (least recently used closed first)
    max_live: ClassVar[int] = 8
    # set by load() when the engine computes in other arithmetic than the dtype it was asked for
    # (quantized weights): the comparison rules then take their delta and tolerance for it
    # (conformance.compare.DELTA / LOGPROB_TOL keys)
    arithmetic: str | None = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if isinstance(cls.__dict__.get("capabilities"), (set, frozenset, list, tuple)):
            cls.capabilities = Capability.set_of(cls.__dict__["capabilities"])

    @classmethod
    def unavailable(cls) -> str | None:
        """None when the engine can run here, else why not (a missing package, server, GPU)."""
        return None

    @classmethod
    def describe(cls) -> str:
        """The engine and its version, for reports."""
        return cls.name

    def load(self, model_dir: str, **knobs) -> None:
        """Load the HF model directory ``model_dir`` with engine-agnostic ``knobs``."""
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], params: list[Sampling]) -> list[Result]:
        """One Result per prompt, in input order; params holds one Sampling per prompt."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Engine-wide counters, each only where the engine tells: "preemptions", "cached_tokens";
        "steps" (engine steps so far: the chunked-prefill check sees its token budget applied),
        "tensor_parallel_size" (the ranks running: the TP checks see the knob took effect),
        "pipelined_steps" (steps queued before the previous one's tokens were read back: the async
        scheduling check sees the overlap happen). A check that finds a counter missing records
        "not reported" and checks the rest; a wrong value fails it."""
        return {}

    def close(self) -> None:
        """Release the engine (processes, memory); the adapter may be loaded again."""

    # helpers for subclasses
    def check_knobs(self, knobs: dict) -> None:
        check_knobs(self.name, self.capabilities, knobs)

    def check_params(self, params: Sequence[Sampling]) -> None:
        check_params(self.capabilities, params)


def check_knobs(name: str, capabilities, knobs: dict) -> None:
    """Raise Unsupported for a knob the engine cannot take (None values mean 'default')."""
    for knob, value in knobs.items():
        if value is None or knob in ALWAYS_KNOBS:
            continue
        cap = KNOB_CAPABILITY.get(knob)
        if cap is None:
            raise TypeError(f"unknown engine knob {knob!r}; known: {sorted(KNOB_CAPABILITY) + sorted(ALWAYS_KNOBS)}")
        if cap not in capabilities:
            raise Unsupported(cap, f"knob {knob}={value!r}")


def check_params(capabilities, params: Sequence[Sampling]) -> None:
    for p in params:
        missing = sorted(p.needs() - set(capabilities), key=lambda c: c.value)
        if missing:
            raise Unsupported(missing[0], f"needed by {p}")


def cut_at_stop_string(text: str, stops, include: bool) -> tuple[str, str | None]:
    """(text up to the earliest stop string, that string), vLLM's way: the stop string is cut
    (or kept, ``include``) and nothing after it remains; (text, None) when none occurs."""
    best = None
    for s in stops:
        i = text.find(s)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s)] if include else text[:i], s
