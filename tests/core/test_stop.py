"""Stop rules (core/stop.py): stop tokens after min_tokens, stop strings in the new text only,
then max_tokens and max_model_len; the boundaries of each."""

from __future__ import annotations

import pytest

from nanovllm.core.stop import (
    check_stop,
    decode,
    find_stop_string,
    reaches_length_limit,
)

from .conftest import CharTokenizer, make_seq

TOK = CharTokenizer()
A, B, C, D = 0, 1, 2, 3  # decode to "a", "b", "c", "d"
EOS = 150  # a special token


def step(seq, token, max_model_len=1000, tokenizer=TOK):
    seq.append_token(token)
    check_stop(seq, tokenizer, max_model_len)
    return seq.finish_reason, seq.stop_reason


def test_eos_stops_with_no_stop_reason():
    seq = make_seq([A, B], eos=[EOS])
    assert step(seq, C) == (None, None)
    assert step(seq, EOS) == ("stop", None)


def test_stop_token_id_is_the_stop_reason():
    seq = make_seq([A], eos=[EOS], stop_token_ids=[D])
    assert step(seq, D) == ("stop", D)


def test_ignore_eos():
    seq = make_seq([A], eos=[EOS], ignore_eos=True, stop_token_ids=[D])
    assert step(seq, EOS) == (None, None)
    assert step(seq, D) == ("stop", D)


@pytest.mark.parametrize("min_tokens", [1, 2, 3])
def test_stop_token_counts_from_output_index_min_tokens(min_tokens):
    """check_stop counts a stop token once the output holds min_tokens tokens (with it); the
    sampler bans stop tokens earlier still (model_input's banned_token_ids)."""
    seq = make_seq([A], eos=[EOS], min_tokens=min_tokens)
    for _ in range(min_tokens - 1):
        assert step(seq, EOS) == (None, None)
    assert seq.num_output_tokens == min_tokens - 1
    assert step(seq, EOS) == ("stop", None)


def test_stop_token_before_min_tokens_is_ignored():
    seq = make_seq([A], eos=[EOS], min_tokens=2)
    assert step(seq, EOS) == (None, None)
    assert seq.finish_reason is None


def test_max_tokens_boundary():
    seq = make_seq([A, B, C], max_tokens=3)
    assert step(seq, A) == (None, None)
    assert step(seq, A) == (None, None)
    assert step(seq, A) == ("length", None)


def test_max_model_len_boundary():
    seq = make_seq([A, B, C], max_tokens=None)
    assert step(seq, A, max_model_len=5) == (None, None)
    assert step(seq, A, max_model_len=5) == ("length", None)


def test_stop_token_wins_over_length():
    seq = make_seq([A], eos=[EOS], max_tokens=1)
    assert step(seq, EOS) == ("stop", None)


def test_stop_string_cut_before_it():
    seq = make_seq([A], stop=["cd"])
    assert step(seq, B) == (None, None) and seq.output_text == "b"
    assert step(seq, C) == (None, None) and seq.output_text == "bc"
    assert step(seq, D) == ("stop", "cd")
    assert seq.output_text == "b"


def test_stop_string_kept_with_include_stop_str_in_output():
    seq = make_seq([A], stop=["cd"], include_stop_str_in_output=True)
    for t in (B, C, D):
        step(seq, t)
    assert (seq.finish_reason, seq.stop_reason, seq.output_text) == ("stop", "cd", "bcd")


def test_stop_string_wins_over_length():
    seq = make_seq([A], stop=["b"], max_tokens=1)
    assert step(seq, B) == ("stop", "b")
    assert seq.output_text == ""


def test_stop_string_needs_more_than_min_tokens():
    """A stop string counts only in the text of more than min_tokens tokens."""
    seq = make_seq([A], stop=["b"], min_tokens=1)
    assert step(seq, B) == (None, None)
    assert seq.output_text == "b"  # the text is still tracked
    assert step(seq, C) == (None, None)  # "b" is old text: not found again
    assert step(seq, B) == ("stop", "b")
    assert seq.output_text == "bc"


def test_text_that_did_not_grow_is_not_searched_again():
    """A token that adds no text (a skipped special token) cannot complete a stop string that
    was already in the text before min_tokens were out."""
    seq = make_seq([A], stop=["b"], min_tokens=1)
    assert step(seq, B) == (None, None)
    assert step(seq, 150) == (None, None)
    assert seq.output_text == "b"


def test_stop_string_respects_skip_special_tokens():
    seq = make_seq([A], stop=["<150>"], skip_special_tokens=False)
    assert step(seq, 150) == ("stop", "<150>")
    seq = make_seq([A], stop=["<150>"])
    assert step(seq, 150) == (None, None)


def test_earliest_stop_string_wins():
    seq = make_seq([A], stop=["cd", "bc"])
    step(seq, B)
    step(seq, C)
    assert seq.stop_reason == "bc" and seq.output_text == ""


def test_no_tokenizer_means_no_text():
    assert decode(None, [1, 2], True) == ""
    assert decode(TOK, [1, 150, 2], True) == "bc"
    assert decode(TOK, [1, 150, 2], False) == "b<150>c"
    seq = make_seq([A], stop=["b"])
    assert step(seq, B, tokenizer=None) == (None, None)


def test_find_stop_string():
    assert find_stop_string("abcd", 1, ["cd"]) == (2, "cd")
    assert find_stop_string("abcd", 1, ["bc"]) is None  # ended before the new character
    assert find_stop_string("abcd", 2, ["bc"]) == (1, "bc")
    assert find_stop_string("abcd", 4, ["a"]) == (0, "a")
    assert find_stop_string("abcd", 0, ["d"]) is None
    assert find_stop_string("abcabc", 6, ["c", "b"]) == (1, "b")
    assert find_stop_string("abcabc", 6, ["b", "c"]) == (1, "b")
    assert find_stop_string("xx", 9, ["xxx"]) is None
    assert find_stop_string("abab", 2, ["ab", "ba"]) == (1, "ba")
    assert find_stop_string("", 0, ["a"]) is None
    assert find_stop_string("ab", 2, ["a", "ab"]) == (0, "a")  # a tie: the first listed wins
    assert find_stop_string("ab", 2, ["ab", "a"]) == (0, "ab")


def test_reaches_length_limit():
    seq = make_seq([A, B], max_tokens=2)
    assert not reaches_length_limit(seq, 100)
    seq.append_token(A)
    assert not reaches_length_limit(seq, 100)
    assert reaches_length_limit(seq, 3)
    assert not reaches_length_limit(seq, 4)
    seq.add_placeholder(0)  # the placeholder counts
    assert reaches_length_limit(seq, 100)
    unlimited = make_seq([A, B], max_tokens=None)
    unlimited.append_token(A)
    assert not reaches_length_limit(unlimited, 4)
    assert reaches_length_limit(unlimited, 3)
