"""Admission control. A request that can never run ends with a clear error
(an exception naming the limit, or a result with an error finish reason) within a time limit,
never a hang; afterwards the engine still serves a normal request correctly."""

from __future__ import annotations

import re

import pytest

import golden
from conformance.adapters import Sampling
from conformance.adapters.base import GREEDY
from conformance.harness import EngineHung, generate, require, tokens

MODEL = "llama-1kv-hd128"
TIMEOUT = 120.0


def _expect_refusal(engines, engine, prompt, params, numbers: tuple[int, ...]):
    try:
        outs = generate(engine, [prompt], params, timeout=TIMEOUT)
    except EngineHung as e:
        engines.discard(engine)
        pytest.fail(f"engine {engine.name} hung on an infeasible request: {e}")
    except Exception as e:  # noqa: BLE001 - any error is fine if it is clear
        return _clear(e, numbers)
    out = outs[0]
    assert out.finish_reason not in ("stop", "length", None), (
        f"an infeasible request finished normally ({out.finish_reason}) with {len(out.token_ids)} tokens"
    )
    return out.finish_reason


def _clear(e: Exception, numbers: tuple[int, ...]) -> str:
    """A clear error names the sizes involved: at least two of ``numbers`` (e.g. the prompt length
    and the limit), so an IndexError deep inside a model does not count."""
    msg = str(e)
    named = {n for n in numbers if re.search(rf"\b{n}\b", msg)}
    assert len(named) >= 2, (
        f"the error does not name the size and the limit (any two of {numbers}): {type(e).__name__}: {msg!r}"
    )
    return f"{type(e).__name__}: {msg}"


def _still_works(engine, g):
    case = next(c for c in g["cases"] if c["id"] == "len-bs+1")
    got = tokens(generate(engine, [case["prompt"]], Sampling.greedy(8), timeout=TIMEOUT))[0]
    assert got == case["greedy"][:8], "after refusing a request the engine no longer matches the reference"


def test_prompt_longer_than_max_model_len(engines, figure):
    g = golden.load(MODEL)
    engine = engines.get(golden.model_dir(g), max_model_len=64)
    require(engine, GREEDY)
    prompt = next(c for c in g["cases"] if c["id"] == "len-5bs+3")["prompt"]  # 83 tokens > 64
    what = _expect_refusal(engines, engine, prompt, Sampling.greedy(4), (83, 64))
    figure("refusal", what[:60])
    _still_works(engine, g)


def test_request_larger_than_the_whole_kv_cache(engines, figure):
    g = golden.load(MODEL)
    # 128 slots (8 blocks of 16); the request needs 83 + 100 - 1 = 182 slots (12 blocks of 16)
    bs = engines.bs
    kv_blocks, need = 128 // bs, -(-182 // bs)
    numbers = (kv_blocks, need, 128, 182, 183, 256, 83, 100)
    try:
        engine = engines.get(golden.model_dir(g), kv_blocks=kv_blocks, **engines.optional(max_model_len=256))
    except Exception as e:  # noqa: BLE001 - an engine may refuse the configuration itself
        # (vLLM does: no max_model_len its KV cache cannot hold); it must name that length and
        # what fits instead (an engine may keep blocks aside, so the figure may be below 128)
        msg = str(e)
        assert re.search(r"\b256\b", msg) and len(set(re.findall(r"\b\d+\b", msg)) - {"256"}) >= 1, (
            f"the configuration was refused without naming max_model_len=256 and the capacity: {msg!r}"
        )
        figure("refusal", "at load: " + msg[:60])
        return
    require(engine, GREEDY)
    prompt = next(c for c in g["cases"] if c["id"] == "len-5bs+3")["prompt"]
    what = _expect_refusal(engines, engine, prompt, Sampling.greedy(100), numbers)
    figure("refusal", what[:60])
    _still_works(engine, g)
