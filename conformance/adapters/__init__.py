"""Engine adapters: one base class (base.py), one module per engine, and where to find them.

    from conformance.adapters import make_adapter, Sampling
    engine = make_adapter("hf")
    engine.load(model_dir, block_size=16)
    results = engine.generate([[5, 6, 7]], [Sampling.greedy(8)])

An engine is named in three ways, looked up in this order:

- ``module:Class`` (``--adapter``): any importable subclass of ``EngineAdapter``;
- a name registered by an installed distribution in the entry-point group
  ``nanovllm.conformance.adapters`` (``myengine = "mypkg.conformance:MyAdapter"``);
- a built-in name: nanovllm (the default), hf (transformers generate + teacher-forced scoring:
  the reference), hf-cb (transformers continuous batching), vllm (vLLM's offline LLM in its own
  virtual environment, driven through a subprocess), openai (any OpenAI-compatible server, by base
  URL and model), llama-cpp (llama-cpp-python in this process).
"""

from __future__ import annotations

import importlib
import warnings
from importlib.metadata import entry_points

from conformance.adapters.base import (  # noqa: F401
    Capability,
    EngineAdapter,
    Logprob,
    Result,
    Sampling,
    Unsupported,
    check_knobs,
    check_params,
)

ENTRY_POINT_GROUP = "nanovllm.conformance.adapters"

BUILTIN = {
    "nanovllm": "conformance.adapters.nanovllm_adapter:NanovllmAdapter",
    "hf": "conformance.adapters.hf_adapter:HFAdapter",
    "hf-cb": "conformance.adapters.hf_cb_adapter:HFContinuousBatchingAdapter",
    "vllm": "conformance.adapters.subprocess_adapter:VLLMAdapter",
    "openai": "conformance.adapters.openai_adapter:OpenAIAdapter",
    "llama-cpp": "conformance.adapters.llama_cpp_adapter:LlamaCppAdapter",
}
ADAPTERS = BUILTIN  # the name older code used


def registered() -> dict[str, str]:
    """Every engine name known here -> "module:Class" (entry points override no built-in: one that
    tries is named in a warning, with the way to run it)."""
    found = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    for name in sorted(found.keys() & BUILTIN.keys()):
        if found[name] != BUILTIN[name]:
            warnings.warn(
                f"entry point {name!r} = {found[name]!r} (group {ENTRY_POINT_GROUP!r}) is ignored: {name!r} is a "
                f"built-in engine; register it under another name or pass --adapter {found[name]}",
                stacklevel=2,
            )
    return {**found, **BUILTIN}


def load_spec(spec: str) -> type[EngineAdapter]:
    """The adapter class of "module:Class"; errors name the spec and what was wrong with it."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(
            f"adapter {spec!r} is not of the form module:Class (a registered engine's name goes to --engine; "
            "see --list-engines)"
        )
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"adapter {spec!r}: cannot import {module!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - e.g. a capability typo in the class body: one line, not a traceback
        raise ValueError(f"adapter {spec!r}: importing {module!r} failed: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"adapter {spec!r}: module {module!r} has no {attr!r}") from None
    if not (isinstance(obj, type) and issubclass(obj, EngineAdapter)):
        raise ValueError(f"adapter {spec!r} is {obj!r}, not a subclass of conformance.adapters.base.EngineAdapter")
    if not obj.name:
        raise ValueError(f"adapter {spec!r} sets no name")
    return obj


def adapter_class(name: str) -> type[EngineAdapter]:
    """The adapter class for an engine name or a "module:Class" spec."""
    if ":" in name:
        return load_spec(name)
    known = registered()
    if name not in known:
        raise KeyError(
            f"unknown engine {name!r}; known: {', '.join(sorted(known))} "
            f"(or pass --adapter module:Class; installed packages register names in the "
            f"entry-point group {ENTRY_POINT_GROUP!r})"
        )
    return load_spec(known[name])


def make_adapter(name: str) -> EngineAdapter:
    return adapter_class(name)()
