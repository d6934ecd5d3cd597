"""The trace tells a first prefill (its chunks) from the prefill that recomputes a request after
a preemption: the text trace labels it ``recompute``, the summaries count the two apart, and
experiment 04's result line reports them apart. Hand-built events, no model."""

from __future__ import annotations

from types import SimpleNamespace

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
