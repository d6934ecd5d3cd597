"""The FP8 KV cache on the GPU engine (Triton kernels, CUDA graphs), end to end.

- CUDA graphs give the eager tokens (the same kernels; padding rows must not disturb real ones);
- the GPU engine with an FP8 cache against the CPU engine with an FP8 cache (float32 weights: the
  same arithmetic up to float32 rounding, which can move a value across an e4m3 rounding
  boundary): greedy by the tie-aware rule at the FP8 delta, judged with the CPU engine's own
  logprobs, and at least half the sequences exact.
The accuracy of FP8 against transformers is checked on the CPU, on the default model
(tests/test_kv_cache_fp8.py: its weights are not on GPU hosts)."""

from __future__ import annotations

import pytest
import torch

from conformance.compare import DELTA, FP8_KV, compare_greedy
from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from tests.conftest import engine_args, prompts_for

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("float8 needs compute capability 8.9 or newer", allow_module_level=True)

MODEL = "qwen3-gqa4-hd128"


def _generate(llm: LLM, prompts, logprobs: bool = False):
    params = [
        SamplingParams(temperature=0, max_tokens=24 - i % 9, ignore_eos=True, logprobs=5 if logprobs else None)
        for i in range(len(prompts))
    ]
    return llm.generate(prompts, params, use_tqdm=False)


def test_fp8_cache_graphs_equal_eager_and_match_the_cpu_engine():
    model = zoo_model(MODEL)
    prompts = prompts_for(ZOO[MODEL].vocab_size, [1, 5, 17, 40, 64, 100, 130, 3, 9], seed=11)
    got = {}
    for eager in (False, True):
        llm = LLM(model, **engine_args("cuda", kv_cache_dtype="fp8", enforce_eager=eager))
        got[eager] = [list(o.outputs[0].token_ids) for o in _generate(llm, prompts)]
        llm.close()
    assert got[False] == got[True], "CUDA graphs and eager differ on an FP8 cache"
    cpu = LLM(model, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    ref = _generate(cpu, prompts, logprobs=True)
    cpu.close()
    ref_tokens = [list(o.outputs[0].token_ids) for o in ref]
    ref_lps = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in ref]
    report = compare_greedy(ref_tokens, ref_lps, got[False], DELTA[FP8_KV], 0.5)
    assert report.ok, report.summary()
    assert report.num_exact >= len(prompts) // 2, report.summary()
