"""04 scheduler watch: prefill, decode, finishing order and block tables, step by step.

A handful of requests on a deliberately small engine: a token budget of a few dozen tokens
per step (long prompts are prefilled in chunks, and chunks share steps with decodes), a KV
cache too small for every request at its full length (someone gets preempted and later
recomputed), and two prompts that share a prefix (the second may find the first's blocks in
the prefix cache). Every step is printed as the engine's trace prints it, and the run is saved
as an HTML page (``trace.html``) to step through in a browser.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from nanovllm.experiments.report import Report, ms
from nanovllm.experiments.workload import random_prompt, run_workload
from nanovllm.trace_html import trace_document, write_html

NUMBER, NAME = "04", "scheduler-watch"
TITLE = "scheduler watch: prefill, decode, finishing order, block tables"
LOOK_FOR = [
    "which steps are prefill, decode or mixed; how a long prompt is split into chunks under the token budget",
    "the order requests finish in; who is preempted when the KV cache runs out, and when it is recomputed; "
    "whether the shared prefix is served from the prefix cache; block tables growing a block at a time",
]
SWEPT: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shape:
    shared_prefix: int  # tokens shared by the first and third prompt
    own_lens: tuple[int, ...]  # each prompt's own tokens (after the prefix for requests 0 and 2)
    max_tokens: tuple[int, ...]
    block_size: int = 16
    num_kvcache_blocks: int = 8
    max_num_batched_tokens: int = 32
    max_num_seqs: int = 4


SHAPES = {"cpu": Shape(32, (8, 24, 16, 20), (20, 6, 12, 28)), "gpu": Shape(32, (8, 24, 16, 20), (20, 6, 12, 28))}


def engine_args(shape: Shape) -> dict:
    return {
        "block_size": shape.block_size,
        "num_kvcache_blocks": shape.num_kvcache_blocks,
        "max_num_batched_tokens": shape.max_num_batched_tokens,
        "max_num_seqs": shape.max_num_seqs,
    }


def prompts(shape: Shape, vocab_size: int) -> list[list[int]]:
    rng = random.Random(400)
    prefix = random_prompt(vocab_size, shape.shared_prefix, rng)
    out = []
    for i, n in enumerate(shape.own_lens):
        own = random_prompt(vocab_size, n, rng)
        out.append(prefix + own if i in (0, 2) else own)
    return out


def run(llm, shape: Shape, report: Report) -> list[dict]:
    engine = llm.llm_engine  # no warm-up: the KV cache and the prefix cache start empty
    ps = prompts(shape, engine.vocab_size)
    run = run_workload(llm, ps, list(shape.max_tokens))
    text = []
    for ev in run.events:
        text.append(f"{ev.format()}\n    ({ms(ev.duration)})")
    report.echo("\n".join(text))
    rows = [
        {
            "step": e.step,
            "kind": e.kind,
            "tokens": e.num_tokens,
            "seqs": len(e.seqs),
            "used_blocks": e.num_blocks - e.num_free_blocks,
            "num_blocks": e.num_blocks,
            "preempted": " ".join(e.preempted),
            "finished": " ".join(r for r, _ in e.finished),
            "step_s": e.duration,
        }
        for e in run.events
    ]
    reqs = [
        {
            "request": r.request_id,
            "prompt_tokens": r.num_prompt_tokens,
            "output_tokens": r.num_output_tokens,
            "first_step": r.summary.first_step,
            "first_token_step": r.summary.first_token_step,
            "finish_step": r.summary.finish_step,
            "prefill_chunks": r.summary.num_prefill_chunks,
            "preemptions": r.summary.num_preemptions,
            "recompute_steps": r.summary.num_recompute_steps,
            "cache_hit_tokens": r.summary.num_cached_tokens,
            "ttft_s": r.ttft_s,
            "latency_s": r.latency_s,
        }
        for r in run.requests
    ]
    report.table(reqs)
    report.write_text("trace.txt", "\n".join(text) + "\n")
    report.write_csv("steps.csv", rows)
    report.write_csv("requests.csv", reqs)
    doc = trace_document(run.events, engine, run.outputs, title=f"experiment {NUMBER}: {TITLE}")
    write_html(report.out_dir / "trace.html", doc)
    report.files.append(report.out_dir / "trace.html")
    report.echo(f"   wrote {report.out_dir / 'trace.html'} (open it in a browser; arrow keys step through)")
    _plot(report, run)
    _results(report, run)
    return rows


def _results(report: Report, run) -> None:
    kinds = {k: sum(e.kind == k for e in run.events) for k in ("prefill", "decode", "mixed")}
    report.result(
        f"{len(run.events)} steps: {kinds['prefill']} prefill-only, {kinds['decode']} decode-only, "
        f"{kinds['mixed']} mixed (prefill chunks and decodes in one step)"
    )
    report.result(prefill_line(run.requests))
    order = sorted((r for r in run.requests), key=lambda r: r.summary.finish_step)
    report.result(
        "finishing order: "
        + ", ".join(f"{r.request_id} (step {r.summary.finish_step})" for r in order)
        + "; submission order: "
        + ", ".join(r.request_id for r in run.requests)
    )
    pre = [(e.step, rid) for e in run.events for rid in e.preempted]
    report.result(
        "preemptions: "
        + (", ".join(f"request {rid} at step {s}" for s, rid in pre) if pre else "none")
        + f"; peak KV use {max(e.num_blocks - e.num_free_blocks for e in run.events)}"
        f"/{run.events[0].num_blocks} blocks"
    )
    hits = [(e.step, s.request_id, s.num_cached_tokens) for e in run.events for s in e.seqs if s.num_cached_tokens]
    report.result(
        "prefix-cache hits: "
        + (", ".join(f"request {r} reused {n} tokens at step {s}" for s, r, n in hits) if hits else "none")
    )


def prefill_line(requests) -> str:
    """The chunks of each request's first prefill, apart from the steps that recomputed it
    after a preemption; requests prefilled in one step and never preempted are left out."""
    parts = []
    for r in requests:
        s = r.summary
        if s.num_prefill_chunks > 1 or s.num_preemptions:
            part = f"request {r.request_id} ({r.num_prompt_tokens} tokens): {_count(s.num_prefill_chunks, 'chunk')}"
            if s.num_preemptions:
                part += (
                    f", then {_count(s.num_recompute_steps, 'recompute step')} "
                    f"after {_count(s.num_preemptions, 'preemption')}"
                )
            parts.append(part)
    return "prefill: " + ("; ".join(parts) if parts else "every request in one step, none preempted")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _plot(report: Report, run) -> None:
    colors = {"prefill": "#f0a030", "recompute": "#c05621", "decode": "#3b82c4"}
    ids = [r.request_id for r in run.requests]
    fig, ax = report.figure(nrows=2, size=(9, 2.4))
    a, b = ax[0][0], ax[1][0]
    for ev in run.events:
        for s in ev.seqs:
            kind = "recompute" if s.recompute else s.phase
            a.barh(ids.index(s.request_id), 1, left=ev.step, color=colors[kind], edgecolor="white", linewidth=0.3)
        for rid in ev.preempted:
            a.plot(ev.step + 0.5, ids.index(rid), "v", color="#d62728", markersize=8)
        for s in ev.seqs:
            if s.num_cached_tokens:
                a.plot(ev.step + 0.5, ids.index(s.request_id), "o", color="#2ca02c", markersize=6)
        for rid, _ in ev.finished:
            a.plot(ev.step + 1, ids.index(rid), "|", color="black", markersize=12, markeredgewidth=2)
    a.set_yticks(range(len(ids)), [f"req {i}" for i in ids])
    a.invert_yaxis()
    a.set(
        xlabel="step", title="orange prefill, dark orange recompute, blue decode; v preempted, o cache hit, | finished"
    )
    steps = [e.step for e in run.events]
    b.step(steps, [e.num_blocks - e.num_free_blocks for e in run.events], where="post", label="KV blocks in use")
    b.axhline(run.events[0].num_blocks, color="gray", linestyle=":", label="cache size")
    b.bar(steps, [e.num_tokens for e in run.events], alpha=0.3, color="gray", label="tokens in step")
    b.set(xlabel="step", ylabel="blocks / tokens")
    b.legend(fontsize=7, loc="upper right")
    for axis in (a, b):
        axis.grid(alpha=0.3)
    report.save_figure(fig, "scheduler_watch.png", f"{NUMBER} {TITLE}")
