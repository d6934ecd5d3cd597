"""A trace event records the state of its step, not of the engine later: block tables are
copies taken at the step (the engine keeps appending to a request's live table), so each holds
exactly the blocks its tokens need, and the text printed while the run went on is the text
the stored events give afterwards. The trace document reports the KV cache the engine
allocated, also when the engine sized it itself (the setting left unset)."""

from __future__ import annotations

import random

from nanovllm.core.utils import cdiv
from nanovllm.sampling_params import SamplingParams
from tests.conftest import zoo_model
from tests.properties.fake_runner import add_request, make_engine, reference_generate


def _run_fake(async_scheduling: bool):
    live: list[str] = []
    engine, executor = make_engine(
        num_blocks=8, block_size=4, max_num_batched_tokens=8, async_scheduling=async_scheduling, trace=True
    )
    engine.tracer.callback = lambda ev: live.append(ev.format())
    prompts = {"a": list(range(1, 11)), "b": list(range(1, 6)), "c": [7, 8, 9]}
    for rid, prompt in prompts.items():
        add_request(engine, executor, rid, prompt, SamplingParams(temperature=0.0, max_tokens=9))
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    return engine.tracer.events, live


def test_block_tables_are_those_of_their_step():
    """After a step, a request holds the blocks of the tokens computed so far: ceil((computed
    before + new) / block size), never the longer table it grew to later."""
    for async_scheduling in (False, True):
        events, live = _run_fake(async_scheduling)
        assert sum(e.preempted != [] for e in events) > 0, "weak check: no preemption"
        for ev in events:
            for s in ev.seqs:
                need = cdiv(s.num_computed_before + s.num_new_tokens, 4)
                assert len(s.block_ids) == need, (async_scheduling, ev.step, s)
        assert [ev.format() for ev in events] == live, "the stored events changed after they were printed"
        # control: requests do grow past the table of their first step
        first = {}
        for ev in events:
            for s in ev.seqs:
                first.setdefault(s.request_id, len(s.block_ids))
        last = {s.request_id: len(s.block_ids) for ev in events for s in ev.seqs}
        assert any(last[r] > first[r] for r in first)


def test_document_reports_the_allocated_cache_when_the_engine_sized_it():
    from nanovllm import LLM
    from nanovllm.trace_html import trace_document

    llm = LLM(zoo_model("llama-mha-hd64"), device="cpu", trace=True)
    try:
        outs = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        engine = llm.llm_engine
        doc = trace_document(engine.tracer.events, engine, outs)
    finally:
        llm.close()
    assert engine.config.num_kvcache_blocks is None  # the case: the engine chose the size
    assert doc["config"]["num_kvcache_blocks"] == engine.block_manager.num_blocks >= 1
    assert doc["config"]["num_kvcache_blocks"] == doc["steps"][0]["num_blocks"]


def test_blocks_in_use_after_a_step_are_those_of_its_requests():
    """The KV blocks in use recorded after a step (``num_blocks - num_free_blocks``: the viewer's
    KV chart, experiment 04's used_blocks, 05's peak) are the distinct blocks of the requests the
    step ran and did not finish, when every running request runs in every step (as here, no
    request waits with blocks). With async scheduling too, where the next step is scheduled,
    and its blocks allocated, before this one completes."""
    for async_scheduling in (False, True):
        events, _ = _run_fake(async_scheduling)
        used = [ev.num_blocks - ev.num_free_blocks for ev in events]
        held = [
            len({b for s in ev.seqs if s.request_id not in {r for r, _ in ev.finished} for b in s.block_ids})
            for ev in events
        ]
        assert used == held, (async_scheduling, used, held)
        assert used[-1] == 0 and max(used) > 0


def _random_run(seed: int, async_scheduling: bool):
    """Requests on a few shared prefixes (prefix-cache hits on blocks of requests that finish),
    some with n > 1 beside a small max_num_seqs (later children hit their finished siblings'
    prompt blocks), stop tokens, preemption and chunking."""
    rng = random.Random(seed)
    engine, executor = make_engine(
        num_blocks=rng.randint(10, 24),
        block_size=4,
        max_num_seqs=rng.choice([1, 2, 3, 8]),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        async_scheduling=async_scheduling,
        trace=True,
    )
    prefixes = [[rng.randint(1, 10) for _ in range(rng.randint(4, 9))] for _ in range(2)]
    for i in range(rng.randint(1, 4)):
        prompt = rng.choice(prefixes) + [rng.randint(1, 10) for _ in range(rng.randint(0, 5))]
        params = SamplingParams(
            n=rng.choice([1, 1, 2, 3]),
            temperature=1.0,
            seed=seed,
            max_tokens=rng.randint(1, 10),
            stop_token_ids=[rng.randint(0, 10)],
            ignore_eos=True,
        )
        add_request(engine, executor, f"r{i}", prompt, params)
        if rng.random() < 0.5:  # arrivals between steps too
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    events = engine.tracer.events
    schedule = [[(s.request_id, s.num_new_tokens) for s in ev.seqs] for ev in events]
    return events, schedule, [ev.num_blocks - ev.num_free_blocks for ev in events]


def test_async_traces_record_the_blocks_a_sync_run_records():
    """Over random workloads whose async schedule is the sync one, each step's recorded KV use is
    the sync run's: with async scheduling the next step is scheduled, and given blocks (prefix
    hits on blocks of requests this step finishes among them), before this step completes."""
    compared = stops = hits = 0
    for seed in range(400):
        _, sync_schedule, sync_used = _random_run(seed, False)
        events, schedule, used = _random_run(seed, True)
        if schedule != sync_schedule:
            continue
        compared += 1
        stops += sum(reason == "stop" for ev in events for _, reason in ev.finished)
        hits += any(s.num_cached_tokens for ev in events for s in ev.seqs)
        assert used == sync_used, (seed, used, sync_used)
    assert compared >= 100 and stops >= 20 and hits >= 20, (compared, stops, hits)


def test_async_trace_frees_prefix_blocks_shared_with_a_request_admitted_next():
    """With async scheduling: a request that stops at its second token, and one on its prompt's
    prefix added after the first step(). The second is admitted by the step after the stop, on
    the first's cached blocks, before the stop is known. After the step where the first stops
    (it ran alone), no request holds a block: the record says 0 in use, not the shared blocks."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    full = reference_generate(prompt, 5, 11)
    assert full[0] != full[1], full  # the stop id ends the first request at its second token
    engine, executor = make_engine(num_blocks=16, block_size=4, async_scheduling=True, trace=True)
    params = SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[full[1]], ignore_eos=True)
    add_request(engine, executor, "A", prompt, params)
    engine.step()
    add_request(engine, executor, "B", prompt + [9], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    events = engine.tracer.events
    stop_step = next(ev for ev in events if ("A", "stop") in ev.finished)
    after = events[events.index(stop_step) + 1]
    assert [s.request_id for s in stop_step.seqs] == ["A"], stop_step.format()
    assert [s.num_cached_tokens for s in after.seqs if s.request_id == "B"] == [8], after.format()  # on A's blocks
    assert stop_step.num_blocks - stop_step.num_free_blocks == 0, stop_step.format()


def test_async_trace_of_n_children_records_the_blocks_of_the_unfinished():
    """One request of n > 1 children beside max_num_seqs < n, with stop tokens: later children
    are admitted on their finished siblings' prompt blocks. Each step's recorded use is the blocks
    of the children it ran that have not finished (every running child runs in every step here)."""
    mismatches = []
    for seed in range(200):
        rng = random.Random(seed)
        engine, executor = make_engine(
            num_blocks=rng.randint(10, 24),
            block_size=4,
            max_num_seqs=rng.choice([1, 2, 3]),
            max_num_batched_tokens=rng.choice([16, 64]),
            async_scheduling=True,
            trace=True,
        )
        prompt = [rng.randint(1, 10) for _ in range(rng.randint(5, 13))]
        params = SamplingParams(
            n=rng.choice([2, 3, 4]),
            temperature=1.0,
            seed=seed,
            max_tokens=rng.randint(2, 10),
            stop_token_ids=[rng.randint(0, 10)],
            ignore_eos=True,
        )
        add_request(engine, executor, "r", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        finished: set[str] = set()
        for ev in engine.tracer.events:
            finished |= {r for r, _ in ev.finished}
            held = len({b for s in ev.seqs if s.request_id not in finished for b in s.block_ids})
            if ev.num_blocks - ev.num_free_blocks != held:
                mismatches.append((seed, ev.step))
    assert not mismatches, mismatches
