"""Engine adapters: one protocol (base.py), one module per engine.

    from conformance.adapters import make_adapter, Sampling
    engine = make_adapter("nanovllm")
    engine.load(model_dir, block_size=16)
    results = engine.generate([[5, 6, 7]], [Sampling.greedy(8)])

Names: nanovllm (default), hf (transformers generate + teacher-forced scoring:
the reference), hf-cb (transformers continuous batching), vllm (vLLM's offline
LLM in its own virtual environment, driven through a subprocess), nano-vllm
(upstream nano-vllm, through a subprocess, where it is installed).
"""
from __future__ import annotations

import importlib

from conformance.adapters.base import (EngineAdapter, Logprob, Result, Sampling, Unsupported,  # noqa: F401
                                       check_knobs, check_params)

ADAPTERS = {
    "nanovllm": "conformance.adapters.nanovllm_adapter:NanovllmAdapter",
    "hf": "conformance.adapters.hf_adapter:HFAdapter",
    "hf-cb": "conformance.adapters.hf_cb_adapter:HFContinuousBatchingAdapter",
    "vllm": "conformance.adapters.subprocess_adapter:VLLMAdapter",
    "nano-vllm": "conformance.adapters.subprocess_adapter:NanoVLLMAdapter",
}


def adapter_class(name: str):
    if name not in ADAPTERS:
        raise KeyError(f"unknown engine {name!r}; known: {', '.join(ADAPTERS)}")
    module, cls = ADAPTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_adapter(name: str) -> EngineAdapter:
    return adapter_class(name)()
