"""Tensor parallelism. TP=2 against the reference and TP=1, on a model with one
KV head (replicated over the ranks) and an odd vocabulary (1001: uneven vocabulary shards); TP=4 on
a model with 2 KV heads and 8 query heads, so each KV head is replicated on 2 ranks (the layout
where a wrong rank -> KV head formula shows: TP=2 has only whole heads per rank or one head
everywhere); and a TP size the heads do not split into is refused at load, naming both.
On CPU the ranks talk over gloo; with two GPUs over NCCL (marker multi_gpu)."""

from __future__ import annotations

import re

import pytest
import torch

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import GREEDY, PROMPT_LOGPROBS
from conformance.compare import LOGPROB_TOL, compare_greedy
from conformance.harness import delta, generate, golden_step_logprobs, require, tokens
from conformance.zoo import ZOO

MODEL = "llama-1kv-hd128"
MODEL_TP4 = "qwen3-gqa4-hd128"  # 8 query heads, 2 KV heads
CASES = ("len1", "len-bs", "len-bs+1", "len-5bs+3", "prefix-2bs-a")


def _check(engines, device, figure, model=MODEL, tp=2):
    g = golden.load(model)
    picked = [c for c in g["cases"] if c["id"] in CASES]
    knobs = dict(tp=tp, device=device, **engines.optional(max_model_len=512))
    # TP=2 is shared (cheap to keep); a TP=4 engine's four workers are closed after the check
    tpn = engines.get(golden.model_dir(g), **knobs) if tp == 2 else engines.fresh(golden.model_dir(g), **knobs)
    require(tpn, GREEDY)
    got = tokens(generate(tpn, [c["prompt"] for c in picked], Sampling.greedy(32)))
    # TP=n equal to TP=1 holds trivially where only one rank ran: an engine that reports its ranks
    # (stats' tensor_parallel_size) must report n
    ranks = tpn.stats().get("tensor_parallel_size")
    figure("ranks reported", "not reported" if ranks is None else ranks)
    assert ranks in (None, tp), f"TP={tp} asked, the engine reports {ranks} rank(s)"
    report = compare_greedy(
        [c["greedy"][:32] for c in picked], [golden_step_logprobs(c) for c in picked], got, delta(g["dtype"])
    )
    figure("exact", f"{report.num_exact}/{report.num_seqs}")
    assert report.num_exact == report.num_seqs, f"TP={tp} vs reference: {report.summary()}"
    tp1 = engines.get(golden.model_dir(g), device=device, **engines.optional(max_model_len=512))
    assert tokens(generate(tp1, [c["prompt"] for c in picked], Sampling.greedy(32))) == got, f"TP={tp} vs TP=1"
    require(tpn, PROMPT_LOGPROBS)
    outs = generate(tpn, [c["prompt"] for c in picked], Sampling.greedy(1, prompt_logprobs=1))
    worst = 0.0
    for c, out in zip(picked, outs):
        gotl = torch.tensor(
            [out.prompt_logprobs[p][c["prompt"][p]].logprob for p in range(1, len(c["prompt"]))], dtype=torch.float64
        )
        want = torch.tensor(c["prompt_lps"], dtype=torch.float64)
        if len(want):
            worst = max(worst, float((gotl - want).abs().max()))
    figure("max logprob diff", worst)
    assert worst <= LOGPROB_TOL[g["dtype"]], f"TP={tp} prompt logprobs differ from the reference by {worst:.3g}"


@pytest.mark.pinned_device
def test_tp2_equals_tp1_gloo_cpu(engines, figure):
    _check(engines, "cpu", figure)


@pytest.mark.pinned_device
def test_tp4_replicated_kv_heads_gloo_cpu(engines, figure):
    _check(engines, "cpu", figure, model=MODEL_TP4, tp=4)


@pytest.mark.pinned_device
def test_tp_size_that_does_not_split_the_heads_is_refused(engines, figure):
    g = golden.load(MODEL_TP4)
    heads, kv_heads = ZOO[MODEL_TP4].num_heads, ZOO[MODEL_TP4].num_kv_heads
    try:
        engines.fresh(golden.model_dir(g), tp=3, device="cpu")
    except Exception as e:  # noqa: BLE001 - any error is fine if it is clear
        msg = str(e)
        assert re.search(r"\b3\b", msg) and re.search(rf"\b({heads}|{kv_heads})\b", msg), (
            f"the refusal does not name tensor_parallel_size=3 and the head count {heads}: {msg!r}"
        )
        figure("refusal", msg[:60])
        return
    pytest.fail(f"tensor_parallel_size=3 was accepted for a model with {heads} query and {kv_heads} KV heads")


@pytest.mark.multi_gpu
@pytest.mark.pinned_device
@pytest.mark.xdist_group("multi_gpu")
def test_tp2_equals_tp1_nccl(engines, figure):
    _check(engines, "cuda", figure)
