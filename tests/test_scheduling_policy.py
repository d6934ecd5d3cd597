"""Scheduling policy and accounting, step by step, against expectations derived independently.

* The real engine loop (LLMEngine over the fake executor, no torch) against the policy
  model (tests/properties/policy_model.py: the documented policy restated over token content),
  on random workloads whose requests arrive while others run, under tight caches: every step's
  schedule, admissions with their cache hits, preemptions, finishes and free blocks; the
  stats() counters; each request's num_cached_tokens and num_preemptions.
* First-come-first-served order with recompute preemption (``check_fcfs``), from the trace
  alone: a preempted request goes back to the front of the queue and is never overtaken by a
  later arrival; victims are the latest arrivals; a step that preempts admits no one.
* The real engine (zoo model, LLM(trace=True)) on a fixed small-cache scenario: its trace,
  stats() and per-request fields equal the policy model's, and its trace is FCFS.

Greedy tokens do not depend on the batch, so none of this is visible in the tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.zoo import zoo_model
from nanovllm.core.utils import cdiv
from tests.engine_scenario import ENGINE_ARGS, MODEL, greedy, run_scenario, scenario
from tests.properties.fake_runner import INF_BUDGET
from tests.properties.policy_check import Req, StepView, check_fcfs, fake_views, run_against_model
from tests.properties.policy_model import ModelRequest, PolicyModel

STEMS = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [1, 1, 1, 1, 1, 1, 1, 1], [2, 0, 2, 0, 2, 0, 2, 0]]
prompt_st = st.tuples(st.sampled_from(STEMS), st.integers(0, 12), st.lists(st.integers(0, 2), max_size=3)).map(
    lambda t: tuple(t[0][: t[1]] + t[2]) or (0,)
)
request_st = st.builds(
    lambda prompt, max_tokens, stop, min_frac: Req(prompt, max_tokens, stop, min(min_frac, max_tokens)),
    prompt_st,
    st.integers(1, 10),
    st.sampled_from([(), (), (0,), (1, 2)]),
    st.integers(0, 3),
)
# requests added now, then steps run before the next batch arrives
batches_st = st.lists(
    st.tuples(st.lists(request_st, min_size=1, max_size=4), st.integers(0, 6)), min_size=1, max_size=5
)


@st.composite
def config_st(draw) -> dict:
    """Tight caches: one request of max_model_len always fits, a few together often do not."""
    bs = draw(st.integers(1, 4))
    max_model_len = draw(st.sampled_from([10, 16, 24]))
    one = cdiv(max_model_len - 1, bs)
    return {
        "block_size": bs,
        "num_blocks": draw(st.integers(one, 2 * one + 2)),
        "max_num_seqs": draw(st.integers(1, 4)),
        "max_num_batched_tokens": draw(st.sampled_from([1, 2, 3, 5, 8, 16, INF_BUDGET])),
        "max_model_len": max_model_len,
        "enable_prefix_caching": draw(st.booleans() | st.just(True)),
        "enable_chunked_prefill": draw(st.booleans() | st.just(True)),
    }


POLICY_SETTINGS = settings(max_examples=250, deadline=None)


@POLICY_SETTINGS
@given(cfg=config_st(), batches=batches_st)
def test_scheduler_follows_policy_model(cfg, batches):
    """Every step of the real scheduler and block manager equals the policy model's."""
    run_against_model(cfg, batches)


@POLICY_SETTINGS
@given(cfg=config_st(), batches=batches_st)
def test_queue_order_is_fcfs_with_preempted_first(cfg, batches):
    """From the trace alone: FCFS, preempted requests first, victims the latest arrivals."""
    eng, _, arrived_before = run_against_model(cfg, batches, compare=False)
    check_fcfs(fake_views(eng), arrived_before)


def test_policy_checks_are_not_vacuous():
    """A fixed workload under which the checks above see preemptions, re-admissions that overtake
    nothing, prefix-cache hits and evictions (so a passing run means something)."""
    cfg = {
        "block_size": 2,
        "num_blocks": 9,
        "max_num_seqs": 3,
        "max_num_batched_tokens": 5,
        "max_model_len": 16,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
    }
    stem = tuple(STEMS[0])
    batches = [
        ([Req(stem[:7], 8), Req(stem[:5] + (2,), 8), Req((1, 1, 1), 8)], 4),
        ([Req(stem[:9], 6), Req((2, 0, 2), 5)], 3),
        ([Req(stem[:8], 4)], 0),
    ]
    eng, model, arrived_before = run_against_model(cfg, batches)
    check_fcfs(fake_views(eng), arrived_before)
    counters = model.counters
    assert counters["preemptions"] > 0 and counters["prefix_cache_hit_tokens"] > 0 and counters["evictions"] > 0, (
        counters
    )


# ------------------------------------------------------------------ real engine
@pytest.fixture(scope="module")
def engine_run():
    from nanovllm import LLM

    path = zoo_model(MODEL)
    requests = scenario()
    ample = LLM(path, seed=0, block_size=ENGINE_ARGS["block_size"], enable_prefix_caching=False)
    tokens = {
        a.request_id: o.outputs[0].token_ids
        for a, o in zip(
            requests,
            ample.generate([a.prompt for a in requests], [greedy(a.max_tokens) for a in requests], use_tqdm=False),
        )
    }
    ample.close()
    llm = LLM(path, seed=0, trace=True, **ENGINE_ARGS)
    outputs = run_scenario(llm, requests)
    yield llm, requests, outputs, tokens
    llm.close()


def _model_of(llm, requests, tokens) -> PolicyModel:
    """The policy model of the scenario, fed the tokens of an ample run (greedy tokens do not depend
    on the batch), with the arrivals of the scenario."""
    cfg = llm.llm_engine.config
    prompts = {a.request_id: a.prompt for a in requests}
    model = PolicyModel(
        num_blocks=cfg.num_kvcache_blocks,
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        next_token=lambda rid, toks: tokens[rid][len(toks) - len(prompts[rid])],
    )
    return model


def test_engine_trace_and_stats_follow_policy_model(engine_run):
    """Exact: each step's schedule, admissions (with cache hits), preemptions, finishes and free
    blocks; every stats() counter; each request's num_cached_tokens and num_preemptions."""
    llm, requests, outputs, tokens = engine_run
    model = _model_of(llm, requests, tokens)
    events = llm.llm_engine.tracer.events
    pending = sorted(requests, key=lambda a: a.step)
    for t in range(len(events) + 1):
        while pending and pending[0].step <= t:
            a = pending.pop(0)
            model.add(ModelRequest(a.request_id, a.prompt, a.max_tokens))
        want = model.step()
        if t == len(events):
            assert want is None, f"the model runs a step {t} the engine did not: {want}"
            break
        e = events[t]
        got = [(s.request_id, s.num_computed_before, s.num_new_tokens) for s in e.seqs]
        assert got == want.scheduled, f"step {t}: scheduled {got}, model {want.scheduled}"
        assert [s.phase for s in e.seqs] == want.phases, f"step {t}: phases"
        assert e.preempted == want.preempted, f"step {t}: preempted {e.preempted}, model {want.preempted}"
        admitted = [(s.request_id, s.num_cached_tokens) for s in e.seqs if s.num_cached_tokens is not None]
        assert admitted == want.admitted, f"step {t}: admitted {admitted}, model {want.admitted}"
        assert e.finished == want.finished, f"step {t}: finished {e.finished}, model {want.finished}"
        assert e.num_free_blocks == want.num_free_blocks, (
            f"step {t}: free blocks {e.num_free_blocks}, model {want.num_free_blocks}"
        )
    stats = llm.stats()
    for name, value in model.counters.items():
        assert stats[name] == value, f"stats()[{name!r}] = {stats[name]}, the model expects {value}"
    assert model.counters["preemptions"] > 0 and model.counters["evictions"] > 0
    assert model.counters["prefix_cache_hit_tokens"] > 0
    for rid, out in outputs.items():
        req = model.requests[rid]
        assert out.outputs[0].token_ids == tokens[rid], f"{rid}: tokens differ from the ample run"
        assert out.num_cached_tokens == req.num_cached_tokens, (
            f"{rid}: num_cached_tokens {out.num_cached_tokens}, model {req.num_cached_tokens} (first admission)"
        )
        assert out.metrics.num_preemptions == req.num_preemptions, (
            f"{rid}: num_preemptions {out.metrics.num_preemptions}, model {req.num_preemptions}"
        )
        assert out.outputs[0].finish_reason == req.finish_reason


def test_engine_queue_order_is_fcfs(engine_run):
    """The real engine's trace: preempted requests are never overtaken by later arrivals."""
    llm, requests, _, _ = engine_run
    events = llm.llm_engine.tracer.events
    views = [
        StepView(
            [s.request_id for s in e.seqs],
            [s.request_id for s in e.seqs if s.num_cached_tokens is not None],
            list(e.preempted),
            [rid for rid, _ in e.finished],
        )
        for e in events
    ]
    arrived_before = {a.request_id: a.step for a in sorted(requests, key=lambda a: a.step)}
    check_fcfs(views, arrived_before)
    # the check had something to see: a preempted request re-admitted while a later arrival waited
    preempted, admitted, witnessed = set(), set(), 0
    for t, v in enumerate(views):
        later_waiting = [r for r, s in arrived_before.items() if s <= t and r not in admitted]
        witnessed += sum(
            1
            for r in v.admitted
            if r in preempted
            and any(list(arrived_before).index(w) > list(arrived_before).index(r) for w in later_waiting)
        )
        preempted.update(v.preempted)
        admitted.update(v.admitted)
    assert witnessed > 0, "no preempted request was re-admitted while a later arrival waited: weak check"
