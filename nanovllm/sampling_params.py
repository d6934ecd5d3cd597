"""SamplingParams: vLLM's field names and meanings, validated once at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RequestOutputKind(enum.Enum):
    """Which outputs a request reports while it runs (vLLM's names).

    CUMULATIVE: every step that produces tokens reports everything so far (text, token ids,
    logprobs); DELTA: each report holds only what is new since the last one; FINAL_ONLY: one
    report, when the request finishes (what ``LLM.generate`` uses).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# completions per request: each is a child request, made before any runs (n = 2**31 never returned)
MAX_N = 4096
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a seed is a 64-bit integer (vLLM's range); torch's generators take it


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion ``index`` of a request with ``seed`` and n > 1: ``seed + index``,
    wrapped around into the 64-bit range (``SEED_MAX + 1`` is ``SEED_MIN``), so every child's seed
    is one a SamplingParams and the engine's generators take."""
    if seed is None:
        return None
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


def _check_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if value != value:  # NaN
        raise ValueError(f"{name} must not be NaN, got {value!r}")


def _check_token_ids(name: str, ids) -> list[int]:
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a list of token ids, got {ids!r}")
    ids = list(ids)
    for i, t in enumerate(ids):
        _check_int(f"{name}[{i}]", t)
        if t < 0:
            raise ValueError(f"{name} must hold token ids >= 0, got {t}")
    return ids


def _as_strings(name: str, value, expected: str = "a list of strings") -> list[str]:
    """``value`` (a list or other iterable of strings; a lone string is the caller's case) as a list;
    ``expected`` says what the field takes. An element that is not a string is named by its index."""
    if isinstance(value, (bytes, dict)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    strings = list(value)
    for i, s in enumerate(strings):
        if not isinstance(s, str):
            raise TypeError(f"{name}[{i}] must be a string, got {s!r} ({type(s).__name__})")
    return strings


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop (vLLM's fields and meanings).

    temperature 0 means greedy. top_k 0 or -1 means no top-k filter. logprobs=k
    returns the top-k log-probabilities (of the raw model distribution) of each
    generated token, plus the sampled token's when it is not among them;
    prompt_logprobs=k does the same for every prompt token after the first.

    Logits processing, in vLLM's order, before temperature and the filters (and for greedy
    rows too): only ``allowed_token_ids`` may be drawn; ``bad_words`` are banned (a word's
    last token, when the tokens before it end the output so far); ``logit_bias`` is added;
    ``repetition_penalty`` divides the positive logits and multiplies the negative ones of
    every token in the prompt or the output; ``frequency_penalty`` x (times the token was
    generated) and ``presence_penalty`` x (whether it was) are subtracted (output tokens
    only). ``n`` completions per request: each is an independent child request; with a seed,
    child i draws with seed + i (reproducible, and independent of its siblings).

    output_kind: what ``LLMEngine.step`` reports while the request runs (RequestOutputKind).
    """

    temperature: float = 1.0
    """Randomness: the logits are divided by it; 0 means greedy."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 or -1: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p, in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one, in [0, 1]."""
    seed: int | None = None
    """Per-request seed: the request's tokens then depend on nothing else (None: the engine's noise)."""
    max_tokens: int | None = 16
    """Most tokens to generate (None: up to max_model_len)."""
    min_tokens: int = 0
    """Fewest tokens to generate before EOS or a stop token may end the request."""
    stop: str | list[str] | None = None
    """Strings that end the request when generated (not included in the text by default)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the request when generated."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the request in its text."""
    ignore_eos: bool = False
    """Keep generating after the model's EOS token."""
    logprobs: int | None = None
    """Return the log-probabilities of the top-k tokens (and of the sampled one) at each output position."""
    prompt_logprobs: int | None = None
    """Return the top-k log-probabilities at each prompt position after the first."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    n: int = 1
    """Completions per request (independent child requests; needs temperature > 0)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted once per time a token was already generated, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """> 1 discourages, < 1 encourages tokens of the prompt and the output (positive logits are
    divided by it, negative ones multiplied)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a value added to its logit."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be generated (None: all)."""
    bad_words: list[str] | None = None
    """Words that must not be generated (their last token is banned when the output ends with
    the tokens before it)."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    """What LLMEngine.step reports while the request runs (LLM.generate: FINAL_ONLY)."""

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("seed", self.seed, allow_none=True)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit integer, in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        _check_int("max_tokens", self.max_tokens, allow_none=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, max_tokens={self.max_tokens}"
            )
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _as_strings("stop", self.stop, "a string or a list of strings")
        for s in self.stop:
            if not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check_int(name, value, allow_none=True)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.n > 1 and self.temperature < 1e-5:
            raise ValueError(f"n must be 1 when using greedy sampling (temperature 0), got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                _check_int("logit_bias key", t)
                if t < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {t}")
                _check_number(f"logit_bias[{t}]", b)
                if b in (float("inf"), float("-inf")):
                    raise ValueError(f"logit_bias[{t}] must be finite, got {b}")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token), got []")
        if self.bad_words is None:
            self.bad_words = []
        elif isinstance(self.bad_words, str):
            raise TypeError(f"bad_words must be a list of strings, got the string {self.bad_words!r}")
        else:
            self.bad_words = list(dict.fromkeys(_as_strings("bad_words", self.bad_words)))
        for w in self.bad_words:
            if not w.strip():
                raise ValueError(f"bad_words must hold non-empty strings, got {w!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(
                f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), got {self.output_kind!r}"
            )

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty reads the request's tokens (so each step needs its history)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_logits_processing(self) -> bool:
        """Whether any logits processing beyond temperature and the filters applies."""
        return self.has_penalties or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)
