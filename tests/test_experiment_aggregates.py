"""The experiments' aggregates against closed forms: the median rule, the least-squares line of
experiment 02, time per output token, the per-request times read off the trace events, and the
figures experiments 03 and 05 compute from their runs (fed hand-built runs whose answers are
known). The experiment tests check token counts only; these figures are what the result lines
teach, and a wrong one reads as a finding. No model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanovllm.engine.trace import SeqStep, StepEvent, summarize_requests
from nanovllm.experiments.report import Report, median
from nanovllm.experiments.workload import RequestRun, Run


def test_median_rule():
    """The middle value of an odd count, the mean of the two middle values of an even count;
    ``None`` entries are left out and an empty input has no median."""
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([10.0, 1.0, 3.0, 2.0]) == 2.5  # (2 + 3) / 2, not an element
    assert median([4.0, None, 2.0]) == 3.0
    assert median([7.0]) == 7.0
    assert median([]) is None and median([None]) is None


def test_least_squares_line_of_experiment_02():
    """An exact line comes back as its slope and intercept; four points off a line give the
    normal equations' answer (hand-computed: x = 0..3, y = 1, 3, 2, 5: slope 1.1, intercept 1.1)."""
    from nanovllm.experiments.e02_output_length import _fit

    assert _fit([8, 16, 32, 64], [1 + 0.5 * x for x in (8, 16, 32, 64)]) == pytest.approx((0.5, 1.0))
    assert _fit([0, 1, 2, 3], [1, 3, 2, 5]) == pytest.approx((1.1, 1.1))
    assert _fit([5, 5], [1.0, 3.0]) == (0.0, 2.0)  # one x value: no slope, the mean


def _summary():
    return summarize_requests([StepEvent(0, "prefill", [SeqStep("a", "prefill", 2, 0, 2, [0])])])["a"]


def test_time_per_output_token():
    """TPOT is the time after the first token over the tokens after the first: 5 tokens, first
    at 1 s, finished at 3 s: 0.5 s each; one token has none."""
    assert RequestRun("a", 2, 5, "length", 1.0, 3.0, _summary()).tpot_s == pytest.approx(0.5)
    assert RequestRun("a", 2, 1, "length", 1.0, 3.0, _summary()).tpot_s is None


def test_request_times_come_from_the_right_event_timestamps():
    """A request is first scheduled when its first step starts, gets its first token when the step
    that samples it ends, and finishes when its finishing step ends (module doc of
    nanovllm.engine.trace). Steps here are 1 s apart and last 0.5 s, so each time is distinct."""
    events = [
        StepEvent(0, "prefill", [SeqStep("a", "prefill", 4, 0, 6, [0, 1])], t_start=10.0, t_end=10.5),
        StepEvent(1, "prefill", [SeqStep("a", "prefill", 2, 4, 6, [0, 1])], t_start=11.0, t_end=11.5),
        StepEvent(
            2, "decode", [SeqStep("a", "decode", 1, 6, 7, [0, 1])], finished=[("a", "length")], t_start=12.0, t_end=12.5
        ),
    ]
    s = summarize_requests(events)["a"]
    assert (s.first_step, s.first_token_step, s.finish_step) == (0, 1, 2)
    assert s.t_first_scheduled == 10.0
    assert s.t_first_token == 11.5
    assert s.t_finish == 12.5
    assert s.num_sampled == 2 and s.num_prefill_chunks == 2


# --------------------------------------------------------- experiments fed hand-built runs
def _fake_run(wall_s: float, batch: int, max_tokens: int, seqs_per_step: list[tuple[str, int]]) -> Run:
    """A run of ``batch`` requests of ``max_tokens`` tokens in ``wall_s`` seconds whose steps have
    the given (kind, number of sequences); each step lasts 0.1 s."""
    events = []
    for i, (kind, n) in enumerate(seqs_per_step):
        phase = "decode" if kind == "decode" else "prefill"
        seqs = [SeqStep(str(k), phase, 1 if phase == "decode" else 4, 4, 5, [k]) for k in range(n)]
        events.append(StepEvent(i, kind, seqs, num_free_blocks=1, num_blocks=4, t_start=0.1 * i, t_end=0.1 * i + 0.1))
    summary = _summary()
    reqs = [RequestRun(str(k), 4, max_tokens, "length", 0.1, wall_s, summary) for k in range(batch)]
    stats = {"steps": len(events), "preemptions": 0, "prompt_tokens_computed": 4 * batch}
    return Run(wall_s, 0.0, events, reqs, stats, [])


def _fake_llm():
    return SimpleNamespace(llm_engine=SimpleNamespace(vocab_size=1000))


def test_experiment_03_names_the_batch_where_the_gain_falls_off(tmp_path, monkeypatch):
    """Batches 1, 2, 4, 8 at 10, 20, 22, 40 tokens/s: the gain from 2 to 4 is 1.1x, the first below
    1.2x, so the result line names batch 4 (the batch that did not gain), not batch 2."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[experiments]')")
    from nanovllm.experiments import e03_batch_scaling as e03

    max_tokens = 10
    speed = {1: 10.0, 2: 20.0, 4: 22.0, 8: 40.0}

    def fake_workload(llm, prompts, m, check=True):
        b = len(prompts)
        return _fake_run(b * m / speed[b], b, m, [("prefill", b)] + [("decode", b)] * (m - 1))

    monkeypatch.setattr(e03, "run_workload", fake_workload)
    monkeypatch.setattr(e03, "warm_up", lambda llm: None)
    report = Report(tmp_path, echo=lambda line: None)
    rows = e03.run(_fake_llm(), e03.Shape((1, 2, 4, 8), 4, max_tokens), report)
    assert [r["output_tok_per_s"] for r in rows] == pytest.approx([10.0, 20.0, 22.0, 40.0])
    line = report.results[0]
    assert "fell below 1.2x first at batch 4" in line, line


def test_experiment_05_counts_sequences_of_decode_steps_only(tmp_path, monkeypatch):
    """The mean sequences per decode step is taken over decode steps: a run with one 3-sequence
    prefill step and four 1-sequence decode steps shares a decode step among 1.0 sequences (not
    (3 + 4) / 5); one with decode steps of 2, 2, 1, 1 sequences among 1.5."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[experiments]')")
    from nanovllm.experiments import e05_kv_pressure as e05

    runs = {
        2: _fake_run(1.0, 3, 4, [("prefill", 3), ("decode", 1), ("decode", 1), ("decode", 1), ("decode", 1)]),
        6: _fake_run(
            1.0, 3, 4, [("prefill", 3), ("mixed", 3), ("decode", 2), ("decode", 2), ("decode", 1), ("decode", 1)]
        ),
    }
    current = {}

    monkeypatch.setattr(e05, "engine_variant", lambda llm, num_kvcache_blocks: current.update(n=num_kvcache_blocks))
    monkeypatch.setattr(e05, "run_workload", lambda llm, prompts, m, check=True: runs[current["n"]])
    monkeypatch.setattr(e05, "warm_up", lambda llm: None)
    report = Report(tmp_path, echo=lambda line: None)
    rows = e05.run(_fake_llm(), e05.Shape(3, 4, 4, (2, 6)), report)
    by_blocks = {r["num_blocks"]: r["mean_seqs_per_decode_step"] for r in rows}
    assert by_blocks == {2: pytest.approx(1.0), 6: pytest.approx(1.5)}
    assert "with 2 blocks 1.0 sequences shared a decode step" in report.results[-1], report.results


def test_experiment_07_step_medians_follow_the_median_rule(tmp_path, monkeypatch):
    """The mixed and decode-only step times of experiment 07's result line are medians by the
    report's rule: mixed steps of 10, 20, 30 and 40 ms have a median of 25 ms (not 30, the upper
    middle value), decode-only steps of 10 and 30 ms one of 20 ms."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[experiments]')")
    from nanovllm.experiments import e07_mixed_batch as e07

    a = [("prefill", 4, 4 * k, 20) for k in range(5)] + [("decode", 1, 20, 21), ("decode", 1, 21, 22)]
    b = [("prefill", 4, 0, 4)] + [("decode", 1, 4 + k, 5 + k) for k in range(4)]
    durations = [0.005, 0.010, 0.020, 0.030, 0.040, 0.010, 0.030]
    events, t = [], 0.0
    for i, d in enumerate(durations):
        seqs = [SeqStep("a", *a[i], [0, 1, 2, 3, 4])]
        if i < len(b):
            seqs.append(SeqStep("b", *b[i], [5, 6]))
        phases = {s.phase for s in seqs}
        finished = [("b", "length")] if i == 4 else [("a", "length")] if i == 6 else []
        kind = phases.pop() if len(phases) == 1 else "mixed"
        events.append(StepEvent(i, kind, seqs, finished=finished, num_blocks=8, t_start=t, t_end=t + d))
        t += d
    assert [e.kind for e in events] == ["prefill", "mixed", "mixed", "mixed", "mixed", "decode", "decode"]
    summaries = summarize_requests(events)
    reqs = [
        RequestRun(rid, n, m, "length", summaries[rid].t_first_token, summaries[rid].t_finish, summaries[rid])
        for rid, n, m in (("a", 20, 3), ("b", 4, 5))
    ]
    run = Run(t, 0.0, events, reqs, {"steps": len(events)}, [])
    monkeypatch.setattr(e07, "run_workload", lambda llm, prompts, m, check=True: run)
    monkeypatch.setattr(e07, "warm_up", lambda llm: None)
    report = Report(tmp_path, echo=lambda line: None)
    e07.run(_fake_llm(), e07.Shape((20, 4), (3, 5), 8, 2), report)
    line = report.results[-1]
    assert (
        line == "4 of 7 steps were mixed (prefill chunk + decodes), median 25 ms against 20 ms for decode-only steps"
    ), line
