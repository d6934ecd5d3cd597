"""Logits processing (allowed_token_ids, bad_words, logit_bias, repetition / frequency / presence
penalties) against transformers' logits processors on random logits, in vLLM's order.

transformers has RepetitionPenaltyLogitsProcessor, NoBadWordsLogitsProcessor,
SequenceBiasLogitsProcessor and PrefixConstrainedLogitsProcessor; it has no frequency or
presence penalty, so those are checked against OpenAI's definition written out token by token
(``logit[j] - count[j] * frequency - (count[j] > 0) * presence``, output tokens only). The
sampler is checked to apply the processing before greedy selection and temperature (a
chi-square test that rejects the processing applied after temperature). Negative controls:
the mutants of tests/mutants/engine.py (one per option) fail these tests.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor

from conformance.stats import chi_square
from nanovllm.core.bad_words import bad_words_token_ids, banned_by_bad_words
from nanovllm.core.model_input import RowLogitsProcessing
from nanovllm.layers.logits_processing import apply_logits_processing
from nanovllm.layers.sampler import Sampler, SamplingMetadata, general_path_rows
from tests.hf_processors import bad_words_reference, logit_bias_reference

VOCAB = 40
ALPHA = 1e-3


def _logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * 3  # positive and negative logits


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _row(prompt=None, output=None, **kw) -> RowLogitsProcessing:
    row = RowLogitsProcessing(**kw)
    if kw.get("repetition_penalty", 1.0) != 1.0 or kw.get("frequency_penalty") or kw.get("presence_penalty"):
        row.prompt_token_ids, row.output_token_ids = list(prompt), list(output)
    return row


def _processed(logits: torch.Tensor, rows: dict[int, RowLogitsProcessing]) -> torch.Tensor:
    return apply_logits_processing(logits.clone(), rows)


def _meta(n, **kw) -> SamplingMetadata:
    base = dict(
        temperatures=[0.0] * n,
        top_ks=[0] * n,
        top_ps=[1.0] * n,
        min_ps=[0.0] * n,
        generators=[None] * n,
        banned_token_ids=[[] for _ in range(n)],
        num_logprobs=[None] * n,
    )
    base.update(kw)
    return SamplingMetadata(**base)


# ------------------------------------------------------------------ one option at a time
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    rng = random.Random(int(penalty * 10))
    logits = _logits(6, seed=1)
    rows, want = {}, logits.clone()
    for r in (0, 2, 3, 5):  # rows 1 and 4 have no processing: untouched
        prompt, output = _ids(rng, rng.randint(1, 12)), _ids(rng, rng.randint(0, 8))
        rows[r] = _row(prompt, output, repetition_penalty=penalty)
        hf = RepetitionPenaltyLogitsProcessor(penalty)
        want[r] = hf(torch.tensor([prompt + output]), logits[r : r + 1].clone())[0]
    got = _processed(logits, rows)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.equal(got, logits), "the penalty changed nothing: the check would be vacuous"


def _openai_penalties(logits: torch.Tensor, output: list[int], frequency: float, presence: float):
    out = logits.clone()
    for j in range(VOCAB):
        count = output.count(j)
        out[j] = logits[j] - count * frequency - (1.0 if count > 0 else 0.0) * presence
    return out


@pytest.mark.parametrize("frequency,presence", [(0.7, 0.0), (0.0, 1.5), (-1.2, 0.4), (2.0, -2.0)])
def test_frequency_and_presence_penalties_follow_the_openai_definition(frequency, presence):
    rng = random.Random(7)
    logits = _logits(4, seed=2)
    rows, want = {}, logits.clone()
    for r in range(4):
        prompt = _ids(rng, 10)
        output = _ids(rng, 12) + [prompt[0]] * 3  # repeats; a prompt token generated too
        rows[r] = _row(prompt, output, frequency_penalty=frequency, presence_penalty=presence)
        want[r] = _openai_penalties(logits[r], output, frequency, presence)
        only_prompt = set(prompt) - set(output)
        assert only_prompt, "a prompt-only token is needed to see that the prompt does not count"
    got = _processed(logits, rows)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_logit_bias_matches_sequence_bias():
    logits = _logits(3, seed=3)
    bias = [{3: 5.0, 17: -2.5}, {0: 100.0}, {39: -100.0, 1: 0.25, 2: -0.5}]
    rows = {r: _row(logit_bias=b) for r, b in enumerate(bias)}
    want = torch.stack(
        [logit_bias_reference(b, torch.tensor([[5, 6]]), logits[r : r + 1].clone())[0] for r, b in enumerate(bias)]
    )
    torch.testing.assert_close(_processed(logits, rows), want, rtol=0, atol=1e-5)


def test_allowed_token_ids_match_prefix_constrained():
    logits = _logits(3, seed=4)
    allowed = {0: [5, 9, 33], 2: [0]}
    rows = {r: _row(allowed_token_ids=ids) for r, ids in allowed.items()}
    want = logits.clone()
    for r, ids in allowed.items():
        hf = PrefixConstrainedLogitsProcessor(lambda batch_id, input_ids, ids=ids: ids, num_beams=1)
        want[r] = hf(torch.tensor([[1, 2]]), logits[r : r + 1].clone())[0]
    got = _processed(logits, rows)
    assert torch.equal(got, want)
    assert torch.isfinite(got[1]).all(), "a row without allowed_token_ids lost tokens"


def test_bad_words_match_no_bad_words_processor():
    """vLLM's rule (a word's last token is banned when the output so far ends with the word's
    other tokens) equals transformers' NoBadWordsLogitsProcessor over the output tokens."""
    rng = random.Random(11)
    multi_token_bans = 0
    for case in range(300):
        words = [_ids(rng, rng.randint(1, 3)) for _ in range(rng.randint(1, 4))]
        output = _ids(rng, rng.randint(0, 6))
        if rng.random() < 0.5 and words[0][:-1]:  # make a prefix match likely
            output = output + words[0][:-1]
        got = sorted(set(banned_by_bad_words(words, output)))
        scores = torch.zeros(1, VOCAB)
        want = (bad_words_reference(words, output, scores) == float("-inf"))[0].nonzero().flatten().tolist()
        assert got == want, f"case {case}: words {words}, output {output}: {got} != {want}"
        multi_token_bans += any(
            len(w) > 1 and w[-1] in got and w[-1] not in {x[-1] for x in words if len(x) == 1} for w in words
        )
    assert multi_token_bans > 20, "too few multi-token bans: the comparison is weak"


def test_bad_words_tokenize_as_vllm():
    """Each word as written (leading spaces stripped), and with a leading space when that
    tokenizes to another first token and as many tokens."""

    class Tok:  # " x" -> another token than "x"
        def encode(self, text, add_special_tokens=False):
            return [
                100 + ord(c) if i == 0 and text.startswith(" ") else ord(c)
                for i, c in enumerate(text.lstrip(" ") if text.startswith(" ") else text)
            ]

    assert bad_words_token_ids(Tok(), ["ab", "  c"]) == [[97, 98], [197, 98], [99], [199]]

    class Same:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text.strip()]

    assert bad_words_token_ids(Same(), ["ab"]) == [[97, 98]]

    class Empty:
        def encode(self, text, add_special_tokens=False):
            return []

    with pytest.raises(ValueError, match="bad_words entries must tokenize to at least one token, got 'zz'"):
        bad_words_token_ids(Empty(), ["zz"])


# ------------------------------------------------------------------ all together, in vLLM's order
def test_everything_together_matches_transformers_in_vllms_order():
    """allowed tokens, bad words, logit bias, then the penalties: the greedy token and the
    processed logits equal transformers' processors chained in that order; logprobs stay raw."""
    rng = random.Random(5)
    for case in range(30):
        logits = _logits(1, seed=100 + case)
        prompt, output = _ids(rng, 8), _ids(rng, 6)
        allowed = sorted(set(_ids(rng, 25)))
        words = [[rng.choice(allowed)], output[-1:] + [rng.choice(allowed)]]
        bias = {rng.choice(allowed): rng.uniform(-4, 4) for _ in range(3)}
        rep, freq, pres = rng.uniform(0.5, 2.5), rng.uniform(-2, 2), rng.uniform(-2, 2)
        # bad words (vLLM) look at the output tokens only; the repetition penalty at the prompt too
        want = PrefixConstrainedLogitsProcessor(lambda b, i, allowed=allowed: allowed, num_beams=1)(
            torch.tensor([output]), logits.clone()
        )
        want = bad_words_reference(words, output, want)
        want = logit_bias_reference(bias, torch.tensor([output]), want)
        want = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([prompt + output]), want)[0]
        want = _openai_penalties(want, output, freq, pres)
        row = _row(
            prompt,
            output,
            allowed_token_ids=allowed,
            logit_bias=bias,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
        )
        banned = banned_by_bad_words(words, output)
        x = logits.clone()
        x[0, banned] = float("-inf")
        got = apply_logits_processing(x, {0: row})[0]
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)), f"case {case}: other tokens masked"
        torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=1e-4)
        out = Sampler(torch.Generator())(
            logits, _meta(1, banned_token_ids=[banned], processing={0: row}, num_logprobs=[1])
        )
        assert out.token_ids[0] == int(want.argmax())
        raw = torch.log_softmax(logits[0], -1)
        assert abs(out.logprobs[0][0] - float(raw[out.token_ids[0]])) < 1e-5, "logprobs must be the raw model's"


def test_order_bias_before_repetition_penalty_matters():
    """vLLM adds the bias before the repetition penalty: for logit 1, bias -3, penalty 2 that is
    (1 - 3) * 2 = -4 (the other order would give 1 / 2 - 3 = -2.5)."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 1.0
    row = _row([7], [], logit_bias={7: -3.0}, repetition_penalty=2.0)
    assert float(_processed(logits, {0: row})[0, 7]) == pytest.approx(-4.0)


def test_processing_comes_before_temperature():
    """Sampled at temperature 0.5, rows follow softmax(processed / 0.5): a chi-square test that
    rejects the processing applied after the temperature (bias and penalty halved)."""
    n = 4000
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    logits = base.expand(n, -1).clone()
    row = RowLogitsProcessing(
        logit_bias={4: 1.0}, presence_penalty=0.8, prompt_token_ids=[0], output_token_ids=[1, 1], repetition_penalty=1.0
    )
    meta = _meta(n, temperatures=[0.5] * n, processing={i: row for i in range(n)})
    samples = Sampler(torch.Generator().manual_seed(3))(logits, meta).token_ids
    right = base.clone()
    right[4] += 1.0
    right[1] -= 0.8
    wrong = base / 0.5
    wrong[4] += 1.0
    wrong[1] -= 0.8
    ok = chi_square(samples, torch.softmax(right / 0.5, -1))
    bad = chi_square(samples, torch.softmax(wrong, -1))
    assert ok.p_value > ALPHA and ok.outside == 0, ok.summary()
    assert bad.p_value < ALPHA, f"the order is not observable: {bad.summary()}"


def test_rows_with_processing_take_the_general_path_of_the_fused_sampler():
    """The fused kernel applies temperature only: every row with logits processing must go to
    the PyTorch path, plain rows must not."""
    meta = _meta(
        5,
        temperatures=[0.0, 1.0, 0.7, 1.0, 0.0],
        processing={1: _row(logit_bias={3: 1.0}), 4: _row([1], [2], repetition_penalty=1.2)},
    )
    assert general_path_rows(meta) == [1, 4]
