"""Incremental detokenization: a request's text, token by token, for streaming outputs.

Each new token decodes a short window of ids twice (the method of vLLM and of transformers'
``TextStreamer``): the text of ``ids[prefix_offset:read_offset]`` (already emitted) and that of
``ids[prefix_offset:]``; the difference is the new text. It is held back while it ends in an
incomplete UTF-8 sequence: a byte-level BPE token (SmolLM2, Qwen, Llama 3) can carry part of a
character (an emoji or a CJK character spans several tokens) and the decoder shows the missing
bytes as U+FFFD. The window starts one emitted token back, so decoders that join or merge
tokens (spaces between words, "##" pieces) give the same text as one decode of all the ids.

``stop_prefix_len`` says how much of the end of a text may still become a stop string: a
stream holds that much back until the next tokens settle it.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The text of a growing list of output token ids, one decode of a short window per update.

    Invariant: ``output_text`` is the text of ``token_ids[:read_offset]``; the tokens after
    ``read_offset`` end in an incomplete character (or decode to nothing: special tokens).
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "token_ids", "prefix_offset", "read_offset", "output_text")

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.output_text = ""

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete ('' while a character is incomplete)."""
        ids = self.token_ids
        ids.extend(new_token_ids)
        if self.tokenizer is None or not new_token_ids:
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens)
        new_text = decode(ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        self.output_text += delta
        return delta


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a stop string: text
    that the next tokens may turn into a stop string, which the output then cuts."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
