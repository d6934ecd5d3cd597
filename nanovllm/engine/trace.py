"""Structured per-step events: what the scheduler decided and what the step produced.

Tests read them (preemptions happened, chunk bounds, cache hits); people read
them through ``nanovllm generate --trace`` to watch a scheduler work, and
``nanovllm trace --html`` / ``nanovllm experiment`` turn them into pages and plots
(``to_dict`` is the JSON form; ``summarize_requests`` the per-request view).

Each event carries ``t_start`` (taken when the event is built, as the step is
scheduled and launched) and ``t_end`` (when its outputs were applied and it was
recorded), both ``time.perf_counter()`` seconds: step times and time to first
token come from them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class SeqStep:
    request_id: str
    phase: str  # "prefill" (incl. recompute after preemption) | "decode"
    num_new_tokens: int
    num_computed_before: int  # tokens whose K/V were already cached before this step
    num_tokens: int  # prompt + generated so far
    block_ids: list[int]
    num_cached_tokens: int | None = None  # prefix-cache hit, set when admitted this step
    recompute: bool = False  # a prefill of a request preempted at an earlier step (set by Tracer.record)

    @property
    def samples(self) -> bool:
        """This step reaches the sequence's last known token, so it samples the next one
        (a prefill chunk that stops short of the end samples nothing)."""
        return self.num_computed_before + self.num_new_tokens == self.num_tokens


@dataclass
class StepEvent:
    step: int
    kind: str  # "prefill" | "decode" | "mixed"
    seqs: list[SeqStep]
    preempted: list[str] = field(default_factory=list)
    finished: list[tuple[str, str]] = field(default_factory=list)  # (request_id, finish_reason)
    num_free_blocks: int = 0
    num_blocks: int = 0
    t_start: float = field(default_factory=time.perf_counter)
    t_end: float | None = None  # set by Tracer.record

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def duration(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_start

    def to_dict(self) -> dict:
        """A JSON-ready dict (the trace viewer's step record)."""
        d = asdict(self)
        d["finished"] = [list(f) for f in self.finished]
        d["num_tokens"] = self.num_tokens
        return d

    def format(self) -> str:
        head = (
            f"step {self.step:>4} {self.kind:<7} tokens={self.num_tokens:<5} seqs={len(self.seqs):<3} "
            f"free_blocks={self.num_free_blocks}/{self.num_blocks}"
        )
        lines = [head]
        for s in self.seqs:
            hit = f" cache_hit={s.num_cached_tokens}" if s.num_cached_tokens else ""
            span = f"[{s.num_computed_before}:{s.num_computed_before + s.num_new_tokens})"
            phase = "recompute" if s.recompute else s.phase
            lines.append(
                f"    {s.request_id:<10} {phase:<9} {span:<13} of {s.num_tokens:<5} blocks={_short(s.block_ids)}{hit}"
            )
        if self.preempted:
            lines.append(f"    preempted: {', '.join(self.preempted)}")
        for rid, reason in self.finished:
            lines.append(f"    finished: {rid} ({reason})")
        return "\n".join(lines)


def _short(ids: list[int], limit: int = 12) -> str:
    if len(ids) <= limit:
        return str(ids)
    return (
        "["
        + ", ".join(map(str, ids[: limit // 2]))
        + f", ... {len(ids) - limit} more ..., "
        + ", ".join(map(str, ids[-limit // 2 :]))
        + "]"
    )


@dataclass
class RequestSummary:
    """One request's life read off the events: steps, sampled tokens, times (perf_counter s)."""

    request_id: str
    first_step: int  # first step that computed it
    first_token_step: int | None  # first step that sampled a token for it
    finish_step: int | None
    finish_reason: str | None
    num_sampled: int  # steps that sampled a token for it
    num_prefill_chunks: int  # prefill steps before its first preemption
    num_recompute_steps: int  # prefill steps after a preemption
    num_preemptions: int
    num_cached_tokens: int  # prefix-cache hit tokens at its first admission
    t_first_scheduled: float
    t_first_token: float | None
    t_finish: float | None


def summarize_requests(events: list[StepEvent]) -> dict[str, RequestSummary]:
    """Per-request summaries, in order of first appearance. A step's token counts once it is
    recorded (``t_end``); a request whose output was discarded (aborted in flight) may have
    ``num_sampled`` one above its output length."""
    out: dict[str, RequestSummary] = {}
    for ev in events:
        t_end = ev.t_end if ev.t_end is not None else ev.t_start
        for s in ev.seqs:
            r = out.get(s.request_id)
            if r is None:
                r = out[s.request_id] = RequestSummary(
                    s.request_id,
                    ev.step,
                    None,
                    None,
                    None,
                    0,
                    0,
                    0,
                    0,
                    s.num_cached_tokens or 0,
                    ev.t_start,
                    None,
                    None,
                )
            if s.recompute:
                r.num_recompute_steps += 1
            elif s.phase == "prefill":
                r.num_prefill_chunks += 1
            if s.samples:
                r.num_sampled += 1
                if r.first_token_step is None:
                    r.first_token_step, r.t_first_token = ev.step, t_end
        for rid in ev.preempted:
            if rid in out:
                out[rid].num_preemptions += 1
        for rid, reason in ev.finished:
            if rid in out:
                out[rid].finish_step, out[rid].finish_reason, out[rid].t_finish = ev.step, reason, t_end
    return out


class Tracer:
    """Collects StepEvents when enabled; an optional callback sees each one. It marks each
    prefill of a request preempted at an earlier step as a recompute (``SeqStep.recompute``)."""

    def __init__(self, enabled: bool = False, callback=None, max_events: int | None = None):
        self.enabled = enabled or callback is not None
        self.callback = callback
        self.max_events = max_events
        self.events: list[StepEvent] = []
        self._preempted: set[str] = set()  # requests preempted and not finished yet

    def record(self, event: StepEvent) -> None:
        if event.t_end is None:
            event.t_end = time.perf_counter()
        for s in event.seqs:
            s.recompute = s.phase == "prefill" and s.request_id in self._preempted
        self._preempted.update(event.preempted)
        self._preempted.difference_update(rid for rid, _ in event.finished)
        if self.callback is not None:
            self.callback(event)
        self.events.append(event)
        if self.max_events is not None and len(self.events) > self.max_events:
            del self.events[0]

    def clear(self) -> None:
        self.events.clear()
