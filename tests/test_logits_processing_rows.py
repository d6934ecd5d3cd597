"""Logits processing over a batch whose processed rows use different options.

Each option is checked elsewhere one kind at a time; here one processed row restricts its tokens
(``allowed_token_ids``) while another processed row only has a ``logit_bias``: the restriction must
stay on its own row. Expected rows are built by hand from the definitions.
"""

from __future__ import annotations

import torch

from nanovllm.core.model_input import RowLogitsProcessing
from nanovllm.layers.logits_processing import apply_logits_processing
from nanovllm.layers.sampler import Sampler, SamplingMetadata


def _logits(rows: int, vocab: int = 12) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(11))


def test_allowed_tokens_restrict_only_their_own_row():
    logits = _logits(4)
    processing = {
        0: RowLogitsProcessing(logit_bias={2: 1.5}),  # processed, but not restricted
        1: RowLogitsProcessing(allowed_token_ids=[4, 9]),
        3: RowLogitsProcessing(
            repetition_penalty=1.0, frequency_penalty=0.5, prompt_token_ids=[1], output_token_ids=[6, 6]
        ),
    }
    want = logits.clone()
    want[0, 2] += 1.5
    want[1] = float("-inf")
    want[1, [4, 9]] = logits[1, [4, 9]]
    want[3, 6] -= 2 * 0.5  # frequency penalty: twice in the output
    got = apply_logits_processing(logits.clone(), processing)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.isfinite(got[[0, 2, 3]]).all(), "a row without allowed_token_ids lost tokens"


def test_greedy_rows_beside_a_restricted_row_keep_their_argmax():
    """Through the sampler: a greedy row with a logit bias next to a restricted row takes the argmax
    of its own biased logits."""
    logits = _logits(2)
    bias_token = int(logits[0].argmin())
    meta = SamplingMetadata(
        temperatures=[0.0, 0.0],
        top_ks=[0, 0],
        top_ps=[1.0, 1.0],
        min_ps=[0.0, 0.0],
        generators=[None, None],
        banned_token_ids=[[], []],
        num_logprobs=[None, None],
        processing={
            0: RowLogitsProcessing(logit_bias={bias_token: 100.0}),
            1: RowLogitsProcessing(allowed_token_ids=[5]),
        },
    )
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    assert out.token_ids == [bias_token, 5]
