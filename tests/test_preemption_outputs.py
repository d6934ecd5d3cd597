"""nanovllm's whole RequestOutput survives preemption: a starved run equals an ample one, field by field.

The conformance check (conformance/test_preemption_fields.py) compares what the adapter exposes;
this one walks every field of nanovllm's RequestOutput / CompletionOutput / Logprob recursively
(lists by length first, dict keys exactly, floats to 1e-4, everything else exactly): prompt text,
token ids, text (stop strings, include_stop_str_in_output), cumulative_logprob, logprobs and
prompt logprobs with ranks and decoded tokens, finish and stop reasons, num_cached_tokens. Only
``metrics`` differs by design: 0 preemptions in the ample run, and in the starved one each
request's count equals the preemptions the trace shows for it; num_generation_tokens is the same
in both; the times keep their order (arrival <= first scheduled <= first token <= last token <=
finished: a preempted request keeps its first scheduling time).

Workload: the issue-10 reproduction (zoo llama-mha-hd64, 9 KV blocks of 16, prompts of
[40, 23, 17, 33, 5, 60, 16, 31] tokens), each request with other options.
"""

from __future__ import annotations

import dataclasses

from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from tests.conftest import cached_llm, prompts_for

MODEL = "llama-mha-hd64"
TOL = 1e-4


def _diff(a, b, path: str) -> list[str]:
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return [
            d
            for f in dataclasses.fields(a)
            if f.name != "metrics"
            for d in _diff(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
        ]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} entries (ample) vs {len(b)} (starved)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} vs {sorted(b)}"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= TOL else [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def _workload(llm):
    tok = llm.get_tokenizer()
    prompts = prompts_for(ZOO[MODEL].vocab_size, (40, 23, 17, 33, 5, 60, 16, 31), seed=1)
    plain = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    # request 1's greedy text decides the stop strings (one cut before, one kept)
    words = llm.generate([prompts[1]], plain, use_tqdm=False)[0].outputs[0].text.split()
    params = [
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, stop=[words[40]]),
        SamplingParams(temperature=0.8, seed=7, max_tokens=64, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, prompt_logprobs=0, logprobs=0),
        SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=64, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(
            temperature=0, max_tokens=64, ignore_eos=True, stop=[words[40]], include_stop_str_in_output=True
        ),
        SamplingParams(temperature=0, max_tokens=64, min_tokens=20, logprobs=1),
        plain,
    ]
    texts = [tok.decode(p) for p in prompts]
    prompts[1], prompts[5] = texts[1], texts[5]  # two text prompts (the prompt field is then set)
    return prompts, params


def test_every_output_field_survives_preemption():
    path = zoo_model(MODEL)
    ample = cached_llm(path, block_size=16, seed=0, enable_prefix_caching=False)  # nothing cached from before
    prompts, params = _workload(ample)
    want = ample.generate(prompts, params, use_tqdm=False)
    starved = LLM(path, block_size=16, seed=0, num_kvcache_blocks=9, trace=True)
    got = starved.generate(prompts, params, use_tqdm=False)
    bad = [
        d
        for w, g in zip(want, got)
        for d in _diff(
            dataclasses.replace(w, request_id=""), dataclasses.replace(g, request_id=""), f"request {w.request_id}"
        )
    ]
    assert not bad, f"{len(bad)} field(s) differ between an ample and a starved run: " + "; ".join(bad[:6])
    assert any(o.outputs[0].finish_reason == "stop" for o in want), "no stop string matched: weak check"

    events = starved.llm_engine.tracer.events
    preempted = [rid for e in events for rid in e.preempted]
    assert preempted, "the starved run never preempted"
    assert all(w.metrics.num_preemptions == 0 for w in want)
    assert [g.metrics.num_preemptions for g in got] == [preempted.count(g.request_id) for g in got]
    for w, g in zip(want, got):
        assert g.metrics.num_generation_tokens == w.metrics.num_generation_tokens == len(g.outputs[0].token_ids)
        m = g.metrics
        times = [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time]
        assert None not in times and times == sorted(times), f"request {g.request_id}: times out of order {times}"
    logprob_requests = {
        g.request_id for g, p in zip(got, params) if p.logprobs is not None or p.prompt_logprobs is not None
    }
    assert logprob_requests & set(preempted), "no request with logprobs was preempted: weak check"
    starved.llm_engine.check_invariants()
    starved.close()
