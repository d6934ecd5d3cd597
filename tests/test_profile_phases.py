"""scripts/profile_phases.py: how completed steps are classified into prefill, ramp, steady decode
and the shrinking tail, and what each phase sums (the GPU run itself is on the H200 only)."""

from __future__ import annotations

import pytest

from scripts.profile_phases import StepRecord, attach_times, classify, compare_runs, summarise


def _steps() -> list[StepRecord]:
    return [
        StepRecord(prompt_tokens=8192, samples=3, batch=4, wall=0.5),  # prefill chunk + 3 prompts done
        StepRecord(prompt_tokens=0, samples=3, batch=3, wall=0.1),  # decode before the full batch
        StepRecord(prompt_tokens=100, samples=4, batch=4, wall=0.2),  # last prompt, decodes ride along
        StepRecord(prompt_tokens=0, samples=4, batch=4, wall=0.3),
        StepRecord(prompt_tokens=0, samples=4, batch=4, wall=0.3),
        StepRecord(prompt_tokens=0, samples=2, batch=2, wall=0.1),
        StepRecord(prompt_tokens=0, samples=1, batch=1, wall=0.05),
    ]


def test_classify_splits_prefill_ramp_steady_and_tail():
    assert classify(_steps()) == ["prefill", "ramp", "prefill", "steady", "steady", "tail", "tail"]


def test_a_full_batch_with_prompt_work_is_prefill_not_steady():
    # control: the same full batch without its prompt tokens is steady decode
    step = StepRecord(prompt_tokens=1, samples=4, batch=4)
    assert classify([step, StepRecord(0, 4, 4)]) == ["prefill", "steady"]
    assert classify([StepRecord(0, 4, 4), StepRecord(0, 4, 4)]) == ["steady", "steady"]


def test_summarise_sums_each_phase():
    rows = {r.phase: r for r in summarise(_steps())}
    assert (rows["prefill"].steps, rows["prefill"].output_tokens, rows["prefill"].prompt_tokens) == (2, 7, 8292)
    assert rows["steady"].seconds == pytest.approx(0.6)
    assert rows["steady"].tok_s == pytest.approx(8 / 0.6)
    assert rows["tail"].mean_batch == pytest.approx(1.5)
    assert sum(r.steps for r in rows.values()) == len(_steps())
    assert rows["ramp"].output_tokens == 3


def test_compare_runs_pairs_steps_and_sums_each_phase_difference():
    first = _steps()
    later = [StepRecord(s.prompt_tokens, s.samples, s.batch, wall=s.wall, phases={"launch": 0.01}) for s in first]
    later[0].wall += 0.2  # the first run's prefill step was 0.2 s faster than the later one's
    later[5].wall -= 0.05
    d = compare_runs(first, later, top=2)
    assert d.phase_delta["prefill"] == pytest.approx(0.2)
    assert d.phase_delta["tail"] == pytest.approx(-0.05)
    assert d.phase_delta["steady"] == 0.0
    assert d.host_delta == {"launch": pytest.approx(0.07)}
    assert [(i, p) for i, p, *_ in d.slowest] == [(0, "prefill"), (5, "tail")]


def test_compare_runs_refuses_runs_that_scheduled_differently():
    # control: the same steps pair; one batch size changed does not
    first = _steps()
    compare_runs(first, _steps())
    other = _steps()
    other[3].batch = 3
    with pytest.raises(ValueError, match="scheduled differently"):
        compare_runs(first, other)


def test_attach_times_gives_each_step_the_call_it_completed_in():
    # three step() calls: [1.0, 1.5], [2.0, 2.2], [3.0, 3.9]; the second completes nothing, the
    # third completes two steps (a drain); the run began at 0.5
    calls = [(1.0, 1.5), (2.0, 2.2), (3.0, 3.9)]
    completed = [(1.4, {"launch": 0.1, "wait": 0.2}), (3.2, {"wait": 0.05}), (3.8, {})]
    steps = [StepRecord(0, 1, 1) for _ in completed]
    attach_times(steps, completed, calls, start=0.5)
    assert [s.wall for s in steps] == pytest.approx([0.9, 1.8, 0.6])
    assert [s.call for s in steps] == pytest.approx([0.5, 0.9, 0.9])
    assert [s.gap for s in steps] == pytest.approx([0.5, 0.8, 0.8])  # the first call's gap: since the start
    assert (steps[0].wait, steps[0].host) == pytest.approx((0.2, 0.1))
