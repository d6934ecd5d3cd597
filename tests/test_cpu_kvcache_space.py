"""``NANOVLLM_CPU_KVCACHE_SPACE`` (vLLM's ``VLLM_CPU_KVCACHE_SPACE``): the CPU KV cache's GiB when
``kv_cache_memory_gib`` is not given. The test suite sets it (root conftest.py): at the default of
4 GiB per engine, a test worker holding its cached engines reached 50 GB of address space and could
no longer fork a server (ENOMEM)."""

from __future__ import annotations

import pytest

from conformance.zoo import zoo_model
from nanovllm import LLM

MODEL = "llama-mha-hd64"


def _cache_bytes(**kwargs) -> int:
    with LLM(zoo_model(MODEL), device="cpu", dtype="float32", block_size=16, max_model_len=4096, **kwargs) as llm:
        runner = llm.llm_engine.executor.runner
        return runner.num_blocks * runner.kv_bytes_per_block()


def test_the_variable_sizes_the_cpu_cache(monkeypatch):
    monkeypatch.setenv("NANOVLLM_CPU_KVCACHE_SPACE", "0.125")
    small = _cache_bytes()
    monkeypatch.setenv("NANOVLLM_CPU_KVCACHE_SPACE", "0.25")
    large = _cache_bytes()
    assert small <= 0.125 * 2**30 < large <= 0.25 * 2**30, (small, large)
    assert large > 1.9 * small, "control: twice the space, about twice the blocks"
    assert _cache_bytes(kv_cache_memory_gib=0.125) == small, "kv_cache_memory_gib wins over the variable"


@pytest.mark.parametrize("value", ["0", "-1", "lots", "nan"])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("NANOVLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(ValueError, match=f"NANOVLLM_CPU_KVCACHE_SPACE must be a number of GiB > 0, got '{value}'"):
        _cache_bytes()


def test_the_test_suite_sets_it_small():
    """The class the variable guards against: every test process runs with a small CPU KV cache
    unless a test sizes its own (root conftest.py)."""
    import os

    assert float(os.environ["NANOVLLM_CPU_KVCACHE_SPACE"]) <= 1.0
