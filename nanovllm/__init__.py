"""nanovllm: a compact, readable LLM inference engine in the vLLM lineage.

The public names are imported on first use, so ``import nanovllm.core.scheduler`` (or the
CLI's ``--help``) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"
_EXPORTS = {
    "LLM": "nanovllm.llm",
    "LLMEngine": "nanovllm.engine.engine",
    "AsyncLLM": "nanovllm.engine.async_llm",
    "EngineConfig": "nanovllm.config",
    "SamplingParams": "nanovllm.sampling_params",
    "RequestOutputKind": "nanovllm.sampling_params",
    "RequestOutput": "nanovllm.outputs",
    "CompletionOutput": "nanovllm.outputs",
    "Logprob": "nanovllm.outputs",
    "RequestMetrics": "nanovllm.outputs",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # re-exports (the `X as X` form says so to ruff and mypy)
    from nanovllm.config import EngineConfig as EngineConfig
    from nanovllm.engine.async_llm import AsyncLLM as AsyncLLM
    from nanovllm.engine.engine import LLMEngine as LLMEngine
    from nanovllm.llm import LLM as LLM
    from nanovllm.outputs import CompletionOutput as CompletionOutput
    from nanovllm.outputs import Logprob as Logprob
    from nanovllm.outputs import RequestMetrics as RequestMetrics
    from nanovllm.outputs import RequestOutput as RequestOutput
    from nanovllm.sampling_params import RequestOutputKind as RequestOutputKind
    from nanovllm.sampling_params import SamplingParams as SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
