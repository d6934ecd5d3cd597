"""Stop rules: after a token is appended, does the request end, and why.

Order: stop tokens (the request's EOS ids unless ignore_eos, and stop_token_ids) and stop
strings count only once ``min_tokens`` are out; then ``max_tokens`` and ``max_model_len``
give "length". A stop string cuts the text before it (or after it, with
``include_stop_str_in_output``). Pure Python: the tokenizer is passed in.
"""

from __future__ import annotations

from nanovllm.core.sequence import Sequence


def decode(tokenizer, token_ids: list[int], skip_special_tokens: bool) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def reaches_length_limit(seq: Sequence, max_model_len: int) -> bool:
    """Whether seq, with its last token (known or a placeholder), has reached max_tokens or
    max_model_len."""
    max_tokens = seq.params.max_tokens
    return (max_tokens is not None and seq.num_output_tokens >= max_tokens) or seq.num_tokens >= max_model_len


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last ``num_new_chars`` characters of
    ``text``: (its index, the string), or None."""
    found = None
    for stop in stops:
        idx = text.find(stop, max(len(text) - num_new_chars - len(stop) + 1, 0))
        if idx != -1 and (found is None or idx < found[0]):
            found = (idx, stop)
    return found


def check_stop(seq: Sequence, tokenizer, max_model_len: int) -> None:
    """Set seq.finish_reason / stop_reason if the token just appended ends it.

    As in vLLM: a stop token counts once ``min_tokens`` tokens are out (the sampler bans stop
    tokens before that, so the first one can come at output index ``min_tokens``); a stop string
    counts only in the text of more than ``min_tokens`` tokens.
    """
    params = seq.params
    token = seq.token_ids[-1]
    n_out = seq.num_output_tokens
    if n_out >= params.min_tokens and token in seq.stop_token_ids:
        seq.finish_reason = "stop"
        seq.stop_reason = token if token in params.stop_token_ids else None  # type: ignore[operator]
        return
    if params.stop:
        text = decode(tokenizer, seq.output_token_ids, params.skip_special_tokens)
        new_chars = max(len(text) - len(seq.output_text), 0)
        seq.output_text = text
        # only text that this token added can complete a stop string, and none before min_tokens
        hit = find_stop_string(text, new_chars, params.stop) if n_out > params.min_tokens else None  # type: ignore[arg-type]
        if hit is not None:
            idx, stop = hit
            end = idx + len(stop) if params.include_stop_str_in_output else idx
            seq.output_text = text[:end]
            seq.finish_reason = "stop"
            seq.stop_reason = stop
            return
    if reaches_length_limit(seq, max_model_len):
        seq.finish_reason = "length"
