"""SamplingParams: bad values raise naming the field and the value; good values are normalised."""

from __future__ import annotations

import math
import re

import pytest

from nanovllm.sampling_params import RequestOutputKind, SamplingParams

# (field, bad value, exception type, text the message must contain besides the field name)
BAD = [
    ("temperature", -0.1, ValueError, "-0.1"),
    ("temperature", "1", TypeError, "'1'"),
    ("temperature", True, TypeError, "True"),
    ("temperature", math.nan, ValueError, "nan"),
    ("top_k", -2, ValueError, "-2"),
    ("top_k", 1.5, TypeError, "1.5"),
    ("top_k", False, TypeError, "False"),
    ("top_p", 0.0, ValueError, "0.0"),
    ("top_p", 1.01, ValueError, "1.01"),
    ("top_p", None, TypeError, "None"),
    ("min_p", -0.01, ValueError, "-0.01"),
    ("min_p", 1.01, ValueError, "1.01"),
    ("min_p", None, TypeError, "None"),
    ("seed", 1.0, TypeError, "1.0"),
    ("max_tokens", 0, ValueError, "0"),
    ("max_tokens", "8", TypeError, "'8'"),
    ("min_tokens", -1, ValueError, "-1"),
    ("min_tokens", None, TypeError, "None"),
    ("stop", [""], ValueError, "''"),
    ("stop", ["ok", 3], TypeError, "stop[1]"),
    ("stop", 5, TypeError, "got 5 (int)"),  # the value's type named
    ("stop", b"x", TypeError, "b'x' (bytes)"),
    ("stop_token_ids", [-1], ValueError, "-1"),
    ("stop_token_ids", [1.0], TypeError, "1.0"),
    ("stop_token_ids", [7, "x"], TypeError, "stop_token_ids[1]"),
    ("stop_token_ids", 5, TypeError, "5"),
    ("stop_token_ids", 0, TypeError, "0"),  # not an empty list
    ("stop_token_ids", "12", TypeError, "'12'"),
    ("logprobs", -1, ValueError, "-1"),
    ("logprobs", 2.0, TypeError, "2.0"),
    ("prompt_logprobs", -1, ValueError, "-1"),
    ("prompt_logprobs", "3", TypeError, "'3'"),
    ("n", 0, ValueError, "0"),
    ("n", 4097, ValueError, "4097"),
    ("n", 2.0, TypeError, "2.0"),
    ("presence_penalty", 2.01, ValueError, "2.01"),
    ("presence_penalty", -2.01, ValueError, "-2.01"),
    ("frequency_penalty", 2.01, ValueError, "2.01"),
    ("frequency_penalty", -2.01, ValueError, "-2.01"),
    ("frequency_penalty", "x", TypeError, "'x'"),
    ("repetition_penalty", 0.0, ValueError, "0.0"),
    ("repetition_penalty", "2", TypeError, "'2'"),
    ("repetition_penalty", math.inf, ValueError, "inf"),
    ("repetition_penalty", math.nan, ValueError, "nan"),
    ("logit_bias", [(1, 2.0)], TypeError, "[(1, 2.0)]"),
    ("logit_bias", {-1: 1.0}, ValueError, "-1"),
    ("logit_bias", {"1": 1.0}, TypeError, "'1'"),
    ("logit_bias", {1: math.inf}, ValueError, "inf"),
    ("logit_bias", {1: -math.inf}, ValueError, "-inf"),
    ("logit_bias", {1: "x"}, TypeError, "'x'"),
    ("allowed_token_ids", [], ValueError, "[]"),
    ("allowed_token_ids", "12", TypeError, "'12'"),
    ("allowed_token_ids", b"12", TypeError, "b'12'"),
    ("allowed_token_ids", {1: 2}, TypeError, "{1: 2}"),
    ("allowed_token_ids", 5, TypeError, "5"),
    ("allowed_token_ids", [1, -3], ValueError, "-3"),
    ("allowed_token_ids", [1, 2.0], TypeError, "2.0"),
    ("bad_words", "word", TypeError, "'word'"),
    ("bad_words", ["ok", "  "], ValueError, "'  '"),
    ("bad_words", ["ok", ""], ValueError, "''"),
    ("bad_words", [3], TypeError, "3"),
    ("bad_words", 5, TypeError, "5"),
    ("output_kind", "DELTA", TypeError, "'DELTA'"),
]


@pytest.mark.parametrize("field,value,exc,text", BAD, ids=[f"{f}={v!r}" for f, v, _, _ in BAD])
def test_bad_value_names_field_and_value(field, value, exc, text):
    with pytest.raises(exc) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    # the message starts with the field's name (logit_bias values: logit_bias[token])
    assert re.match(rf"{field}\b", message), message
    assert text in message, message


def test_type_errors_name_the_type():
    with pytest.raises(TypeError, match=r"temperature must be a number, got '1' \(str\)"):
        SamplingParams(temperature="1")
    with pytest.raises(TypeError, match=r"top_k must be an int, got 1.5 \(float\)"):
        SamplingParams(top_k=1.5)
    with pytest.raises(TypeError, match=r"logit_bias\[1\] must be a number"):
        SamplingParams(logit_bias={1: "x"})
    with pytest.raises(TypeError, match=r"logit_bias key must be an int"):
        SamplingParams(logit_bias={"1": 1.0})
    with pytest.raises(TypeError, match=r"stop_token_ids\[0\] must be an int"):
        SamplingParams(stop_token_ids=[1.0])
    with pytest.raises(TypeError, match=r"allowed_token_ids\[0\] must be an int"):
        SamplingParams(allowed_token_ids=[1.0])


def test_stop_messages():
    """Whole messages: the field takes a string or a list of strings; a wrong element is a
    TypeError naming its index and type, an empty one a ValueError."""
    cases = [
        (5, TypeError, "stop must be a string or a list of strings, got 5 (int)"),
        (b"x", TypeError, "stop must be a string or a list of strings, got b'x' (bytes)"),
        ([5], TypeError, "stop[0] must be a string, got 5 (int)"),
        (["ok", None], TypeError, "stop[1] must be a string, got None (NoneType)"),
        (["ok", ""], ValueError, "stop must hold non-empty strings, got ''"),
    ]
    for value, exc, message in cases:
        with pytest.raises(exc, match=f"^{re.escape(message)}$"):
            SamplingParams(stop=value)
    # bad_words takes no lone string: its message stays "a list of strings"
    with pytest.raises(TypeError, match=r"^bad_words must be a list of strings, got 5 \(int\)$"):
        SamplingParams(bad_words=5)
    for value, exc, message in [
        (["ok", [1]], TypeError, "bad_words[1] must be a string, got [1] (list)"),  # was a bare "unhashable"
        ([3], TypeError, "bad_words[0] must be a string, got 3 (int)"),
        (["ok", " "], ValueError, "bad_words must hold non-empty strings, got ' '"),
    ]:
        with pytest.raises(exc, match=f"^{re.escape(message)}$"):
            SamplingParams(bad_words=value)


def test_empty_allowed_token_ids_message():
    with pytest.raises(
        ValueError, match=r"^allowed_token_ids must not be empty \(None allows every token\), got \[\]$"
    ):
        SamplingParams(allowed_token_ids=[])


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match="min_tokens=5, max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100


def test_n_needs_sampling():
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling.*got 2"):
        SamplingParams(n=2, temperature=0.0)
    with pytest.raises(ValueError, match="got 3"):
        SamplingParams(n=3, temperature=0.9e-5)
    assert SamplingParams(n=2, temperature=1e-5).n == 2
    assert SamplingParams(n=1, temperature=0.0).n == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 0},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"min_p": 1},
        {"seed": None},
        {"seed": 0},
        {"seed": -5},
        {"max_tokens": 1},
        {"max_tokens": None},
        {"min_tokens": 0},
        {"logprobs": 0},
        {"prompt_logprobs": 0},
        {"n": 1},
        {"presence_penalty": 2.0},
        {"presence_penalty": -2.0},
        {"frequency_penalty": 2},
        {"frequency_penalty": -2},
        {"repetition_penalty": 1e-9},
        {"repetition_penalty": 1e9},
        {"logit_bias": {0: 1e30}},
        {"logit_bias": {}},
        {"stop_token_ids": [0]},
        {"allowed_token_ids": [0]},
        {"allowed_token_ids": (3, 4)},
        {"bad_words": []},
    ],
)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        if k not in ("top_k", "allowed_token_ids", "logit_bias"):
            assert getattr(params, k) == v


def test_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (1.0, 0, 1.0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.include_stop_str_in_output, p.ignore_eos, p.skip_special_tokens) == (False, False, True)
    assert (p.logprobs, p.prompt_logprobs, p.n) == (None, None, 1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words) == (None, None, [])
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert not p.has_penalties and not p.has_logits_processing


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=7).top_k == 7
    assert SamplingParams(stop="end").stop == ["end"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]
    bias = SamplingParams(logit_bias={3: 1, 4: -2.5}).logit_bias
    assert bias == {3: 1.0, 4: -2.5} and all(type(v) is float for v in bias.values())
    assert SamplingParams(allowed_token_ids=(x for x in (2, 1))).allowed_token_ids == [2, 1]
    assert SamplingParams(bad_words=("b", "a", "b")).bad_words == ["b", "a"]
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind is RequestOutputKind.FINAL_ONLY
    assert [k.value for k in RequestOutputKind] == [0, 1, 2]


@pytest.mark.parametrize(
    "kwargs,penalties,processing",
    [
        ({}, False, False),
        ({"repetition_penalty": 1.1}, True, True),
        ({"presence_penalty": 0.5}, True, True),
        ({"presence_penalty": -0.5}, True, True),
        ({"frequency_penalty": 0.1}, True, True),
        ({"logit_bias": {1: 1.0}}, False, True),
        ({"logit_bias": {}}, False, False),
        ({"allowed_token_ids": [1]}, False, True),
        ({"bad_words": ["x"]}, False, True),
        ({"temperature": 0.5, "top_k": 3, "top_p": 0.5, "min_p": 0.1, "seed": 1}, False, False),
    ],
)
def test_penalty_and_processing_flags(kwargs, penalties, processing):
    p = SamplingParams(**kwargs)
    assert p.has_penalties is penalties
    assert p.has_logits_processing is processing


def test_seed_is_a_64_bit_integer():
    """A seed beyond 64 bits reached the engine core's generator, which refused it and took the
    server down (a user trial). The boundaries are accepted; one past each is refused, by name."""
    from nanovllm.sampling_params import SEED_MAX, SEED_MIN

    assert (SEED_MIN, SEED_MAX) == (-(2**63), 2**63 - 1)
    for ok in (SEED_MIN, -1, 0, SEED_MAX):
        assert SamplingParams(seed=ok).seed == ok
    for bad in (SEED_MIN - 1, SEED_MAX + 1, 2**64):
        message = f"seed must be a 64-bit integer, in [-9223372036854775808, 9223372036854775807], got {bad}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            SamplingParams(seed=bad)


def test_child_seeds_wrap_around_within_64_bits():
    """Completion i of an n > 1 request draws with seed + i, wrapped into the 64-bit range, so the
    largest seed with n = 2 gives children the engine takes (seed + 1 overflowed before)."""
    from nanovllm.sampling_params import SEED_MAX, SEED_MIN, child_seed

    assert [child_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert child_seed(None, 2) is None
    assert child_seed(-1, 1) == 0
    assert child_seed(SEED_MAX, 1) == SEED_MIN and child_seed(SEED_MAX, 2) == SEED_MIN + 1
    assert child_seed(SEED_MIN, 0) == SEED_MIN and child_seed(SEED_MAX, 0) == SEED_MAX
    for seed in (SEED_MIN, SEED_MAX):
        for i in range(4):
            SamplingParams(seed=child_seed(seed, i))  # each child a valid seed


def test_n_bounds_whole_message():
    assert SamplingParams(n=4096, temperature=1.0).n == 4096
    for bad in (0, 4097, 2**31):
        with pytest.raises(ValueError, match=f"^{re.escape(f'n must be in [1, 4096], got {bad}')}$"):
            SamplingParams(n=bad, temperature=1.0)
