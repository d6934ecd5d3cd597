"""The trace tells a first prefill (its chunks) from the prefill that recomputes a request after
a preemption: the text trace labels it ``recompute``, the summaries count the two apart, and
experiment 04's result line reports them apart. Hand-built events, no model.

Then the engine's own phase labels (prefill or decode), on one-token prefills of every kind and on
random workloads: the real engine over the fake executor (tests/properties/fake_runner.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.engine.trace import SeqStep, StepEvent, Tracer, summarize_requests
from nanovllm.experiments.e04_scheduler_watch import prefill_line


def _events() -> list[StepEvent]:
    """Request "a" (20 tokens) prefilled in chunks of 12 and 8, decoded once, preempted by "b",
    then recomputed in one step; "b" (8 tokens) prefilled once and finished."""
    return [
        StepEvent(0, "prefill", [SeqStep("a", "prefill", 12, 0, 20, [0])]),
        StepEvent(1, "prefill", [SeqStep("a", "prefill", 8, 12, 20, [0, 1])]),
        StepEvent(2, "decode", [SeqStep("a", "decode", 1, 20, 21, [0, 1])]),
        StepEvent(3, "prefill", [SeqStep("b", "prefill", 8, 0, 8, [0])], preempted=["a"]),
        StepEvent(4, "decode", [SeqStep("b", "decode", 1, 8, 9, [0])], finished=[("b", "length")]),
        StepEvent(5, "prefill", [SeqStep("a", "prefill", 21, 0, 21, [0, 1])]),
    ]


def _recorded() -> list[StepEvent]:
    tracer = Tracer(enabled=True)
    for ev in _events():
        tracer.record(ev)
    return tracer.events


def _phase_labels(events: list[StepEvent]) -> list[str]:
    return [line.split()[1] for ev in events for line in ev.format().splitlines()[1:] if "[" in line]


def test_text_trace_labels_a_recompute():
    events = _recorded()
    assert _phase_labels(events) == ["prefill", "prefill", "decode", "prefill", "decode", "recompute"]
    assert "    a          recompute [0:21)        of 21    blocks=[0, 1]" in events[5].format().splitlines()
    # negative control: the same steps not marked by a tracer (as before) read as a first prefill
    assert _phase_labels(_events())[-1] == "prefill"


def test_summaries_count_chunks_apart_from_recomputes():
    s = summarize_requests(_recorded())
    assert (s["a"].num_prefill_chunks, s["a"].num_recompute_steps, s["a"].num_preemptions) == (2, 1, 1)
    assert (s["b"].num_prefill_chunks, s["b"].num_recompute_steps, s["b"].num_preemptions) == (1, 0, 0)
    # negative control: unmarked steps count the recompute as a third chunk (the old count)
    old = summarize_requests(_events())["a"]
    assert (old.num_prefill_chunks, old.num_recompute_steps) == (3, 0)


def test_a_finished_request_is_forgotten():
    """A request id preempted once and finished is not marked again (the tracer's memory of
    preempted requests ends at their finish)."""
    tracer = Tracer(enabled=True)
    tracer.record(StepEvent(0, "decode", [SeqStep("x", "decode", 1, 4, 5, [0])], preempted=["a"]))
    tracer.record(StepEvent(1, "decode", [SeqStep("x", "decode", 1, 5, 6, [0])], finished=[("a", "abort")]))
    tracer.record(StepEvent(2, "prefill", [SeqStep("a", "prefill", 4, 0, 4, [1])]))
    assert tracer.events[-1].seqs[0].recompute is False


def _request(rid: str, prompt: int, events: list[StepEvent]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, summary=summarize_requests(events)[rid])


def test_experiment_04_reports_chunks_and_recomputes_apart():
    events = _recorded()
    line = prefill_line([_request("a", 20, events), _request("b", 8, events)])
    assert line == "prefill: request a (20 tokens): 2 chunks, then 1 recompute step after 1 preemption"
    # negative control: without the marks, the recompute reads as a chunk
    old = prefill_line([_request("a", 20, _events())])
    assert old == "prefill: request a (20 tokens): 3 chunks, then 0 recompute steps after 1 preemption"
    assert prefill_line([_request("b", 8, events)]) == "prefill: every request in one step, none preempted"


# ------------------------------------------------------ the phase classifier, on the real engine
# The engine labels each step entry "decode" or "prefill" (``LLMEngine._trace_begin``). A decode
# computes only the newest token of a request past its prompt; any step that computes a prompt
# token is prefill work, also when it computes exactly one token. The tests above hand-build
# their events; these run the real engine over the fake executor (no model, milliseconds).


def _expected_phase(s: SeqStep, prompt_len: int) -> str:
    """The classifier's specification (also in tests/test_stats_counters.py)."""
    decode = s.num_new_tokens == 1 and s.num_computed_before + 1 == s.num_tokens and s.num_computed_before >= prompt_len
    return "decode" if decode else "prefill"


def _check_phases(events: list[StepEvent], prompts: dict[str, list[int]]) -> None:
    """Every step entry has its specified phase, every event's kind follows from its entries,
    and each request's prompt is finished by a prefill chunk (what the summaries count)."""
    for ev in events:
        for s in ev.seqs:
            assert s.phase == _expected_phase(s, len(prompts[s.request_id])), (
                f"step {ev.step}: {s.request_id} computes [{s.num_computed_before}:"
                f"{s.num_computed_before + s.num_new_tokens}) of a {len(prompts[s.request_id])}-token prompt, "
                f"labelled {s.phase!r}"
            )
        phases = {s.phase for s in ev.seqs}
        assert ev.kind == (phases.pop() if len(phases) == 1 else "mixed"), f"step {ev.step}: kind {ev.kind}"
    summaries = summarize_requests(events)
    for rid, prompt in prompts.items():
        assert summaries[rid].num_prefill_chunks >= 1, f"{rid}: no prefill chunk in the trace"
        last = [s for ev in events for s in ev.seqs if s.request_id == rid and s.num_computed_before < len(prompt)]
        assert last and last[-1].phase == "prefill"


def _run_fake(prompts: dict[str, list[int]], max_tokens: int = 3, **config) -> list[StepEvent]:
    from nanovllm import SamplingParams
    from tests.properties.fake_runner import add_request, make_engine

    engine, executor = make_engine(trace=True, **{"num_blocks": 64, "block_size": 4, **config})
    for rid, prompt in prompts.items():  # one at a time: a later prompt may hit an earlier one's cache
        add_request(engine, executor, rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        assert not engine.has_unfinished_requests()
    return engine.tracer.events


ONE_TOKEN_PREFILLS = {
    "one-token prompt": ({"a": [5]}, {}),
    # chunks of 4: [0:4) then the prompt's last token alone
    "one-token last chunk": ({"a": [1, 2, 3, 4, 5]}, {"max_num_batched_tokens": 4}),
    # "b" hits "a"'s two cached blocks (8 tokens) and computes its 9th prompt token alone
    "prefix hit leaving one token": ({"a": [1, 2, 3, 4, 5, 6, 7, 8], "b": [1, 2, 3, 4, 5, 6, 7, 8, 9]}, {}),
}


@pytest.mark.parametrize("case", list(ONE_TOKEN_PREFILLS))
def test_one_token_prefills_are_traced_as_prefill(case):
    """A step that computes a single prompt token is prefill work, not a decode: a one-token
    prompt, a last chunk of one token, a prefix-cache hit that leaves one token. A classifier
    that called every one-token step reaching the request's end a decode passed every test, the
    trace tests seeing only ordinary prompts (hunt 3, B10). Control: the request's next
    one-token step, past its prompt, is a decode."""
    prompts, config = ONE_TOKEN_PREFILLS[case]
    events = _run_fake(prompts, **config)
    _check_phases(events, prompts)
    rid = list(prompts)[-1]
    steps = [s for ev in events for s in ev.seqs if s.request_id == rid]
    prompt_end = [s for s in steps if s.num_computed_before == len(prompts[rid]) - 1]
    assert len(prompt_end) == 1 and prompt_end[0].num_new_tokens == 1, f"{case}: no one-token prefill step"
    assert prompt_end[0].phase == "prefill"
    nxt = steps[steps.index(prompt_end[0]) + 1]
    assert nxt.num_computed_before == len(prompts[rid]) and nxt.phase == "decode"
    if case == "one-token prompt":
        assert (events[0].kind, [s.phase for s in events[0].seqs]) == ("prefill", ["prefill"])
    if case == "prefix hit leaving one token":
        assert prompt_end[0].num_cached_tokens == 8


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    budget=st.sampled_from([1, 2, 3, 4, 5, 64]),
    num_blocks=st.integers(6, 14),  # 6: one request of 9 + 4 tokens fits alone
    async_scheduling=st.booleans(),
)
def test_phase_labels_follow_the_specification(lengths, budget, num_blocks, async_scheduling):
    """Over random workloads (short prompts sharing prefixes, small budgets, small caches that
    preempt and recompute, async scheduling on and off): every traced step entry has the phase
    the specification gives, on one-token boundaries of every kind included."""
    from nanovllm import SamplingParams
    from tests.properties.fake_runner import add_request, make_engine

    engine, executor = make_engine(
        trace=True,
        num_blocks=num_blocks,
        block_size=2,
        max_num_batched_tokens=budget,
        max_model_len=16,
        async_scheduling=async_scheduling,
    )
    prompts = {f"r{i}": [1, 2, 3, 4, 5, 6, 7, 8, 9][:n] for i, n in enumerate(lengths)}
    for rid, prompt in prompts.items():
        add_request(engine, executor, rid, prompt, SamplingParams(temperature=0.0, max_tokens=4))
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    _check_phases(engine.tracer.events, prompts)
