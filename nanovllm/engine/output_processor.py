"""After a token is sampled: stop checks, detokenization, RequestOutput construction."""
from __future__ import annotations

from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput


def _decode(tokenizer, token_ids: list[int], skip_special_tokens: bool) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def reaches_length_limit(seq: Sequence, max_model_len: int) -> bool:
    """Whether seq, with its last token (known or not), has reached max_tokens or max_model_len."""
    max_tokens = seq.params.max_tokens
    return (max_tokens is not None and seq.num_output_tokens >= max_tokens) or seq.num_tokens >= max_model_len


def check_stop(seq: Sequence, tokenizer, max_model_len: int) -> None:
    """Set seq.finish_reason / stop_reason if the token just appended ends it.

    Order: stop tokens (EOS unless ignore_eos, stop_token_ids) and stop strings
    count only once min_tokens are out; then max_tokens and max_model_len give
    "length". A stop string cuts the text before it (or after it, with
    include_stop_str_in_output).
    """
    params = seq.params
    token = seq.token_ids[-1]
    n_out = seq.num_output_tokens
    if n_out >= params.min_tokens:
        if token in seq.stop_token_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in params.stop_token_ids else None
            return
        if params.stop:
            text = _decode(tokenizer, seq.output_token_ids, params.skip_special_tokens)
            new_chars = max(len(text) - len(seq.output_text), 0)
            seq.output_text = text
            for stop in params.stop:
                idx = text.find(stop, max(len(text) - new_chars - len(stop) + 1, 0))
                if idx != -1:
                    end = idx + len(stop) if params.include_stop_str_in_output else idx
                    seq.output_text = text[:end]
                    seq.finish_reason = "stop"
                    seq.stop_reason = stop
                    return
    if reaches_length_limit(seq, max_model_len):
        seq.finish_reason = "length"


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
        text = _decode(tokenizer, seq.output_token_ids, params.skip_special_tokens)
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
