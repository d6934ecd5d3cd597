"""Fixtures shared by the unit and end-to-end tests (CPU)."""
from __future__ import annotations

import functools

import pytest

from conformance.zoo import ZOO, zoo_model

ZOO_NAMES = list(ZOO)


@functools.lru_cache(maxsize=None)
def cached_llm(model: str | None, **kwargs):
    """One engine per (model, args) per test process: loading is the slow part."""
    from nanovllm import LLM

    return LLM(model, **kwargs)


@functools.lru_cache(maxsize=None)
def hf_reference(model: str):
    from conformance.reference import HFReference

    return HFReference(model)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from nanovllm.loader.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"default model not installed: {e}")


@pytest.fixture(scope="session")
def smollm(smollm_path):
    return cached_llm(None, seed=0)


@pytest.fixture(params=ZOO_NAMES)
def zoo_name(request) -> str:
    return request.param


def prompts_for(vocab_size: int, lengths, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(5, vocab_size, size=n).tolist() for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]
