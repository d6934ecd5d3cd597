"""What the checks share: a pool of loaded engines, capability gates, timeouts, figures.

Checks never import an engine: they ask the ``engines`` fixture (an
:class:`EnginePool`) for one by model directory and knobs. A knob or request the
engine cannot take ends the check with a skip that says "engine X lacks capability Y"
(or "engine X is not available here: why"); nothing passes silently, and the plugin counts
these skips, by those words, against the run (more than half of the checks unchecked fails it).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import NoReturn

import pytest

from conformance.adapters import Result, Sampling, Unsupported, adapter_class
from conformance.adapters.base import KNOB_CAPABILITY, Capability
from conformance.compare import DELTA, LOGPROB_RTOL, LOGPROB_TOL, MAX_DIVERGED_FRAC

DEFAULT_KNOBS = {"dtype": "float32", "seed": 0}
BS = 16  # the block size the golden prompts are built around (the default where the engine allows it)


def skip_lacking(engine_name: str, capability, detail: str = "") -> NoReturn:
    """Skip a check the engine cannot take, naming the capability (the plugin counts these)."""
    cap = Capability.parse(capability)
    pytest.skip(f"engine {engine_name} lacks capability {cap}" + (f" ({detail})" if detail else ""))


def require(engine, *capabilities) -> None:
    for cap in capabilities:
        if Capability.parse(cap) not in engine.capabilities:
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

    def __init__(self, name: str, max_live: int | None = None, block_size: int | None = None, device: str = "cpu"):
        self.device = device
        self.cls = adapter_class(name)
        self.name = self.cls.name if ":" in name else name
        self.reason = self.cls.unavailable()
        # every engine of the pool gets this block size unless a check asks for another one
        self.bs = block_size or self.cls.preferred_block_size or BS
        self.max_live = max_live or self.cls.max_live
        self._live: OrderedDict = OrderedDict()
        self._owned: list = []

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What the engine can do (from a fresh, unloaded adapter)."""
        if not hasattr(self, "_caps"):
            self._check_available()
            self._caps = Capability.set_of(self.cls().capabilities)
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
        if Capability.BLOCK_SIZE in engine.capabilities:
            defaults["block_size"] = self.bs
        gib = os.environ.get("CONFORMANCE_KV_CACHE_GIB")
        if gib and knobs.get("device", self.device) == "cuda" and Capability.KV_BUDGET in engine.capabilities:
            # several engines share a GPU (pytest-xdist workers, pooled engines): each gets this much
            # KV cache instead of sizing itself from the whole device
            defaults["kv_cache_gib"] = float(gib)
        if knobs.get("device", self.device) == "cuda" and Capability.MAX_NUM_SEQS in engine.capabilities:
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
        return call_with_timeout(lambda: engine.generate(prompts, list(params)), timeout, f"{engine.name}.generate")
    except Unsupported as e:
        skip_lacking(engine.name, e.capability, e.detail)


def tokens(results: list[Result]) -> list[list[int]]:
    return [r.token_ids for r in results]


def golden_step_logprobs(case: dict) -> list[dict[int, float]]:
    """The golden top-k of each greedy step as {token: logprob} (what compare_greedy indexes)."""
    return [dict(zip(ids, lps)) for ids, lps in zip(case["top_ids"], case["top_lps"])]


def margin_shares(cases: list[dict], deltas=(1e-4, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 1.5)) -> tuple[int, dict]:
    """(golden steps, {delta: share of them whose top-1 beats the top-2 by more than delta}): how
    much a greedy rule at that delta still checks (a wrong token there fails)."""
    gaps = [c["top_lps"][t][0] - c["top_lps"][t][1] for c in cases for t in range(len(c["greedy"]))]
    return len(gaps), {d: sum(x > d for x in gaps) / len(gaps) for d in deltas}


def golden_divergence(case: dict, tokens: list[int], prompt_logprobs) -> dict:
    """How an engine's greedy tokens and prompt logprobs leave one golden case: the first step
    where its tokens differ (None: none), the reference's margin there (its logprob of its own
    token minus that of the engine's; None when the engine's token is outside the recorded top-k)
    and the largest prompt-logprob difference. ``prompt_logprobs[p]`` maps token -> an object with
    ``.logprob`` (vLLM's shape). What the margin scripts tabulate to choose a delta."""
    ref = case["greedy"]
    step = next((t for t, (a, b) in enumerate(zip(ref, tokens)) if a != b), None)
    margin = None
    if step is not None:
        lps = golden_step_logprobs(case)[step]
        margin = lps[ref[step]] - lps[tokens[step]] if tokens[step] in lps else None
    prompt = case["prompt"]
    diffs = [abs(prompt_logprobs[p][prompt[p]].logprob - case["prompt_lps"][p - 1]) for p in range(1, len(prompt))]
    return {
        "case": case["id"],
        "first_divergence": step,
        "ref_margin": margin,
        "max_prompt_logprob_diff": max(diffs, default=0.0),
    }


def arithmetic(dtype: str, engine=None) -> str:
    """What the engine computed in: its adapter's ``arithmetic`` (quantized weights) or the dtype."""
    return getattr(engine, "arithmetic", None) or dtype


def _measured(table: dict, dtype: str, engine) -> float:
    key = arithmetic(dtype, engine)
    if key not in table:
        raise KeyError(
            f"no delta or tolerance measured for arithmetic {key!r} (known: {', '.join(table)}); "
            f"measure it with scripts/quantized_margins.py and add it to conformance/compare.py"
        )
    return table[key]


def delta(dtype: str = "float32", engine=None) -> float:
    """The greedy rule's near-tie margin for this dtype, or for the engine's own arithmetic."""
    return _measured(DELTA, dtype, engine)


def logprob_tol(dtype: str = "float32", engine=None) -> float:
    """The logprob tolerance for this dtype, or for the engine's own arithmetic."""
    return _measured(LOGPROB_TOL, dtype, engine)


def logprob_rtol(dtype: str = "float32", engine=None) -> float:
    """The relative part of the logprob tolerance (for floats the same as the absolute one)."""
    return _measured(LOGPROB_RTOL, dtype, engine)


def assert_logprobs_close(got, want, dtype: str = "float32", engine=None, msg=None) -> None:
    """Logprobs within the arithmetic's measured tolerance, ``atol + rtol * |want|``. One place
    picks both parts from their own tables: for floats the two tables hold the same numbers, so a
    check that passed one table's value as the other's would look right there and be 0.3 nats
    (Q4_1) or 0.75 (FP8 KV cache) per unit of |logprob| too lenient on quantized engines."""
    import torch  # the checks that compare logprobs need it; the harness's other users do not

    torch.testing.assert_close(got, want, atol=logprob_tol(dtype, engine), rtol=logprob_rtol(dtype, engine), msg=msg)


def max_diverged_frac(dtype: str = "float32", engine=None) -> float:
    """The share of sequences that may diverge at near-ties, for this dtype or arithmetic."""
    return _measured(MAX_DIVERGED_FRAC, dtype, engine)
