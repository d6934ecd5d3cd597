"""07 mixed-length batch: requests of very different sizes, submitted together.

Continuous batching lets short requests finish and leave while long ones continue, and
lets waiting requests take the freed places; chunked prefill splits a long prompt over
several steps that also carry other requests' decodes. The timeline shows each request's
steps on the wall clock: waiting, prefill chunks, decode, first token and finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.experiments.report import Report, median, ms
from nanovllm.experiments.workload import random_prompts, run_workload, warm_up

NUMBER, NAME = "07", "mixed-batch"
TITLE = "mixed-length batch: per-request timeline"
LOOK_FOR = [
    "the finishing order against the submission order, and how long each request waited before its first step",
    "steps that mix a long prompt's prefill chunk with other requests' decodes, and what they cost against "
    "decode-only steps",
]
SWEPT: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shape:
    input_lens: tuple[int, ...]
    max_tokens: tuple[int, ...]
    max_num_batched_tokens: int
    max_num_seqs: int


SHAPES = {
    "cpu": Shape((16, 160, 40, 96, 24, 64), (24, 6, 16, 10, 32, 12), 64, 4),
    "gpu": Shape((128, 4096, 512, 2048, 256, 1024, 64, 3072), (256, 32, 128, 64, 512, 96, 384, 16), 1024, 4),
}


def engine_args(shape: Shape) -> dict:
    return {"max_num_batched_tokens": shape.max_num_batched_tokens, "max_num_seqs": shape.max_num_seqs}


def run(llm, shape: Shape, report: Report) -> list[dict]:
    prompts = random_prompts(llm.llm_engine.vocab_size, shape.input_lens, seed=700)
    warm_up(llm)
    run = run_workload(llm, prompts, list(shape.max_tokens))
    finish_order = sorted(run.requests, key=lambda r: r.latency_s)
    rank = {r.request_id: k + 1 for k, r in enumerate(finish_order)}
    rows: list[dict] = []
    for k, r in enumerate(run.requests):
        s = r.summary
        rows.append(
            {
                "request": r.request_id,
                "submitted": k + 1,
                "prompt_tokens": r.num_prompt_tokens,
                "output_tokens": r.num_output_tokens,
                "waited_s": s.t_first_scheduled - run.t0,
                "ttft_s": r.ttft_s,
                "latency_s": r.latency_s,
                "finish_rank": rank[r.request_id],
                "prefill_chunks": s.num_prefill_chunks,
                "preemptions": s.num_preemptions,
                "recompute_steps": s.num_recompute_steps,
                "first_step": s.first_step,
                "finish_step": s.finish_step,
            }
        )
    steps: list[dict] = [
        {
            "step": e.step,
            "kind": e.kind,
            "seqs": len(e.seqs),
            "tokens": e.num_tokens,
            "prefill_tokens": sum(s.num_new_tokens for s in e.seqs if s.phase == "prefill"),
            "decode_tokens": sum(s.num_new_tokens for s in e.seqs if s.phase == "decode"),
            "t_start_s": e.t_start - run.t0,
            "step_s": e.duration,
        }
        for e in run.events
    ]
    report.table(rows)
    report.write_csv("mixed_batch_requests.csv", rows)
    report.write_csv("mixed_batch_steps.csv", steps)
    _plot(report, run)
    report.result(
        "finishing order: "
        + ", ".join(f"{r.request_id} ({r.num_output_tokens} out, {ms(r.latency_s)})" for r in finish_order)
        + "; submitted "
        + ", ".join(r.request_id for r in run.requests)
    )
    waited = max(rows, key=lambda r: r["waited_s"])
    report.result(
        f"request {waited['request']} waited longest for its first step: {ms(waited['waited_s'])} "
        f"(max_num_seqs={shape.max_num_seqs}); TTFT ranged {ms(min(r['ttft_s'] for r in rows))} to "
        f"{ms(max(r['ttft_s'] for r in rows))}"
    )
    mixed = [s for s in steps if s["kind"] == "mixed"]
    decode = [s["step_s"] for s in steps if s["kind"] == "decode"]
    if mixed:
        report.result(
            f"{len(mixed)} of {len(steps)} steps were mixed (prefill chunk + decodes), median "
            f"{ms(median(s['step_s'] for s in mixed))} against {ms(median(decode))} for decode-only steps"
        )
    else:
        report.result(f"no mixed steps in {len(steps)} steps")
    return rows


def _plot(report: Report, run) -> None:
    colors = {"prefill": "#f0a030", "decode": "#3b82c4"}
    ids = [r.request_id for r in run.requests]
    fig, ax = report.figure(nrows=2, size=(9, 2.6))
    a, b = ax[0][0], ax[1][0]
    for y, r in enumerate(run.requests):
        a.plot([0, r.summary.t_first_scheduled - run.t0], [y, y], color="#bbb", linewidth=2)
    for e in run.events:
        for s in e.seqs:
            a.barh(
                ids.index(s.request_id),
                e.duration,
                left=e.t_start - run.t0,
                color=colors[s.phase],
                edgecolor="white",
                linewidth=0.3,
                height=0.6,
            )
    for y, r in enumerate(run.requests):
        a.plot(r.ttft_s, y, "D", color="black", markersize=4)
        a.plot(r.latency_s, y, "|", color="black", markersize=12, markeredgewidth=2)
    a.set_yticks(
        range(len(ids)), [f"req {r.request_id} ({r.num_prompt_tokens}+{r.num_output_tokens})" for r in run.requests]
    )
    a.invert_yaxis()
    a.set(
        xlabel="seconds since submission",
        title="grey waiting, orange prefill, blue decode; diamond first token, | finished",
    )
    t = [e.t_start - run.t0 for e in run.events]
    w = [e.duration for e in run.events]
    pre = [sum(s.num_new_tokens for s in e.seqs if s.phase == "prefill") for e in run.events]
    dec = [sum(s.num_new_tokens for s in e.seqs if s.phase == "decode") for e in run.events]
    b.bar(t, pre, width=w, align="edge", color=colors["prefill"], label="prefill tokens")
    b.bar(t, dec, width=w, align="edge", bottom=pre, color=colors["decode"], label="decode tokens")
    b.set(xlabel="seconds since submission", ylabel="tokens in step")
    b.legend(fontsize=7)
    for axis in (a, b):
        axis.grid(alpha=0.3)
    report.save_figure(fig, "mixed_batch.png", f"{NUMBER} {TITLE}")
