"""What the engine core sends per step when it runs in its own process: token ids, not text.

An engine in "core" mode (``LLMEngine.emit_updates``) reports each sequence it would have
built a RequestOutput for as a ``SequenceUpdate``: the tokens (and logprob entries) that are
new since its last report, its finish fields and metric timestamps. Building text (incremental
detokenization, stop-string hold-back, logprob dicts with decoded tokens) is left to the front
end, which keeps a mirror ``Sequence`` of every request (``apply_update``) and builds the
RequestOutputs from it with the same functions the in-process engine uses
(``engine/output_processor.py``). So the process that runs the model does no per-token text
work, and the two paths cannot disagree on what an output holds.

Stop strings are the exception: the core must know when a request stops, so it checks them
(``core/stop.py``) and sends the text it cut (``output_text``) with the finishing update.
"""

from __future__ import annotations

from typing import NamedTuple

from nanovllm.core.sequence import Sequence


class SequenceUpdate(NamedTuple):
    """One sequence's news in one step. On the wire it is a plain tuple in this field order
    (``make_update``): pickling 256 named tuples per step cost six times as much."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list | None  # the (logprob, rank, top) entries of new_token_ids, if requested
    prompt_logprobs: list | None  # every prompt position's entry, in the sequence's first report
    finish_reason: str | None
    stop_reason: int | str | None
    output_text: str | None  # the text cut at a stop string (only when one ended it)
    cumulative_logprob: float
    num_cached_tokens: int
    times: tuple  # first_scheduled, first_token, last_token, finished (RequestMetrics), preemptions


class CoreStream:
    """What the core reported of one sequence so far."""

    __slots__ = ("num_tokens_sent", "num_logprobs_sent", "prompt_logprobs_sent")

    def __init__(self) -> None:
        self.num_tokens_sent = 0
        self.num_logprobs_sent = 0
        self.prompt_logprobs_sent = False


def make_update(seq: Sequence, state: CoreStream | None) -> tuple:
    """The sequence's update, a SequenceUpdate as a plain tuple: what is new since ``state``
    (None: everything, for a request reported once when it finishes)."""
    state = state if state is not None else CoreStream()
    outputs = seq.token_ids[seq.num_prompt_tokens + state.num_tokens_sent :]
    state.num_tokens_sent += len(outputs)
    logprobs = None
    if seq.output_logprobs is not None:
        logprobs = [entry for _, entry in seq.output_logprobs[state.num_logprobs_sent :]]
        state.num_logprobs_sent = len(seq.output_logprobs)
    prompt_logprobs = None
    if seq.prompt_logprobs is not None and not state.prompt_logprobs_sent:
        prompt_logprobs = seq.prompt_logprobs
        state.prompt_logprobs_sent = True
    m = seq.metrics
    return (
        seq.request_id,
        outputs,
        logprobs,
        prompt_logprobs,
        seq.finish_reason,
        seq.stop_reason,
        seq.output_text if isinstance(seq.stop_reason, str) else None,
        seq.cumulative_logprob,
        seq.num_cached_tokens,
        (m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time, seq.num_preemptions),
    )


def apply_update(seq: Sequence, update: tuple) -> None:
    """Bring the front end's mirror of a sequence to where the core's is (``update``: a
    SequenceUpdate, or the plain tuple of its fields)."""
    request_id, new, logprobs, prompt_logprobs, finish_reason, stop_reason, text, cumulative, cached, times = update
    if request_id != seq.request_id:
        raise ValueError(f"an update of {request_id!r} applied to {seq.request_id!r}")
    seq.token_ids += new
    if logprobs is not None and seq.output_logprobs is not None:
        if len(logprobs) != len(new):
            raise ValueError(f"{request_id!r}: {len(new)} new tokens but {len(logprobs)} logprob entries")
        seq.output_logprobs += zip(new, logprobs)
    if prompt_logprobs is not None:
        seq.prompt_logprobs = prompt_logprobs
    seq.finish_reason = finish_reason
    seq.stop_reason = stop_reason
    if text is not None:
        seq.output_text = text
    seq.cumulative_logprob = cumulative
    seq.num_cached_tokens = cached
    m = seq.metrics
    m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time, seq.num_preemptions = times
