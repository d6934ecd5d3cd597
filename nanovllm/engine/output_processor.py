"""A sequence's state -> RequestOutput: recorded logprobs, detokenized text, metrics.

A request with ``output_kind`` FINAL_ONLY gets one output, built when it finishes (its text is
one decode of all its tokens: no per-step cost). A streaming one (CUMULATIVE or DELTA) has a
``StreamState``: an incremental detokenizer and what was reported so far. Its text holds back
an incomplete character and any end that may still become a stop string; once it finishes,
its text is exactly the FINAL_ONLY text (so streaming and non-streaming agree), and for DELTA
the pieces add up to it.
"""

from __future__ import annotations

import logging

from nanovllm.core.sequence import Sequence
from nanovllm.core.stop import decode
from nanovllm.engine.detokenizer import IncrementalDetokenizer, stop_prefix_len
from nanovllm.outputs import CompletionOutput, Logprob, LogprobsDict, RequestMetrics, RequestOutput
from nanovllm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


def _logprob_dict(tokenizer, sampled: int, entry) -> dict[int, Logprob]:
    sampled_lp, sampled_rank, top = entry
    out = {tok: Logprob(lp, rank, None) for rank, (tok, lp) in enumerate(top, start=1)}
    if sampled not in out:
        out[sampled] = Logprob(sampled_lp, sampled_rank, None)
    if tokenizer is not None:
        for tok, lp in out.items():
            lp.decoded_token = tokenizer.decode([tok])
    return out


def record_logprobs(seq: Sequence, token: int, entry) -> None:
    if entry is None:
        return
    seq.cumulative_logprob += entry[0]
    if seq.output_logprobs is not None:
        seq.output_logprobs.append((token, entry))


def record_prompt_logprobs(seq: Sequence, targets_and_entries) -> None:
    if seq.prompt_logprobs is not None:
        seq.prompt_logprobs.extend(targets_and_entries)


def final_text(seq: Sequence, tokenizer) -> str:
    """A finished request's text: cut at its stop string, else one decode of its tokens."""
    if seq.stop_reason is not None and isinstance(seq.stop_reason, str):
        return seq.output_text
    return decode(tokenizer, seq.output_token_ids, seq.params.skip_special_tokens)


def _prompt_logprobs(seq: Sequence, tokenizer) -> list[LogprobsDict | None] | None:
    if seq.prompt_logprobs is None:
        return None
    return [None] + [_logprob_dict(tokenizer, tok, entry) for tok, entry in seq.prompt_logprobs[1:]]


def _metrics(seq: Sequence) -> RequestMetrics:
    """A snapshot: the sequence's own record keeps changing while the request runs. (Copied
    through its ``__dict__``: ``dataclasses.replace`` costs several times more, and this runs
    once per request per step.)"""
    snap = RequestMetrics(**vars(seq.metrics))
    snap.num_preemptions = seq.num_preemptions
    snap.num_generation_tokens = seq.num_output_tokens
    return snap


def _request_output(seq: Sequence, completion: CompletionOutput, prompt_logprobs) -> RequestOutput:
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        outputs=[completion],
        finished=seq.finish_reason is not None,
        num_cached_tokens=max(seq.num_cached_tokens, 0),
        prompt_logprobs=prompt_logprobs,
        metrics=_metrics(seq),
    )


def make_request_output(seq: Sequence, tokenizer) -> RequestOutput:
    """The whole output of a request (FINAL_ONLY, or any request without a StreamState)."""
    params = seq.params
    logprobs = None
    if seq.output_logprobs is not None:
        logprobs = [_logprob_dict(tokenizer, tok, entry) for tok, entry in seq.output_logprobs]
    completion = CompletionOutput(
        index=0,
        text=final_text(seq, tokenizer),
        token_ids=seq.output_token_ids,
        cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
    return _request_output(seq, completion, _prompt_logprobs(seq, tokenizer))


class StreamState:
    """What a streaming request (CUMULATIVE or DELTA) has reported so far."""

    __slots__ = ("detokenizer", "logprobs", "num_tokens_sent", "text_sent", "prompt_logprobs")

    def __init__(self, seq: Sequence, tokenizer):
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.params.skip_special_tokens)
        self.logprobs: list[LogprobsDict] | None = [] if seq.output_logprobs is not None else None
        self.num_tokens_sent = 0  # output tokens already in an output
        self.text_sent = ""  # the visible text already in an output
        self.prompt_logprobs: list | None = None  # built with the first output (the prompt is done then)

    def visible_text(self, seq: Sequence, tokenizer) -> str:
        """The text a report may show now. While the request runs, the detokenizer's text
        less an end that may still become a stop string (cut from the final text)."""
        if seq.finish_reason is not None:
            return final_text(seq, tokenizer)
        text = self.detokenizer.output_text
        params = seq.params
        if params.stop and not params.include_stop_str_in_output:
            hold = stop_prefix_len(text, params.stop)  # type: ignore[arg-type]  # a list after __post_init__
            if hold:
                text = text[:-hold]
        return text


def make_stream_output(seq: Sequence, tokenizer, state: StreamState) -> RequestOutput:
    """The next output of a streaming request: everything so far (CUMULATIVE) or what is new
    since the last one (DELTA)."""
    params = seq.params
    delta = params.output_kind is RequestOutputKind.DELTA
    finished = seq.finish_reason is not None
    start = seq.num_prompt_tokens + state.num_tokens_sent
    new_ids = seq.token_ids[start:]
    if not finished:
        state.detokenizer.update(new_ids)
    text = state.visible_text(seq, tokenizer)
    sent = state.text_sent
    if not text.startswith(sent):  # the final decode disagrees with the incremental one
        logger.warning(
            "request %r: incremental text %r is not a prefix of the final text %r", seq.request_id, sent, text
        )
    text_delta = text[len(sent) :] if len(text) > len(sent) else ""
    state.text_sent = text if len(text) >= len(sent) else sent

    if state.logprobs is not None:
        assert seq.output_logprobs is not None  # a request with logprobs records them
        state.logprobs += [
            _logprob_dict(tokenizer, tok, entry) for tok, entry in seq.output_logprobs[len(state.logprobs) :]
        ]
    logprobs = None
    if state.logprobs is not None:
        logprobs = state.logprobs[state.num_tokens_sent :] if delta else list(state.logprobs)
    first = state.prompt_logprobs is None
    if first:
        state.prompt_logprobs = _prompt_logprobs(seq, tokenizer) or []
    prompt_logprobs = state.prompt_logprobs if (first or not delta) and seq.prompt_logprobs is not None else None
    state.num_tokens_sent += len(new_ids)
    completion = CompletionOutput(
        index=0,
        text=text_delta if delta else (text if finished else state.text_sent),
        token_ids=list(new_ids) if delta else seq.output_token_ids,
        cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
    return _request_output(seq, completion, prompt_logprobs)
