"""The three phases of the standard GPU run: prefill, steady decode, and the shrinking tail.

Runs the workload of ``nanovllm bench --workload gpu`` once (Qwen3-0.6B shape, random weights,
the bench's warm-up first) with the engine's ``step_profiler`` hook, and classifies each
completed step by what it computed:

    prefill   the step holds prompt work (a whole prompt or a chunk; decodes may ride along)
    steady    decode only, at the full batch (the largest decode-only batch of the run)
    tail      decode only, below the full batch, after the first steady step
    ramp      decode only, below the full batch, before it (between prefill steps)

Per phase: steps, wall seconds (between successive step completions), output tokens sampled,
prompt tokens, output tok/s, mean batch, and the phase's share of the run's wall time.

    PYTHONPATH=. python3 scripts/profile_phases.py [--kv-cache-dtype fp8] [--json-out F] [--runs N]

``--runs N`` builds the engine N times in one process, as ``nanovllm bench --repeat N`` does,
and compares each later run with the first step by step: where a fresh process's first run
loses its time (the schedules are the same in every run, so step k of one run is step k of the
other).

Steps are matched to schedules in launch order: the engine completes steps in the order it
launches them (one in flight under async scheduling), so the k-th ``step_profiler`` call is
the k-th non-empty schedule.
"""

from __future__ import annotations

import argparse
import bisect
import json
import time
from dataclasses import asdict, dataclass, field

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.bench.peers import _warmup_prompts
from nanovllm.bench.workloads import gpu_workload, shape_config_dir

PHASES = ("prefill", "ramp", "steady", "tail")


@dataclass
class StepRecord:
    prompt_tokens: int  # prompt tokens computed in the step
    samples: int  # sequences that sample a token in the step (output tokens)
    batch: int  # sequences in the step
    wall: float = 0.0  # seconds since the previous step completed (the first: since the run began)
    host: float = 0.0  # host seconds of the step's own work (step_profiler phases, "wait" excluded)
    wait: float = 0.0  # host seconds spent waiting for the step's result
    phases: dict[str, float] = field(default_factory=dict)  # step_profiler's phases, seconds
    call: float = 0.0  # seconds of the ``LLMEngine.step`` call that completed the step
    gap: float = 0.0  # seconds between that call and the one before it (LLM.generate's own loop)


@dataclass
class PhaseRow:
    phase: str
    steps: int
    seconds: float
    output_tokens: int
    prompt_tokens: int
    mean_batch: float
    host_seconds: float = 0.0
    wait_seconds: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def classify(steps: list[StepRecord]) -> list[str]:
    """The phase of each step (see the module docstring)."""
    decode_batches = [s.batch for s in steps if s.prompt_tokens == 0]
    full = max(decode_batches, default=0)
    phases, seen_steady = [], False
    for s in steps:
        if s.prompt_tokens > 0:
            phases.append("prefill")
        elif s.batch >= full:
            phases.append("steady")
            seen_steady = True
        else:
            phases.append("tail" if seen_steady else "ramp")
    return phases


def summarise(steps: list[StepRecord]) -> list[PhaseRow]:
    phases = classify(steps)
    rows = []
    for name in PHASES:
        mine = [s for s, p in zip(steps, phases) if p == name]
        rows.append(
            PhaseRow(
                name,
                len(mine),
                sum(s.wall for s in mine),
                sum(s.samples for s in mine),
                sum(s.prompt_tokens for s in mine),
                sum(s.batch for s in mine) / len(mine) if mine else 0.0,
                sum(s.host for s in mine),
                sum(s.wait for s in mine),
            )
        )
    return rows


@dataclass
class RunDiff:
    """Run B against run A, step by step (``compare_runs``)."""

    phase_delta: dict[str, float]  # phase -> B's seconds minus A's
    host_delta: dict[str, float]  # step_profiler phase (schedule, launch, wait, ...) -> B's total minus A's
    # (step, phase, A's wall, B's wall, A's and B's step() call, A's and B's gap), largest |B - A| first
    slowest: list[tuple[int, str, float, float, float, float, float, float]]


def compare_runs(a: list[StepRecord], b: list[StepRecord], top: int = 10) -> RunDiff:
    """Where run ``b`` spends more or less wall time than run ``a``: the runs must have made the
    same schedules (same prompt tokens and batch at every step), else pairing them means nothing."""
    if [(s.prompt_tokens, s.batch) for s in a] != [(s.prompt_tokens, s.batch) for s in b]:
        raise ValueError(f"the runs scheduled differently ({len(a)} and {len(b)} steps): cannot pair their steps")
    phases = classify(a)
    delta = dict.fromkeys(PHASES, 0.0)
    for p, sa, sb in zip(phases, a, b):
        delta[p] += sb.wall - sa.wall
    host: dict[str, float] = {}
    for sa, sb in zip(a, b):
        for k in sa.phases.keys() | sb.phases.keys():
            host[k] = host.get(k, 0.0) + sb.phases.get(k, 0.0) - sa.phases.get(k, 0.0)
    order = sorted(range(len(a)), key=lambda i: abs(b[i].wall - a[i].wall), reverse=True)[:top]
    return RunDiff(
        delta,
        dict(sorted(host.items())),
        [(i, phases[i], a[i].wall, b[i].wall, a[i].call, b[i].call, a[i].gap, b[i].gap) for i in order],
    )


def report_diff(d: RunDiff, label: str) -> str:
    lines = [f"{label}: " + ", ".join(f"{p} {v * 1e3:+.1f} ms" for p, v in d.phase_delta.items())]
    lines.append("  host phases: " + ", ".join(f"{p} {v * 1e3:+.1f} ms" for p, v in d.host_delta.items()))
    lines += [
        f"  step {i:4d} ({p}): {wa * 1e3:7.2f} -> {wb * 1e3:7.2f} ms (step() call {ca * 1e3:.2f} -> {cb * 1e3:.2f}, "
        f"gap before it {ga * 1e3:.2f} -> {gb * 1e3:.2f})"
        for i, p, wa, wb, ca, cb, ga, gb in d.slowest
    ]
    return "\n".join(lines)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_run(
    kv_cache_dtype: str, limit: int | None = None, cap: int | None = None
) -> tuple[list[StepRecord], float, int]:
    """One timed run; ``limit`` requests and ``cap`` output tokens each only for smoke checks."""
    w = gpu_workload()
    if limit is not None:
        w.prompts, w.max_tokens = w.prompts[:limit], w.max_tokens[:limit]
    if cap is not None:
        w.max_tokens = [min(n, cap) for n in w.max_tokens]
    llm = LLM(shape_config_dir("qwen3-0.6b"), load_format="dummy", max_model_len=4096, kv_cache_dtype=kv_cache_dtype)
    engine = llm.llm_engine
    params = [SamplingParams(temperature=w.temperature, max_tokens=n, ignore_eos=True, seed=None) for n in w.max_tokens]
    try:
        llm.generate(_warmup_prompts(w), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        launched: list[StepRecord] = []
        schedule = engine.scheduler.schedule

        def recording_schedule():
            sched = schedule()
            if not sched.is_empty:
                prompt = samples = 0
                for seq, n in zip(sched.seqs, sched.num_new_tokens):
                    todo = seq.num_prompt_tokens - seq.num_computed_tokens
                    prompt += max(0, min(n, todo))
                    samples += int(n >= todo)  # the step reaches the end of what is known: it samples
                launched.append(StepRecord(prompt, samples, len(sched.seqs)))
            return sched

        completed: list[tuple[float, dict]] = []
        calls: list[tuple[float, float]] = []  # (entered, returned) of each engine.step call
        step = engine.step

        def timed_step():
            entered = time.perf_counter()
            try:
                return step()
            finally:
                calls.append((entered, time.perf_counter()))

        engine.step = timed_step  # type: ignore[method-assign]
        engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
        engine.step_profiler = lambda phases: completed.append((time.perf_counter(), dict(phases)))
        _sync()
        start = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=False)
        _sync()
        elapsed = time.perf_counter() - start
        engine.step_profiler = None
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
        engine.step = step  # type: ignore[method-assign]
    finally:
        llm.close()
    if len(completed) != len(launched):
        raise RuntimeError(f"{len(completed)} steps completed but {len(launched)} were scheduled: cannot pair them")
    attach_times(launched, completed, calls, start)
    return launched, elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def attach_times(
    steps: list[StepRecord], completed: list[tuple[float, dict]], calls: list[tuple[float, float]], start: float
) -> None:
    """Fill each step's times from when it completed (``completed``: the time and the phases
    ``step_profiler`` reported) and the ``LLMEngine.step`` calls (entered, returned): its wall since
    the previous completion, the call that was running when it completed and the gap before that call."""
    prev = start
    entered = [c[0] for c in calls]
    for rec, (t, phases) in zip(steps, completed):
        rec.wall, prev = t - prev, t
        k = bisect.bisect_right(entered, t) - 1  # the last call entered at or before t
        if k >= 0:
            rec.call = calls[k][1] - calls[k][0]
            rec.gap = calls[k][0] - (calls[k - 1][1] if k > 0 else start)
        rec.wait = phases.get("wait", 0.0)
        rec.host = sum(phases.values()) - rec.wait
        rec.phases = phases


def report(rows: list[PhaseRow], elapsed: float, n_out: int, label: str) -> str:
    lines = [
        f"{label}: {sum(r.steps for r in rows)} steps, {elapsed:.2f} s, {n_out} output tokens, "
        f"{n_out / elapsed:,.0f} tok/s",
        "| phase | steps | seconds | share | output tokens | prompt tokens | output tok/s | mean batch | host s | wait s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.phase} | {r.steps} | {r.seconds:.2f} | {r.seconds / elapsed:.0%} | {r.output_tokens:,} | "
            f"{r.prompt_tokens:,} | {r.tok_s:,.0f} | {r.mean_batch:.0f} | {r.host_seconds:.2f} | {r.wait_seconds:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--json-out")
    p.add_argument("--limit", type=int, help="smoke check only: the first LIMIT requests")
    p.add_argument("--cap", type=int, help="smoke check only: at most CAP output tokens per request")
    p.add_argument("--detail", type=int, default=0, help="also print the first DETAIL steps one by one")
    p.add_argument("--runs", type=int, default=1, help="build the engine and time the run RUNS times in this process")
    args = p.parse_args()
    runs = [profile_run(args.kv_cache_dtype, args.limit, args.cap) for _ in range(args.runs)]
    steps, elapsed, n_out = runs[0]
    rows = summarise(steps)
    for i, s in enumerate(steps[: args.detail]):
        print(
            f"step {i:3d}: prompt {s.prompt_tokens:5d} batch {s.batch:3d} samples {s.samples:3d} "
            f"wall {s.wall * 1e3:6.1f} ms host {s.host * 1e3:6.1f} ms wait {s.wait * 1e3:6.1f} ms ("
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in s.phases.items() if k != "wait")
            + ")"
        )
    counted = sum(r.output_tokens for r in rows)
    if counted != n_out:  # e.g. a preempted sequence recomputed: the phases still stand, say so
        print(f"warning: the steps sampled {counted} tokens, the run returned {n_out}", flush=True)
    print(report(rows, elapsed, n_out, f"run 1: gpu workload, kv_cache_dtype={args.kv_cache_dtype}"), flush=True)
    for k, (later, elapsed_k, n_k) in enumerate(runs[1:], 2):
        print(report(summarise(later), elapsed_k, n_k, f"run {k}"), flush=True)
        print(report_diff(compare_runs(runs[0][0], later), f"run {k} minus run 1"), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "seconds": elapsed,
                    "output_tokens": n_out,
                    "phases": [asdict(r) | {"tok_s": r.tok_s} for r in rows],
                    "steps": [asdict(s) for s in steps],
                    "later_runs": [
                        {"seconds": e, "output_tokens": n, "steps": [asdict(s) for s in st]} for st, e, n in runs[1:]
                    ],
                },
                f,
            )


if __name__ == "__main__":
    main()
