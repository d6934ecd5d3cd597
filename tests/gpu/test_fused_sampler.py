"""The fused sampling kernel and the Sampler's fused path.

On a GPU (marker ``gpu``) and under Triton's CPU interpreter (run by
test_triton_interpret.py with NANOVLLM_TRITON_INTERPRET=1 TRITON_INTERPRET=1).
Checks: greedy rows equal torch.argmax (first index on ties, across tiles);
non-finite rows flagged and only those; draws follow softmax(logits / T) by a
chi-square test that rejects a wrong temperature (negative control); a row's
draw depends on its seed only; filtered and banned rows take the PyTorch path
and obey their filters; logprobs are the raw model's.
"""

from __future__ import annotations

import os

import pytest
import torch

from conformance.stats import chi_square

INTERPRET = os.environ.get("NANOVLLM_TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.gpu]
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (or the Triton interpreter)", allow_module_level=True)
fused_sampler = pytest.importorskip("nanovllm.layers.fused_sampler", reason="needs triton")
if fused_sampler.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

from nanovllm.layers.sampler import Sampler, SamplingMetadata  # noqa: E402


def _run(logits, inv_temp, seeds, block=None, splits=None):
    n = logits.shape[0]
    inv = (
        torch.tensor(inv_temp, dtype=torch.float32, device=DEVICE).expand(n).contiguous()
        if isinstance(inv_temp, float)
        else torch.tensor(inv_temp, dtype=torch.float32, device=DEVICE)
    )
    s = torch.tensor(seeds, dtype=torch.int64, device=DEVICE)
    tokens, bad = fused_sampler.sample(logits, inv, s, block=block, splits=splits)
    return tokens.cpu(), bad.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if INTERPRET else [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,block", [(1000, 128), (257, None), (4099, 1024)])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_greedy_is_torch_argmax_with_ties(dtype, vocab, block, splits):
    g = torch.Generator(device=DEVICE).manual_seed(vocab)
    logits = torch.randn(6, vocab, device=DEVICE, generator=g).to(dtype)
    # ties: row 1 has its maximum twice in different tiles (and splits), row 2 twice in one tile
    logits[1, 3] = logits[1, vocab - 2] = 50
    logits[2, vocab - 5] = logits[2, vocab - 4] = 60
    logits[3] = 0  # all equal: index 0
    logits[4, vocab - 1] = 70  # the maximum in the last token of the last split
    tokens, bad = _run(logits, 0.0, list(range(6)), block, splits)
    assert tokens.tolist() == logits.float().argmax(-1).cpu().tolist()
    assert tokens[1] == 3 and tokens[2] == vocab - 5 and tokens[3] == 0 and tokens[4] == vocab - 1
    assert bad.tolist() == [0] * 6


def test_nonfinite_rows_are_flagged():
    logits = torch.randn(5, 300, device=DEVICE)
    logits[1, 7] = float("nan")
    logits[2, 299] = float("inf")
    logits[4, 0] = float("-inf")
    for splits in (1, 3):
        _, bad = _run(logits, [0.0, 1.0, 0.0, 1.0, 2.0], [1, 2, 3, 4, 5], block=64, splits=splits)
        assert bad.tolist() == [0, 1, 1, 0, 1], splits


def _draws(logits_row, temperature, n, first_seed=0, block=None):
    logits = logits_row.to(DEVICE).expand(n, -1).contiguous()
    tokens, _ = _run(logits, 1.0 / temperature, list(range(first_seed, first_seed + n)), block)
    return tokens.tolist()


@pytest.mark.parametrize("temperature", [0.6] if INTERPRET else [0.6, 1.0])
def test_draws_follow_softmax_and_a_wrong_temperature_is_rejected(temperature):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, -30.0])
    samples = _draws(logits, temperature, 800 if INTERPRET else 20000, block=4)  # the interpreter: ~0.1 s a row
    right = chi_square(samples, torch.softmax(logits.double() / temperature, -1))
    assert right.p_value > 1e-3, right.summary()
    wrong_t = 1.6 if temperature < 1 else 0.6
    wrong = chi_square(samples, torch.softmax(logits.double() / wrong_t, -1))
    assert wrong.p_value < 1e-6, f"negative control not rejected: {wrong.summary()}"
    assert 7 not in samples  # p ~ 1e-13 at T=1


def test_a_rows_draw_depends_on_its_seed_only():
    g = torch.Generator(device=DEVICE).manual_seed(3)
    logits = torch.randn(8, 500, device=DEVICE, generator=g)
    seeds = [11, 12, 13, 14, 15, 16, 17, 18]
    tokens, _ = _run(logits, 1.0, seeds)
    # the same rows in reverse order, and row 5 alone
    rev, _ = _run(logits.flip(0).contiguous(), 1.0, seeds[::-1])
    alone, _ = _run(logits[5:6].contiguous(), 1.0, [seeds[5]])
    assert rev.flip(0).tolist() == tokens.tolist()
    assert alone.item() == tokens[5].item()
    # a row's draw does not depend on how many programs share the row (500 asked with 4-token
    # tiles: 125 tiles, more splits than the merge reads, so the count is capped)
    for splits, block in ((1, None), (2, None), (5, None), (500, 4)):
        assert _run(logits, 1.0, seeds, block=block, splits=splits)[0].tolist() == tokens.tolist(), splits
    other, _ = _run(logits, 1.0, [s + 100 for s in seeds])
    assert other.tolist() != tokens.tolist()  # different seeds draw differently (p ~ 1e-16 to be equal)


def _meta(n, **kw):
    base = dict(
        temperatures=[1.0] * n,
        top_ks=[0] * n,
        top_ps=[1.0] * n,
        min_ps=[0.0] * n,
        generators=[None] * n,
        banned_token_ids=[[] for _ in range(n)],
        num_logprobs=[None] * n,
        row_seeds=list(range(100, 100 + n)),
        seeded=[False] * n,
    )
    base.update(kw)
    return SamplingMetadata(**base)


def test_sampler_fused_path_mixes_plain_filtered_and_banned_rows():
    torch.manual_seed(0)
    vocab = 64
    logits = torch.randn(6, vocab, device=DEVICE)
    order = logits.argsort(-1, descending=True)
    meta = _meta(
        6,
        temperatures=[0.0, 1.0, 1.0, 0.0, 0.8, 1.0],
        top_ks=[0, 0, 3, 0, 0, 0],
        banned_token_ids=[[], [], [], [int(order[3, 0])], [], []],
        num_logprobs=[None, 2, None, 0, None, None],
        seeded=[False, True, True, False, False, False],
    )
    sampler = Sampler(torch.Generator(device=DEVICE).manual_seed(0))
    out = sampler(logits, meta)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] in order[2, :3].tolist()  # top_k=3 obeyed (PyTorch path)
    assert out.token_ids[3] == int(order[3, 1])  # greedy with its argmax banned
    lp = torch.log_softmax(logits.float(), -1)
    sampled_lp, rank, top = out.logprobs[1]
    assert abs(sampled_lp - float(lp[1, out.token_ids[1]])) < 1e-5
    assert [t for t, _ in top] == order[1, :2].tolist()
    assert out.logprobs[3][1] == 2 and out.logprobs[3][2] == []
    assert out.logprobs[0] is None and out.nonfinite_rows == []
    again = sampler(logits, meta)
    assert again.token_ids[1:3] == out.token_ids[1:3]  # seeded rows: same row seeds, same draws


def test_sampler_fused_path_applies_logits_processing():
    """Rows with logits processing (bias, repetition penalty, allowed tokens) leave the kernel for
    the PyTorch path and get the processed argmax; plain rows stay the raw argmax."""
    from nanovllm.core.model_input import RowLogitsProcessing
    from nanovllm.layers.logits_processing import apply_logits_processing

    torch.manual_seed(1)
    vocab = 64
    logits = torch.randn(5, vocab, device=DEVICE) * 3
    order = logits.argsort(-1, descending=True).cpu()
    rows = {
        1: RowLogitsProcessing(logit_bias={int(order[1, -1]): 100.0}),
        2: RowLogitsProcessing(repetition_penalty=50.0, prompt_token_ids=order[2, :2].tolist(), output_token_ids=[]),
        3: RowLogitsProcessing(allowed_token_ids=[5, 6, 7]),
    }
    meta = _meta(5, temperatures=[0.0, 0.0, 0.0, 1.0, 0.0], processing=rows)
    out = Sampler(torch.Generator(device=DEVICE).manual_seed(0))(logits, meta)
    processed = apply_logits_processing(logits.float().cpu().clone(), rows).argmax(-1).tolist()
    assert out.token_ids[1] == int(order[1, -1]) and out.token_ids[2] == int(order[2, 2])
    assert [out.token_ids[i] for i in (0, 1, 2, 4)] == [processed[i] for i in (0, 1, 2, 4)]
    assert out.token_ids[3] in (5, 6, 7)
    assert out.token_ids[0] == int(order[0, 0]) and out.token_ids[4] == int(order[4, 0])
