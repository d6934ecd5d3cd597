"""Accounting: every stats() counter and per-request field agrees with what the step trace shows.

On a fixed small-cache scenario (tests/engine_scenario.py: staggered arrivals, shared prefixes,
preemptions, chunked recomputes) the trace (``LLM(trace=True)``) records what each step
computed; from it alone the counters follow:

* ``steps`` = trace events; ``preemptions`` = preempted entries = the sum of the requests'
  ``metrics.num_preemptions``, and each request's count = its preempted entries;
  ``metrics.num_generation_tokens`` = the tokens it returns;
* ``prompt_tokens_computed`` = the tokens of every chunk that is not a decode (prefill chunks and
  recomputes, including a recompute's last chunk past the prompt); ``generation_tokens`` = the
  chunks that reach their request's last token (each samples one) = the tokens returned;
* ``prefix_cache_hit_tokens`` / ``prefix_cache_query_tokens`` = the hit / token count of every
  admission; ``num_cached_tokens`` = the hit of the request's *first* admission;
* each request's chunks continue exactly where the previous one ended (from its hit after an
  admission) and the last ends at its final token; a chunk is a decode iff it computes only the
  newest token of a request past its prompt;
* all blocks are free at the end.
"""

from __future__ import annotations

import pytest

from conformance.zoo import zoo_model
from tests.engine_scenario import ENGINE_ARGS, MODEL, run_scenario, scenario


@pytest.fixture(scope="module")
def run():
    from nanovllm import LLM

    llm = LLM(zoo_model(MODEL), seed=0, trace=True, **ENGINE_ARGS)
    requests = scenario()
    outputs = run_scenario(llm, requests)
    yield llm, requests, outputs
    llm.close()


def test_stats_counters_match_the_trace(run):
    llm, requests, outputs = run
    stats = llm.stats()
    events = llm.llm_engine.tracer.events
    prompts = {a.request_id: a.prompt for a in requests}
    assert set(outputs) == set(prompts) and all(o.finished for o in outputs.values())

    seq_steps = [s for e in events for s in e.seqs]
    admissions = [s for s in seq_steps if s.num_cached_tokens is not None]
    preempted = [rid for e in events for rid in e.preempted]
    sampled = [s for s in seq_steps if s.num_computed_before + s.num_new_tokens == s.num_tokens]
    assert stats["steps"] == len(events)
    assert stats["preemptions"] == len(preempted) > 0, "the scenario must preempt"
    assert stats["prompt_tokens_computed"] == sum(s.num_new_tokens for s in seq_steps if s.phase == "prefill")
    assert stats["generation_tokens"] == len(sampled) == sum(len(o.outputs[0].token_ids) for o in outputs.values())
    assert stats["prefix_cache_hit_tokens"] == sum(s.num_cached_tokens for s in admissions) > 0
    assert stats["prefix_cache_query_tokens"] == sum(s.num_tokens for s in admissions)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] == events[-1].num_free_blocks
    assert stats["running"] == stats["waiting"] == stats["errors"] == 0

    # a recompute whose last chunk starts past the prompt is prompt work, not a decode
    assert any(s.phase == "prefill" and s.num_computed_before >= len(prompts[s.request_id]) for s in seq_steps), (
        "the scenario must recompute a preempted request in chunks past its prompt (weak check otherwise)"
    )
    for s in seq_steps:
        decode = (
            s.num_new_tokens == 1
            and s.num_computed_before + 1 == s.num_tokens
            and s.num_computed_before >= len(prompts[s.request_id])
        )
        assert s.phase == ("decode" if decode else "prefill"), f"step entry {s} has phase {s.phase}"

    for rid, out in outputs.items():
        firsts = [s.num_cached_tokens for s in admissions if s.request_id == rid]
        assert out.num_cached_tokens == firsts[0], f"{rid}: num_cached_tokens is not its first admission's hit"
        assert out.metrics.num_preemptions == preempted.count(rid) == len(firsts) - 1, rid
        assert out.metrics.num_generation_tokens == len(out.outputs[0].token_ids), rid
        end = None  # where the request's computed tokens end; None while it waits
        for e in events:
            if rid in e.preempted:
                assert end is not None, f"{rid} preempted at step {e.step} while not running"
                end = None
            for s in e.seqs:
                if s.request_id != rid:
                    continue
                if s.num_cached_tokens is not None:
                    assert end is None, f"{rid} admitted at step {e.step} while running"
                    end = s.num_cached_tokens
                assert s.num_computed_before == end, (
                    f"{rid} step {e.step}: chunk starts at {s.num_computed_before}, the previous one ended at {end}"
                )
                end += s.num_new_tokens
        n_final = len(prompts[rid]) + len(out.outputs[0].token_ids)
        assert end == n_final - 1, f"{rid}: computed up to {end}, its last token is at {n_final - 1}"
    llm.llm_engine.check_invariants()
