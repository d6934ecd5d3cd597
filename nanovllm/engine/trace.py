"""Structured per-step events: what the scheduler decided and what the step produced.

Tests read them (preemptions happened, chunk bounds, cache hits); people read
them through ``nanovllm generate --trace`` to watch a scheduler work.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqStep:
    request_id: str
    phase: str               # "prefill" (incl. recompute after preemption) | "decode"
    num_new_tokens: int
    num_computed_before: int  # tokens whose K/V were already cached before this step
    num_tokens: int           # prompt + generated so far
    block_ids: list[int]
    num_cached_tokens: int | None = None  # prefix-cache hit, set when admitted this step


@dataclass
class StepEvent:
    step: int
    kind: str                 # "prefill" | "decode" | "mixed"
    seqs: list[SeqStep]
    preempted: list[str] = field(default_factory=list)
    finished: list[tuple[str, str]] = field(default_factory=list)  # (request_id, finish_reason)
    num_free_blocks: int = 0
    num_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    def format(self) -> str:
        head = (f"step {self.step:>4} {self.kind:<7} tokens={self.num_tokens:<5} seqs={len(self.seqs):<3} "
                f"free_blocks={self.num_free_blocks}/{self.num_blocks}")
        lines = [head]
        for s in self.seqs:
            hit = f" cache_hit={s.num_cached_tokens}" if s.num_cached_tokens else ""
            span = f"[{s.num_computed_before}:{s.num_computed_before + s.num_new_tokens})"
            lines.append(f"    {s.request_id:<10} {s.phase:<7} {span:<13} of {s.num_tokens:<5}"
                         f" blocks={_short(s.block_ids)}{hit}")
        if self.preempted:
            lines.append(f"    preempted: {', '.join(self.preempted)}")
        for rid, reason in self.finished:
            lines.append(f"    finished: {rid} ({reason})")
        return "\n".join(lines)


def _short(ids: list[int], limit: int = 12) -> str:
    if len(ids) <= limit:
        return str(ids)
    return "[" + ", ".join(map(str, ids[:limit // 2])) + f", ... {len(ids) - limit} more ..., " + \
        ", ".join(map(str, ids[-limit // 2:])) + "]"


class Tracer:
    """Collects StepEvents when enabled; an optional callback sees each one."""

    def __init__(self, enabled: bool = False, callback=None, max_events: int | None = None):
        self.enabled = enabled or callback is not None
        self.callback = callback
        self.max_events = max_events
        self.events: list[StepEvent] = []

    def record(self, event: StepEvent) -> None:
        if self.callback is not None:
            self.callback(event)
        self.events.append(event)
        if self.max_events is not None and len(self.events) > self.max_events:
            del self.events[0]

    def clear(self) -> None:
        self.events.clear()
