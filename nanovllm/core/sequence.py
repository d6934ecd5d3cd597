"""Sequence: one request's tokens, status, block table and counters. Pure Python."""

from __future__ import annotations

import enum
import time

from nanovllm.outputs import RequestMetrics
from nanovllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not holding blocks; never ran, or preempted
    RUNNING = "running"  # holds blocks; scheduled each step it fits
    FINISHED = "finished"


class Sequence:
    """A request as the scheduler sees it.

    Invariants: ``0 <= num_computed_tokens <= num_tokens``; the K/V of tokens
    ``[0, num_computed_tokens)`` are written in the blocks of ``block_table``
    (block i holds positions ``[i*bs, (i+1)*bs)``); a WAITING sequence holds no
    blocks and ``num_computed_tokens == 0``. ``block_hashes[i]`` is the chain
    hash of block i, known once the block is full *and* computed.

    Logits processing (``params.has_logits_processing``): ``bad_words_token_ids`` are the
    request's bad words as token sequences (``core/bad_words.py``); ``needs_token_history``
    says that sampling reads the tokens so far (penalties, multi-token bad words), so the
    engine never leaves a placeholder in them. ``parent`` is the ParentRequest of a child
    of an ``n > 1`` request (``engine/parallel_sampling.py``), else None.

    Async scheduling: ``num_placeholders`` (0 or 1) tokens at the end are being drawn by the
    step in flight (by its sample row ``pending_row``); they count in ``num_tokens`` (the next
    step computes their K/V, reading the token on the device) but are not in ``token_ids``.
    """

    __slots__ = (
        "seq_id",
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_table",
        "block_hashes",
        "status",
        "params",
        "num_cached_tokens",
        "num_preemptions",
        "prompt",
        "arrival",
        "finish_reason",
        "stop_reason",
        "output_logprobs",
        "cumulative_logprob",
        "prompt_logprobs",
        "output_text",
        "stop_token_ids",
        "num_placeholders",
        "pending_row",
        "metrics",
        "bad_words_token_ids",
        "logits_processing",
        "needs_token_history",
        "parent",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        bad_words_token_ids: list[list[int]] | None = None,
        parent=None,
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.status = SequenceStatus.WAITING
        self.params = params
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 = not admitted yet
        self.num_preemptions = 0
        self.prompt = prompt
        self.arrival = arrival
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_logprobs: list | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # [None] for the first prompt token, then one (target, entry) per prompt position recorded
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.output_text = ""
        # the ids that end this request: its stop_token_ids, and the model's EOS ids unless ignore_eos
        self.stop_token_ids: frozenset[int] = frozenset(params.stop_token_ids).union(  # type: ignore[arg-type]
            () if params.ignore_eos else eos_token_ids
        )
        self.num_placeholders = 0
        self.pending_row: int | None = None
        self.metrics = RequestMetrics(arrival_time=time.time())  # timestamps, set by the engine
        self.bad_words_token_ids: list[list[int]] = list(bad_words_token_ids or [])
        self.logits_processing: bool = params.has_logits_processing
        self.needs_token_history: bool = params.has_penalties or any(len(w) > 1 for w in self.bad_words_token_ids)
        self.parent = parent

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_prompt_logprobs_recorded(self) -> int:
        """Prompt positions whose logprobs are recorded (position 0 has none: it counts as done)."""
        return len(self.prompt_logprobs) if self.prompt_logprobs is not None else 0

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def add_placeholder(self, sample_row: int) -> None:
        """Async scheduling: the step in flight draws this sequence's next token in ``sample_row``."""
        assert self.num_placeholders == 0, f"{self} already waits for a token"
        self.num_placeholders = 1
        self.pending_row = sample_row

    def drop_placeholder(self) -> None:
        self.num_placeholders = 0
        self.pending_row = None
