"""A seeded request's later tokens follow the model's distribution given the tokens before them.

The conformance suite checks the first sampled token's distribution and that a seed reproduces
its tokens (batch-independently); a request whose noise is the same at every step (a generator
made afresh from the seed each step) passes both: each token alone still has the right
distribution. Here N seeded requests sample L tokens each at temperature T with top_k, and
transformers (float32) gives the reference distribution of every token given the prompt and the
request's own earlier tokens:

* no token outside its step's top_k;
* the randomized probability integral transform of tokens 2..L (tokens ordered by reference
  probability) is uniform: chi-square over 10 bins;
* repeats: how often a token equals one of the request's earlier tokens is what the reference
  gives (sum of the reference probabilities of the earlier tokens, a z-score); noise reused
  across steps favours the same tokens again and again.

Needs transformers' model code (tests/, not conformance/: the conformance suite only reads
golden files).
"""

from __future__ import annotations

import math

import torch

import golden
from conformance.stats import chi2_sf
from tests.conftest import cached_llm, hf_reference

N, L, TEMPERATURE, TOP_K = 600, 6, 1.3, 40
ALPHA = 1e-3
Z_MAX = 3.3  # two-sided p ~ 1e-3


def _reference_probs(model_dir: str, prompt: list[int], seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, L, V] reference probabilities (temperature, then top_k) of each step, and the kept mask
    widened by 1e-4 in logit (engine and reference differ in the last float bits)."""
    ref = hf_reference(model_dir)
    ids = torch.tensor([prompt + s for s in seqs])
    with torch.inference_mode():
        logits = torch.cat([ref.model(ids[i : i + 200]).logits for i in range(0, len(seqs), 200)])
    logits = logits[:, len(prompt) - 1 : len(prompt) - 1 + L].double() / TEMPERATURE
    kth = logits.topk(TOP_K, dim=-1).values[..., -1:]
    probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    return probs, logits >= kth - 1e-4


def test_seeded_later_tokens_follow_the_conditional_distribution():
    from nanovllm import SamplingParams

    g = golden.load("llama-mha-hd64")
    prompt = g["sampling"]["prompt"]
    llm = cached_llm(golden.model_dir(g), block_size=16, seed=0, dtype="float32")
    params = [
        SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, seed=i, max_tokens=L, ignore_eos=True) for i in range(N)
    ]
    seqs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * N, params, use_tqdm=False)]
    assert all(len(s) == L for s in seqs)
    probs, kept = _reference_probs(golden.model_dir(g), prompt, seqs)
    tok = torch.tensor(seqs)

    outside = int((~kept.gather(-1, tok.unsqueeze(-1))).sum())
    assert outside == 0, f"{outside} sampled tokens outside their step's top_k={TOP_K}"

    p_tok = probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    above = (probs * (probs > p_tok.unsqueeze(-1))).sum(-1)
    u = above + torch.rand(p_tok.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * p_tok
    later = u[:, 1:].flatten()
    counts = torch.histc(later, bins=10, min=0, max=1)
    expected = later.numel() / 10
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert chi2_sf(stat, 9) > ALPHA, f"tokens 2..{L}: PIT not uniform (chi2={stat:.1f}, df 9; bins {counts.tolist()})"

    observed, mean, var = 0, 0.0, 0.0
    for j in range(1, L):
        earlier = torch.zeros(N, probs.shape[-1], dtype=torch.bool).scatter_(1, tok[:, :j], True)
        q = (probs[:, j] * earlier).sum(-1)  # reference chance of repeating an earlier token
        observed += int((tok[:, j : j + 1] == tok[:, :j]).any(1).sum())
        mean += float(q.sum())
        var += float((q * (1 - q)).sum())
    z = (observed - mean) / math.sqrt(var)
    assert abs(z) < Z_MAX, f"{observed} repeats of an earlier token, the reference expects {mean:.1f} (z = {z:.1f})"
