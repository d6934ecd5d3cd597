"""What the checks share: a pool of loaded engines, capability gates, timeouts, figures.

Checks never import an engine: they ask the ``engines`` fixture (an
:class:`EnginePool`) for one by model directory and knobs. A knob or request the
engine cannot take ends the check with ``pytest.skip("engine X lacks capability
Y")``; nothing passes silently.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict

import pytest

from conformance.adapters import Result, Sampling, Unsupported, adapter_class
from conformance.adapters.base import KNOB_CAPABILITY
from conformance.compare import DELTA

DEFAULT_KNOBS = {"dtype": "float32", "seed": 0}
BS = 16  # the block size the golden prompts are built around (the default where the engine allows it)


def skip_lacking(engine_name: str, capability: str, detail: str = ""):
    pytest.skip(f"engine {engine_name} lacks capability {capability}" + (f" ({detail})" if detail else ""))


def require(engine, *capabilities: str) -> None:
    for cap in capabilities:
        if cap not in engine.capabilities:
            skip_lacking(engine.name, cap)


class EngineHung(AssertionError):
    pass


def call_with_timeout(fn, timeout: float, what: str):
    """Run fn() in a thread; raise EngineHung if it has not returned after ``timeout`` seconds."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
    t = threading.Thread(target=target, daemon=True, name="conformance-call")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise EngineHung(f"{what} did not return within {timeout:.0f} s (a hang)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class EnginePool:
    """Loaded engines of one kind, shared by the checks of one test process (loading is slow).

    ``get`` returns a shared engine for (model, knobs); ``fresh`` a new one that
    the caller owns (cold prefix cache). Engines that run in their own process
    (vLLM) are capped at ``max_live`` at a time, least recently used closed first.
    """

    def __init__(self, name: str, max_live: int | None = None, block_size: int | None = None,
                 device: str = "cpu"):
        self.name = name
        self.device = device
        self.cls = adapter_class(name)
        self.reason = self.cls.unavailable()
        # every engine of the pool gets this block size unless a check asks for another one
        self.bs = block_size or getattr(self.cls, "preferred_block_size", BS)
        self.max_live = max_live or getattr(self.cls, "max_live", 8)
        self._live: OrderedDict = OrderedDict()
        self._owned: list = []

    @property
    def capabilities(self) -> frozenset[str]:
        """What the engine can do (from a fresh, unloaded adapter)."""
        if not hasattr(self, "_caps"):
            self._caps = self.cls().capabilities
        return self._caps

    def optional(self, **knobs) -> dict:
        """The knobs the engine can take: for settings a check merely prefers (e.g. a smaller
        max_model_len that another engine needs to size its cache), not ones it relies on."""
        return {k: v for k, v in knobs.items() if KNOB_CAPABILITY.get(k, k) in self.capabilities}

    def _check_available(self) -> None:
        if self.reason:
            pytest.skip(f"engine {self.name} is not available here: {self.reason}")

    def _load(self, model_dir: str, knobs: dict):
        self._check_available()
        engine = self.cls()
        defaults = dict(DEFAULT_KNOBS, device=self.device)
        if "block_size" in engine.capabilities:
            defaults["block_size"] = self.bs
        gib = os.environ.get("CONFORMANCE_KV_CACHE_GIB")
        if gib and knobs.get("device", self.device) == "cuda" and "kv_budget" in engine.capabilities:
            # several engines share a GPU (pytest-xdist workers, pooled engines): each gets this much
            # KV cache instead of sizing itself from the whole device
            defaults["kv_cache_gib"] = float(gib)
        if knobs.get("device", self.device) == "cuda" and "max_num_seqs" in engine.capabilities:
            defaults["max_num_seqs"] = 64  # every check's batch fits; fewer CUDA graphs to capture
        try:
            engine.load(model_dir, **{**defaults, **knobs})
        except Unsupported as e:
            engine.close()
            skip_lacking(self.name, e.capability, e.detail)
        return engine

    def get(self, model_dir: str, **knobs):
        key = (model_dir, tuple(sorted(knobs.items())))
        engine = self._live.pop(key, None)
        if engine is None:
            while len(self._live) >= self.max_live:
                _, old = self._live.popitem(last=False)
                old.close()
            engine = self._load(model_dir, knobs)
        self._live[key] = engine
        return engine

    def discard(self, engine) -> None:
        """Forget (and close) an engine a check left in an unknown state (e.g. after a hang)."""
        for key, e in list(self._live.items()):
            if e is engine:
                del self._live[key]
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - it is being thrown away
            pass

    def fresh(self, model_dir: str, **knobs):
        engine = self._load(model_dir, knobs)
        self._owned.append(engine)
        return engine

    def close_owned(self) -> None:
        while self._owned:
            self._owned.pop().close()

    def close(self) -> None:
        self.close_owned()
        while self._live:
            self._live.popitem()[1].close()


def generate(engine, prompts: list[list[int]], params, timeout: float | None = None) -> list[Result]:
    """engine.generate with one Sampling for all or one per prompt; a missing capability skips."""
    if isinstance(params, Sampling):
        params = [params] * len(prompts)
    try:
        if timeout is None:
            return engine.generate(prompts, list(params))
        return call_with_timeout(lambda: engine.generate(prompts, list(params)), timeout,
                                 f"{engine.name}.generate")
    except Unsupported as e:
        skip_lacking(engine.name, e.capability, e.detail)


def tokens(results: list[Result]) -> list[list[int]]:
    return [r.token_ids for r in results]


def golden_step_logprobs(case: dict) -> list[dict[int, float]]:
    """The golden top-k of each greedy step as {token: logprob} (what compare_greedy indexes)."""
    return [dict(zip(ids, lps)) for ids, lps in zip(case["top_ids"], case["top_lps"])]


def delta(dtype: str = "float32") -> float:
    return DELTA[dtype]
