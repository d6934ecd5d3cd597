"""Bad words (vLLM's ``SamplingParams.bad_words``): words the output must not contain.

A word becomes one or two token sequences (``bad_words_token_ids``); at each step the last
token of a sequence is banned when the tokens before it end the output so far (the prompt
does not count), so a single-token word is banned at every step. Pure Python: the engine
turns the result into per-row banned tokens, next to min_tokens' stop-token bans.
"""

from __future__ import annotations


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization: each word without its leading spaces, and again with one leading
    space, the latter kept when it starts with another token and has as many tokens (so the
    word is banned at the start of the text and after a space)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
        out.append(list(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    return out


def banned_by_bad_words(bad_words: list[list[int]], output_ids: list[int]) -> list[int]:
    """The tokens banned at the next step: each bad word's last token whose prefix (the
    word's other tokens) ends ``output_ids``."""
    banned = []
    n = len(output_ids)
    for word in bad_words:
        k = len(word) - 1
        if k > n:
            continue
        if k == 0 or output_ids[n - k :] == word[:-1]:
            banned.append(word[-1])
    return banned
