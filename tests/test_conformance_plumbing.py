"""The verifier's plumbing at the boundaries it guards: the report's counts, the engine pool's
key, the GPU gate, model matching.

Each of these was broken on purpose by a blind bug hunt (2026-12-07) and the suite still passed,
because the run at hand never reached the boundary: no check errored, no two checks asked for
one knob at two values in one process, the host had no GPU, the adapter's model always matched.
So each is checked here on both sides of its boundary.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from conformance.__main__ import tally
from conformance.harness import EnginePool
from conformance.models import same_model
from conformance.plugin import gpu_shortfall
from conformance.zoo import zoo_model


def _row(result: str, status: str | None) -> dict:
    return {"check": "m::c", "seconds": 0.0, "result": result, "message": "", "figures": {}, "status": status}


def test_report_counts_an_errored_check_as_failed():
    """A check whose fixture raised (an engine that crashed while loading) is an ERROR in the junit
    file: the report must count it failed, as pytest's exit status does, never as nothing."""
    rows = [_row("pass", "checked"), _row("ERROR", "failed"), _row("FAIL", "failed"), _row("skip", "skipped")]
    t = tally(rows)
    assert (t["passed"], t["failed"], t["other_skips"]) == (1, 2, 1)
    # control: without the errored row, one failure
    assert tally([r for r in rows if r["result"] != "ERROR"])["failed"] == 1


def test_report_keeps_self_tests_apart_and_names_unchecked_capabilities():
    rows = [_row("pass", "self-test:passed"), _row("skip", "unchecked:top_k"), _row("skip", "unchecked:top_k")]
    t = tally(rows)
    assert (t["passed"], t["failed"], t["other_skips"]) == (0, 0, 0)
    assert t["unchecked"] == {"top_k": 2} and t["self_tests"] == {"pass": 1}


@pytest.fixture
def recording_adapter(tmp_path, monkeypatch):
    """An adapter that records the knobs of every load (no model is read)."""
    (tmp_path / "recording_adapter.py").write_text(
        textwrap.dedent("""
        from conformance.adapters.base import C, EngineAdapter

        LOADS = []

        class Recording(EngineAdapter):
            name = "recording"
            capabilities = {C.GREEDY, C.CHUNK_BUDGET, C.PREFIX_CACHE}

            def load(self, model_dir, **knobs):
                self.knobs = knobs
                LOADS.append(knobs)

            def close(self):
                pass
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import recording_adapter

    recording_adapter.LOADS.clear()
    return recording_adapter


def test_engine_pool_loads_one_engine_per_knob_value(recording_adapter):
    """Two checks asking for one model with one knob at two values get two engines, each loaded with
    its own value (a pool keyed on the knobs' names alone handed the budget-7 engine to the check
    that asked for 64)."""
    pool = EnginePool("recording_adapter:Recording")
    a = pool.get("m", max_batched_tokens=7)
    b = pool.get("m", max_batched_tokens=64)
    assert a is not b
    assert (a.knobs["max_batched_tokens"], b.knobs["max_batched_tokens"]) == (7, 64)
    c = pool.get("m", prefix_cache=False)
    assert c is not a and c.knobs["prefix_cache"] is False
    # control: the same model and knobs share one engine (loading is slow)
    assert pool.get("m", max_batched_tokens=7) is a
    assert pool.get("other", max_batched_tokens=7) is not a
    assert len(recording_adapter.LOADS) == 4


@pytest.mark.parametrize(
    "n_gpu, gpu_runs, multi_runs",
    [(0, False, False), (1, True, False), (2, True, True), (8, True, True)],
)
def test_gpu_gate_at_each_gpu_count(n_gpu, gpu_runs, multi_runs):
    """A check marked gpu runs from one GPU on, multi_gpu from two: the gate is checked at 0, 1, 2
    and 8 GPUs, not only on the host at hand (which has none, where < and <= agree)."""
    assert (gpu_shortfall({"gpu"}, n_gpu) is None) == gpu_runs
    assert (gpu_shortfall({"multi_gpu"}, n_gpu) is None) == multi_runs
    assert (gpu_shortfall({"gpu", "multi_gpu"}, n_gpu) is None) == multi_runs
    assert gpu_shortfall(set(), n_gpu) is None
    if not gpu_runs:
        assert gpu_shortfall({"gpu"}, n_gpu) == f"needs 1 CUDA GPU(s), {n_gpu} visible"


def test_different_models_are_not_the_same(tmp_path):
    """The HTTP adapter judges a served model only against its own golden files: two unrelated
    models, with or without a GGUF, never match."""
    a, b = zoo_model("llama-mha-hd64"), zoo_model("qwen2-gqa2-hd64")
    assert not same_model(a, b)
    empty1, empty2 = tmp_path / "one", tmp_path / "two"
    empty1.mkdir()
    empty2.mkdir()
    assert not same_model(str(empty1), str(empty2))  # neither has a GGUF: not "both None"
    # controls: a model is itself; a directory converted from a GGUF is that GGUF
    assert same_model(a, a) and same_model(str(empty1), str(empty1))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "nanovllm_source.json").write_text(json.dumps({"gguf": str(gguf)}))
    assert same_model(str(converted), str(gguf))
    assert not same_model(str(converted), a)
