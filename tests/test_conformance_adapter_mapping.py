"""The adapters' own mapping code, checked against an independent answer.

An adapter that drops a request field, or reports a rank computed wrongly, can pass every check:
the checks compare the engine with a reference, or with itself through the same adapter, so an
error the adapter makes the same way on both sides cancels. A blind bug hunt (2026-12-07) showed
three such cases: the HTTP adapter dropping ``seed=0`` (falsy), the rank helpers off by one outside
the top-k. Here each mapping is checked field by field, and each rank against a count.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conformance.adapters.base import Logprob, Sampling, Unsupported
from conformance.adapters.hf_adapter import logprob_entry as hf_entry
from conformance.adapters.llama_cpp_adapter import logprob_entry as llama_cpp_entry
from conformance.adapters.openai_adapter import IDS_OUT, SERVER_CAPABILITIES, OpenAIAdapter

# For every Sampling field, values unlike the default, falsy ones first: each must change the
# request (a field written `if p.seed:` drops seed 0, and the server then samples unseeded).
FIELD_VALUES = {
    "temperature": [0.0, 0.7],
    "top_k": [1, 5],
    "top_p": [0.0, 0.9],
    "min_p": [0.1],
    "seed": [0, 7],
    "max_tokens": [1, 40],
    "min_tokens": [1, 3],
    "stop": [("x",), ("",)],
    "stop_token_ids": [(0,), (5, 6)],
    "ignore_eos": [True],
    "include_stop_str_in_output": [True],
    "logprobs": [0, 3],
    "prompt_logprobs": [0, 2],
}


def _adapter(kind: str, ids_out: bool) -> OpenAIAdapter:
    """An adapter as it is after probing a server of this kind (no server contacted)."""
    a = OpenAIAdapter.__new__(OpenAIAdapter)
    a.kind, a.model, a.description = kind, "served-model", kind
    a.ids_in, a.ids_out, a.tokenizer = True, ids_out, None
    a.capabilities = SERVER_CAPABILITIES[kind] | (IDS_OUT if ids_out else set())  # as __init__ sets them
    return a


def test_every_sampling_field_has_values_to_try():
    """A new Sampling field must be added to FIELD_VALUES (or this mapping goes unchecked)."""
    assert {f.name for f in dataclasses.fields(Sampling)} == set(FIELD_VALUES)


@pytest.mark.parametrize("kind, ids_out", [("vllm", True), ("vllm", False), ("nanovllm", True)])
@pytest.mark.parametrize("field", sorted(FIELD_VALUES))
def test_every_sampling_field_reaches_the_request(kind, ids_out, field):
    """Each value the adapter accepts (its capabilities; the others are refused, and the check
    then skips naming the capability) changes the request."""
    a = _adapter(kind, ids_out)
    plain = a.body([1, 2, 3], Sampling())
    for value in FIELD_VALUES[field]:
        p = Sampling().with_(**{field: value})
        try:
            a.check_params([p])
        except Unsupported:
            continue
        body = a.body([1, 2, 3], p)
        if ids_out and field == "logprobs":
            # every request asks for logprobs (the ids come back through them), 0 by default: the
            # value asked must be the one sent; the reply side keeps None apart from 0 (below)
            assert body["logprobs"] == value
            continue
        assert body != plain, f"{field}={value!r} does not reach the {kind} request: {body}"


def test_seed_zero_is_sent_as_a_seed():
    body = _adapter("vllm", True).body([1], Sampling(seed=0))
    assert body["seed"] == 0
    assert "seed" not in _adapter("vllm", True).body([1], Sampling())  # control: no seed, no key


def test_reply_logprobs_follow_the_request():
    """ids_out: the reply always has logprobs (that is where the ids are); the result carries them
    only when the check asked, with ranks by value, and the sampled token outside the top-k with
    rank None (the format does not say how far outside)."""
    a = _adapter("vllm", True)
    reply = {
        "choices": [
            {
                "text": "ab",
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["token_id:5", "token_id:9"],
                    "token_logprobs": [-0.1, -3.0],
                    "top_logprobs": [
                        {"token_id:7": -2.5, "token_id:5": -0.1},
                        {"token_id:4": -0.2, "token_id:8": -1.9},
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens_details": {"cached_tokens": 16}},
    }
    r = a.result(reply, Sampling(logprobs=2))
    assert r.token_ids == [5, 9] and r.finish_reason == "length" and r.num_cached_tokens == 16
    assert r.logprobs[0] == {5: Logprob(-0.1, 1), 7: Logprob(-2.5, 2)}
    assert r.logprobs[1] == {4: Logprob(-0.2, 1), 8: Logprob(-1.9, 2), 9: Logprob(-3.0, None)}
    assert a.result(reply, Sampling()).logprobs is None  # control: not asked, not given


def _true_rank(row: np.ndarray, token: int) -> int:
    return int(sum(v > row[token] for v in row)) + 1


@pytest.mark.parametrize("helper", [hf_entry, llama_cpp_entry], ids=["hf", "llama_cpp"])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_logprob_entry_ranks_are_true_ranks(helper, k):
    """Every rank is one plus the count of strictly larger values, inside and outside the top-k,
    counted here independently of the helper (distinct values: no ties)."""
    rng = np.random.default_rng(k)
    row = np.log(rng.dirichlet(np.ones(12))).astype(np.float64)
    as_input = torch.tensor(row) if helper is hf_entry else row
    for token in range(len(row)):
        entry = helper(as_input, token, k)
        assert len(entry) == k + (_true_rank(row, token) > k)
        for t, lp in entry.items():
            assert lp.rank == _true_rank(row, t), (t, lp, _true_rank(row, t))
            assert lp.logprob == pytest.approx(row[t])
