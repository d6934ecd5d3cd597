"""The FP8 KV cache (``kv_cache_dtype="fp8"``: float8 e4m3, per-layer K and V scales).

- storage: what the cache returns is the nearest e4m3 value of x / scale, times the scale (within
  half a step of e4m3's 3-bit mantissa), out-of-range values saturate instead of becoming NaN,
  and the scale keeps small values out of e4m3's subnormals; a coarser format fails the bound
  (negative control);
- capacity: the same KV memory holds as many times more blocks as the element is smaller (4x a
  float32 cache, 2x a bfloat16 one);
- accuracy, end to end on the default model (real weights) against the golden transformers
  float32 reference (its top-5 completed with the float32 engine's top-20, ``extended_reference``),
  by the conformance greedy rule at the delta measured for the FP8 cache
  (conformance/compare.py, scripts/kv_fp8_margins.py), prompt logprobs within its tolerance; an
  engine that forgets the scale on load is rejected by the same rule (negative control).
  (Random-weight zoo models are not used: their greedy tokens sit on near-ties that bfloat16
  already flips, so FP8 moves them everywhere and no delta would check anything.)
"""

from __future__ import annotations

import functools

import pytest
import torch

import golden
from conformance.compare import DELTA, FP8_KV, LOGPROB_TOL, MAX_DIVERGED_FRAC, compare_greedy
from conformance.harness import golden_step_logprobs
from nanovllm import LLM, SamplingParams
from nanovllm.attention import torch_ref
from tests.conftest import require_default_model

E4M3_HALF_STEP = 2.0**-4  # relative: 3 mantissa bits -> steps of 2^-3 of the binade


def _round_trip(x: torch.Tensor, scale: float, quantize=None) -> torch.Tensor:
    """Through the engine's store and load (or, for the control, through ``quantize``)."""
    cache = torch.zeros(1, x.shape[0], 1, x.shape[-1], dtype=torch_ref.FP8)
    if quantize is None:
        torch_ref.store_kv(x[:, None], x[:, None], cache, cache.clone(), torch.arange(x.shape[0]), scale, scale)
        return torch_ref.gather_kv(cache, torch.tensor([0]), x.shape[0], scale)[:, 0]
    return quantize(x / scale).float() * scale


def _within_half_step(back: torch.Tensor, x: torch.Tensor) -> bool:
    return bool(((back - x).abs() <= E4M3_HALF_STEP * x.abs() + 1e-12).all())


@pytest.mark.parametrize("scale", [1.0, 0.25, 8.0])
def test_round_trip_is_the_nearest_e4m3_value(scale):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=gen) * 20 * scale  # normal range of e4m3 at this scale
    x = x[(x.abs() / scale > 2.0**-6).all(1)]
    back = _round_trip(x, scale)
    assert _within_half_step(back, x)
    assert not torch.equal(back, x), "float8 must round (a cache that kept float32 would pass the bound vacuously)"


def test_coarser_format_fails_the_bound():
    """Negative control: e5m2 (2 mantissa bits) breaks the half-step bound of e4m3."""
    x = torch.linspace(1.0, 2.0, 97)[None].repeat(2, 1)
    e5m2 = _round_trip(x, 1.0, quantize=lambda t: t.to(torch.float8_e5m2))
    assert not _within_half_step(e5m2, x)
    assert _within_half_step(_round_trip(x, 1.0), x)


def test_out_of_range_saturates_and_the_scale_keeps_small_values():
    big = torch.tensor([[1e4, -1e4, 447.0, 449.0]])
    back = _round_trip(big, 1.0)
    assert torch.isfinite(back).all() and back.abs().max() == 448.0
    small = torch.full((1, 8), 3e-4)  # below e4m3's smallest normal (2^-6) at scale 1
    assert not _within_half_step(_round_trip(small, 1.0), small)
    assert _within_half_step(_round_trip(small, 2.0**-12), small)


def test_bad_kv_cache_dtype_names_the_field():
    for bad in ("int8", "fp8_e5m2", 8):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            LLM(None, device="cpu", kv_cache_dtype=bad)


def test_fp8_cache_holds_more_blocks_in_the_same_memory():
    from conformance.zoo import zoo_model

    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(zoo_model("qwen3-gqa2-hd64-tied"), device="cpu", kv_cache_memory_gib=0.01, kv_cache_dtype=kv)
        blocks[kv] = llm.stats()["num_kv_blocks"]
        llm.close()
    # float32 model: 4 bytes -> 1 per element; each count is floor(budget / block bytes)
    assert 4 * blocks["auto"] <= blocks["fp8"] < 4 * (blocks["auto"] + 1), blocks


EXTENDED_TOP = 20  # the float32 engine's logprobs per step, beyond the golden file's top-5


@functools.cache
def extended_reference() -> list[list[dict[int, float]]]:
    """Each golden case's per-step reference logprobs, the recorded top-5 completed with the
    float32 engine's top-20 on the same contexts (the prompt and the golden greedy tokens before
    the step, scored in one pass as prompt logprobs): an FP8 engine's token outside the recorded
    top-5 then has a known margin instead of failing as unknown. Valid because the float32 engine
    is the reference here: every recorded logprob must agree within 1e-3 (it agrees to 1e-4,
    tests/test_golden*), checked for each one. Computed once for both tests that use it."""
    g = golden.load(golden.SMOLLM)
    llm = LLM(golden.model_dir(g), device="cpu", dtype="float32")
    try:
        scored = llm.generate(
            [{"prompt_token_ids": c["prompt"] + c["greedy"]} for c in g["cases"]],
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=EXTENDED_TOP),
            use_tqdm=False,
        )
    finally:
        llm.close()
    refs = []
    for c, out in zip(g["cases"], scored):
        steps = []
        for t, recorded in enumerate(golden_step_logprobs(c)):
            engine = {tok: lp.logprob for tok, lp in out.prompt_logprobs[len(c["prompt"]) + t].items()}
            for tok, lp in recorded.items():
                if tok in engine:
                    assert abs(engine[tok] - lp) <= 1e-3, (c["id"], t, tok, engine[tok], lp)
            steps.append({**engine, **recorded})
        refs.append(steps)
    return refs


def _golden_run(kv: str, forget_scale: bool = False):
    require_default_model()
    g = golden.load(golden.SMOLLM)
    reference = extended_reference()
    llm = LLM(golden.model_dir(g), device="cpu", dtype="float32", kv_cache_dtype=kv)
    load = torch_ref._load
    if forget_scale:  # the wrong engine: K stored at scale 0.5, read back at 1.0
        for layer in llm.llm_engine.executor.runner.attn_layers:
            layer.k_scale = 0.5
        torch_ref._load = lambda t, cache_dtype, scale: load(t, cache_dtype, 1.0)
    try:
        prompts = [{"prompt_token_ids": c["prompt"]} for c in g["cases"]]
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=g["max_tokens"], ignore_eos=True), use_tqdm=False
        )
        scored = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    finally:
        torch_ref._load = load
        llm.close()
    got = [list(o.outputs[0].token_ids) for o in outs]
    report = compare_greedy(
        [c["greedy"] for c in g["cases"]],
        reference,
        got,
        DELTA[FP8_KV],
        MAX_DIVERGED_FRAC[FP8_KV],
    )
    diffs = [
        abs(s.prompt_logprobs[p][c["prompt"][p]].logprob - c["prompt_lps"][p - 1])
        for c, s in zip(g["cases"], scored)
        for p in range(1, len(c["prompt"]))
    ]
    return report, max(diffs)


def test_fp8_cache_passes_the_greedy_rule_on_the_default_model():
    report, lp_diff = _golden_run("fp8")
    assert report.ok, report.summary()
    assert lp_diff <= LOGPROB_TOL[FP8_KV], f"prompt logprobs differ by {lp_diff:.4f} > {LOGPROB_TOL[FP8_KV]}"


def test_an_fp8_cache_that_forgets_its_scale_is_rejected():
    report, lp_diff = _golden_run("fp8", forget_scale=True)
    assert not report.ok or lp_diff > LOGPROB_TOL[FP8_KV], report.summary()
    assert not report.ok, f"the greedy rule at delta {DELTA[FP8_KV]} accepts a wrong engine: {report.summary()}"


def test_golden_divergence_row():
    """The margin scripts' per-case row (conformance.harness.golden_divergence): the first step
    that leaves the reference, the reference's margin there (None outside its top-k) and the
    largest prompt-logprob difference; no divergence gives None."""
    from types import SimpleNamespace

    from conformance.harness import golden_divergence

    case = {
        "id": "c",
        "prompt": [5, 6, 7],
        "prompt_lps": [-1.0, -2.0],
        "greedy": [1, 2, 3],
        "top_ids": [[1, 9], [2, 8], [3, 4]],
        "top_lps": [[-0.1, -0.5], [-0.2, -0.3], [-0.1, -2.0]],
    }
    plp = [None, {6: SimpleNamespace(logprob=-1.25)}, {7: SimpleNamespace(logprob=-2.0)}]
    same = golden_divergence(case, [1, 2, 3], plp)
    assert same["first_divergence"] is None and same["ref_margin"] is None
    assert same["max_prompt_logprob_diff"] == pytest.approx(0.25)
    row = golden_divergence(case, [1, 8, 3], plp)
    assert row["first_divergence"] == 1 and row["ref_margin"] == pytest.approx(0.1)
    assert golden_divergence(case, [1, 2, 99], plp)["ref_margin"] is None  # outside the top-k
    from conformance.harness import margin_shares

    # top-1 minus top-2 per step: 0.4, 0.1, 1.9
    assert margin_shares([case], deltas=(0.05, 0.3, 1.5, 2.0)) == (3, {0.05: 1.0, 0.3: 2 / 3, 1.5: 1 / 3, 2.0: 0.0})


@pytest.mark.parametrize("decode_only", [False, True])
def test_attention_on_an_fp8_cache_reads_each_scale(decode_only):
    """Both CPU attention paths (the per-sequence one, and batched decode) on an FP8 cache with
    different K and V scales equal float32 attention on the dequantized cache. The engine runs
    with scales of 1.0, so a path that used K's scale for V (or none) would pass every engine
    test: here the scales differ. Control: the scales swapped miss the reference."""
    from tests.test_attention_ref import _build

    specs = [(1, 1), (15, 1), (16, 1), (40, 1)] if decode_only else [(1, 1), (17, 17), (40, 5)]
    q, _, _, k_cache, v_cache, meta = _build(specs, 8, 2, 64, 16, seed=5)
    k8, v8 = torch_ref.quantize_fp8(k_cache * 4, 0.5), torch_ref.quantize_fp8(v_cache, 2.0)
    ref = torch_ref.paged_attention(q, k8.float() * 0.5, v8.float() * 2.0, meta, 0.125)
    attend = torch_ref.paged_decode_batched if decode_only else torch_ref.paged_attention
    torch.testing.assert_close(attend(q, k8, v8, meta, 0.125, 0.5, 2.0), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(attend(q, k8, v8, meta, 0.125, 2.0, 0.5), ref, atol=1e-5, rtol=1e-5)
