"""Bad words: tokenization as vLLM does it, and which last token is banned after which output."""

from __future__ import annotations

import pytest

from nanovllm.core.bad_words import bad_words_token_ids, banned_by_bad_words

from .conftest import CharTokenizer


class MergingTokenizer(CharTokenizer):
    """Like CharTokenizer, but " x" is one token (100 + x) instead of two."""

    def encode(self, text, add_special_tokens=True):
        ids = super().encode(text, add_special_tokens=add_special_tokens)
        bos, ids = (ids[:1], ids[1:]) if add_special_tokens else ([], ids)
        if ids and ids[0] == 27 and len(ids) > 1:
            ids = [100 + ids[1]] + ids[2:]
        return bos + ids


def test_plain_and_spaced_variants():
    # " ab" is 27, 0, 1 with CharTokenizer: longer than "ab", so only the plain form is kept
    assert bad_words_token_ids(CharTokenizer(), ["ab"]) == [[0, 1]]
    # with a tokenizer that merges the space, " ab" -> [100, 1]: same length, another first token
    assert bad_words_token_ids(MergingTokenizer(), ["ab", "  c"]) == [[0, 1], [100, 1], [2], [102]]


def test_no_special_tokens_in_the_words():
    """The words are tokenized without BOS (a banned BOS prefix would never match the output)."""
    assert CharTokenizer().encode("ab") == [CharTokenizer.BOS, 0, 1]
    out = bad_words_token_ids(MergingTokenizer(), ["b"])
    assert out == [[1], [101]]


def test_spaced_variant_with_the_same_first_token_is_dropped():
    class SameFirst(CharTokenizer):
        def encode(self, text, add_special_tokens=True):
            return super().encode(text.lstrip(), add_special_tokens=add_special_tokens)

    assert bad_words_token_ids(SameFirst(), ["ab"]) == [[0, 1]]


def test_empty_spaced_variant_is_dropped():
    class EmptySpaced(CharTokenizer):
        def encode(self, text, add_special_tokens=True):
            return [] if text.startswith(" ") else super().encode(text, add_special_tokens=add_special_tokens)

    assert bad_words_token_ids(EmptySpaced(), ["ab"]) == [[0, 1]]


def test_word_without_tokens_is_an_error():
    class Empty(CharTokenizer):
        def encode(self, text, add_special_tokens=True):
            return []

    with pytest.raises(ValueError, match="bad_words entries must tokenize to at least one token, got 'zz'"):
        bad_words_token_ids(Empty(), ["zz"])


def test_results_are_lists():
    class TupleTok(MergingTokenizer):
        def encode(self, text, add_special_tokens=True):
            return tuple(super().encode(text, add_special_tokens=add_special_tokens))

    out = bad_words_token_ids(TupleTok(), ["ab"])
    assert out == [[0, 1], [100, 1]] and all(type(w) is list for w in out)


@pytest.mark.parametrize(
    "words,output,banned",
    [
        ([[7]], [], [7]),  # a single token is banned always
        ([[7]], [1, 2], [7]),
        ([[1, 7]], [], []),  # its prefix is not out yet
        ([[1, 7]], [1], [7]),
        ([[1, 7]], [1, 2], []),
        ([[1, 2, 7]], [1, 2], [7]),
        ([[1, 2, 7]], [9, 1, 2], [7]),
        ([[1, 2, 7]], [2], []),  # shorter output than the prefix
        ([[1, 2, 7]], [1, 3], []),
        ([[1, 7], [2, 8], [9]], [2], [8, 9]),
        ([[1, 7], [1, 8]], [5, 1], [7, 8]),
        ([[1, 2, 7], [8]], [2], [8]),  # a word longer than the output does not end the scan
    ],
)
def test_banned_by_bad_words(words, output, banned):
    assert banned_by_bad_words(words, output) == banned
