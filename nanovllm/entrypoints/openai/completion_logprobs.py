"""OpenAI's legacy ``logprobs`` object of /v1/completions: ``tokens``, ``token_logprobs``,
``top_logprobs`` and ``text_offset``, one entry per token.

With ``echo`` the object covers the prompt's tokens first, then the completion's (what
log-likelihood evaluations read, e.g. lm-eval's ``loglikelihood`` with ``echo=true,
max_tokens=0|1, logprobs=1``). The prompt's first token has nothing before it to be scored
against: its logprob and its top logprobs are null, as in OpenAI's and vLLM's answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from nanovllm.outputs import CompletionOutput, Logprob, LogprobsDict, RequestOutput

LOGPROB_FLOOR = -9999.0  # -inf is not JSON: vLLM's floor


def token_name(token_id: int, decoded: str | None, as_id: bool) -> str:
    """A logprob entry's token: its text, or vLLM's ``token_id:N`` (return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_id else (decoded or "")


def most_likely(entry: LogprobsDict, token_id: int, k: int | None) -> dict[int, Logprob]:
    """``entry`` kept to its k most likely tokens and ``token_id`` itself (all of it for k None)."""
    if k is None:
        return dict(entry)
    return {t: lp for t, lp in entry.items() if lp.rank <= k or t == token_id}


def _legacy(
    tokens_and_entries: Iterable[tuple[int, LogprobsDict | None]],
    offset: int,
    as_ids: bool,
    k: int | None,
    decode: Callable[[int], str],
) -> tuple[dict, int]:
    """The object, and the offset after its last token."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict | None] = []
    offsets: list[int] = []
    for token_id, entry in tokens_and_entries:
        if entry is None:  # the prompt's first token
            text, logprob, top_entry = decode(token_id), None, None
        else:
            own = entry[token_id]
            text, logprob = own.decoded_token or "", max(own.logprob, LOGPROB_FLOOR)
            top_entry = {
                token_name(t, lp.decoded_token, as_ids): max(lp.logprob, LOGPROB_FLOOR)
                for t, lp in sorted(most_likely(entry, token_id, k).items(), key=lambda kv: kv[1].rank)
            }
        tokens.append(token_name(token_id, text, as_ids))
        token_logprobs.append(logprob)
        top.append(top_entry)
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}, offset


def completion_logprobs(c: CompletionOutput, offset: int, as_ids: bool = False) -> tuple[dict | None, int]:
    """The object for the tokens of ``c`` (text offsets from ``offset``; ``as_ids``: tokens and
    top_logprobs keys as ``token_id:N``), None where ``c`` has no logprobs; and the offset after
    its tokens, where a stream's next chunk goes on (so streamed offsets equal the whole answer's)."""
    if c.logprobs is None:
        return None, offset
    return _legacy(zip(c.token_ids, c.logprobs), offset, as_ids, None, str)


def prompt_logprobs_legacy(out: RequestOutput, k: int, as_ids: bool, decode: Callable[[int], str]) -> tuple[dict, int]:
    """The object for the prompt's tokens (echo), from offset 0, each top dict kept to ``k``
    (the engine may have computed more for the request's own ``prompt_logprobs``), and the text
    offset the completion's tokens go on from. ``decode`` names the first token, which has no
    entry. Offsets add up the tokens' own texts, as vLLM's do (one token's decode may differ from
    its share of the whole prompt's, e.g. a space between words)."""
    entries = out.prompt_logprobs
    if entries is None or len(entries) != len(out.prompt_token_ids):
        raise RuntimeError(f"request {out.request_id}: the engine returned no prompt logprobs to echo")
    return _legacy(zip(out.prompt_token_ids, entries), 0, as_ids, k, decode)


def joined(first: dict, then: dict | None) -> dict:
    """Two objects one after the other (the echoed prompt's, then the completion's)."""
    if then is None:
        return first
    return {key: first[key] + then[key] for key in first}
