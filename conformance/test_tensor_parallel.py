"""Tensor parallelism: catalogue item 19. TP=2 against the reference and TP=1, on a model with one
KV head (replicated over the ranks) and an odd vocabulary (1001: uneven vocabulary shards).
On CPU the ranks talk over gloo; with two GPUs over NCCL (marker multi_gpu)."""
from __future__ import annotations

import pytest
import torch

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import GREEDY, PROMPT_LOGPROBS
from conformance.compare import LOGPROB_TOL, compare_greedy
from conformance.harness import delta, generate, golden_step_logprobs, require, tokens

MODEL = "llama-1kv-hd128"
CASES = ("len1", "len-bs", "len-bs+1", "len-5bs+3", "prefix-2bs-a")


def _check(engines, device, figure):
    g = golden.load(MODEL)
    picked = [c for c in g["cases"] if c["id"] in CASES]
    tp2 = engines.get(golden.model_dir(g), tp=2, device=device, **engines.optional(max_model_len=512))
    require(tp2, GREEDY)
    got = tokens(generate(tp2, [c["prompt"] for c in picked], Sampling.greedy(32)))
    report = compare_greedy([c["greedy"][:32] for c in picked], [golden_step_logprobs(c) for c in picked],
                            got, delta(g["dtype"]))
    figure("exact", f"{report.num_exact}/{report.num_seqs}")
    assert report.num_exact == report.num_seqs, f"TP=2 vs reference: {report.summary()}"
    tp1 = engines.get(golden.model_dir(g), device=device, **engines.optional(max_model_len=512))
    assert tokens(generate(tp1, [c["prompt"] for c in picked], Sampling.greedy(32))) == got, "TP=2 vs TP=1"
    require(tp2, PROMPT_LOGPROBS)
    outs = generate(tp2, [c["prompt"] for c in picked], Sampling.greedy(1, prompt_logprobs=1))
    worst = 0.0
    for c, out in zip(picked, outs):
        gotl = torch.tensor([out.prompt_logprobs[p][c["prompt"][p]].logprob for p in range(1, len(c["prompt"]))],
                            dtype=torch.float64)
        want = torch.tensor(c["prompt_lps"], dtype=torch.float64)
        if len(want):
            worst = max(worst, float((gotl - want).abs().max()))
    figure("max logprob diff", worst)
    assert worst <= LOGPROB_TOL[g["dtype"]], f"TP=2 prompt logprobs differ from the reference by {worst:.3g}"


@pytest.mark.pinned_device
def test_tp2_equals_tp1_gloo_cpu(engines, figure):
    _check(engines, "cpu", figure)


@pytest.mark.multi_gpu
@pytest.mark.pinned_device
@pytest.mark.xdist_group("multi_gpu")
def test_tp2_equals_tp1_nccl(engines, figure):
    _check(engines, "cuda", figure)
