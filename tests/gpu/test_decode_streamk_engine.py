"""The stream-K decode in the engine (``NANOVLLM_DECODE_STREAMK``, an experiment; KERNEL_NOTES
session 25): with CUDA graphs captured on it, the same greedy tokens as the shipped decode kernel.
The model is float32, whose dots are exact: the two kernels then differ only in the order of their
sums, far below the logit gaps greedy decoding depends on. Both a 16-bit-sized (auto) and an FP8
cache."""

from __future__ import annotations

import pytest
import torch

from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from tests.conftest import engine_args, prompts_for

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

MODEL = "qwen3-gqa4-hd128"


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_streamk_decode_gives_the_shipped_kernels_tokens(kv, monkeypatch):
    from nanovllm.attention import decode_streamk, triton_backend

    if kv == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability 8.9 or newer")
    calls = []
    real = decode_streamk.paged_decode_streamk
    monkeypatch.setattr(
        decode_streamk, "paged_decode_streamk", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw)
    )
    prompts = prompts_for(ZOO[MODEL].vocab_size, [3, 17, 40, 90, 130, 300], seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(mode: str) -> list[list[int]]:
        monkeypatch.setattr(triton_backend, "DECODE_STREAMK", mode)
        with LLM(zoo_model(MODEL), **engine_args("cuda", kv_cache_dtype=kv, max_model_len=512)) as llm:
            assert llm.llm_engine.executor.runner.graphs is not None, "the decode steps must run as CUDA graphs"
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]

    shipped = run("0")
    assert calls == [], "switch off: the shipped kernel only"
    streamk = run("1")
    assert calls, "switch on: the graphs were captured on the stream-K kernel"
    assert streamk == shipped
    # control: the same engine with the stream-K kernel told a wrong softmax scale gives other tokens
    monkeypatch.setattr(
        decode_streamk,
        "paged_decode_streamk",
        lambda q, k, v, bt, sl, scale, **kw: real(q, k, v, bt, sl, 4 * scale, **kw),
    )
    assert run("1") != shipped, "control: a wrong stream-K kernel must change the tokens"
