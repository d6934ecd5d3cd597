"""A sequence's state -> RequestOutput: recorded logprobs, detokenized text."""
from __future__ import annotations

from nanovllm.core.sequence import Sequence
from nanovllm.core.stop import decode
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput


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


def make_request_output(seq: Sequence, tokenizer) -> RequestOutput:
    params = seq.params
    if seq.stop_reason is not None and isinstance(seq.stop_reason, str):
        text = seq.output_text
    else:
        text = decode(tokenizer, seq.output_token_ids, params.skip_special_tokens)
    logprobs = None
    if seq.output_logprobs is not None:
        logprobs = [_logprob_dict(tokenizer, tok, entry) for tok, entry in seq.output_logprobs]
    prompt_logprobs = None
    if seq.prompt_logprobs is not None:
        prompt_logprobs = [None] + [_logprob_dict(tokenizer, tok, entry) for tok, entry in seq.prompt_logprobs[1:]]
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=seq.output_token_ids,
        cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        outputs=[completion],
        finished=seq.finish_reason is not None,
        num_cached_tokens=max(seq.num_cached_tokens, 0),
        prompt_logprobs=prompt_logprobs,
        metrics={"num_preemptions": seq.num_preemptions},
    )
