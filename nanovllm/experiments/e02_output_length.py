"""02 generation length: how the number of output tokens drives a request's latency.

One request at a time, a fixed prompt, growing max_tokens (ignore_eos: exactly that many
tokens). A straight-line fit of latency against output tokens gives the cost of one output
token (slope) and the fixed cost (intercept, close to TTFT if decode steps cost the same);
the longest run's step times show whether a step slows as the context grows.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.experiments.report import Report, median, ms
from nanovllm.experiments.workload import random_prompts, run_workload, warm_up

NUMBER, NAME = "02", "output-length"
TITLE = "generation length vs latency"
LOOK_FOR = [
    "whether latency grows in a straight line with the output tokens, and what one output token costs",
    "whether decode steps get slower as the context grows during one generation",
]
SWEPT: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shape:
    input_len: int
    output_lens: tuple[int, ...]
    repeat: int = 1


SHAPES = {"cpu": Shape(32, (8, 16, 32, 64)), "gpu": Shape(128, (64, 256, 1024, 4096), repeat=3)}


def engine_args(shape: Shape) -> dict:
    return {"max_model_len": shape.input_len + max(shape.output_lens) + 16}


def run(llm, shape: Shape, report: Report) -> list[dict]:
    vocab = llm.llm_engine.vocab_size
    warm_up(llm)
    rows, longest = [], None
    for i, m in enumerate(shape.output_lens):
        runs = [
            run_workload(llm, random_prompts(vocab, [shape.input_len], seed=200 + 10 * i + r), m)
            for r in range(shape.repeat)
        ]
        reqs = [run.requests[0] for run in runs]
        rows.append(
            {
                "output_tokens": m,
                "input_len": shape.input_len,
                "latency_s": median(r.latency_s for r in reqs),
                "ttft_s": median(r.ttft_s for r in reqs),
                "tpot_s": median(r.tpot_s for r in reqs),
                "output_tok_per_s": median(run.output_tok_per_s for run in runs),
                "steps": runs[0].stats["steps"],
            }
        )
        longest = runs[0]
    steps = [
        {"step": e.step, "context_len": e.seqs[0].num_tokens, "kind": e.kind, "step_s": e.duration}
        for e in longest.events
    ]
    report.table(rows)
    report.write_csv("output_length.csv", rows)
    report.write_csv("output_length_steps.csv", steps)
    slope, intercept = _fit([r["output_tokens"] for r in rows], [r["latency_s"] for r in rows])
    _plot(report, rows, steps, slope, intercept)
    report.result(
        f"latency grew by {ms(slope)} per output token (least-squares line over {len(rows)} lengths); "
        f"the line's intercept is {ms(intercept)} against a measured TTFT of "
        f"{ms(median(r['ttft_s'] for r in rows))} (median)"
    )
    decode = [s for s in steps if s["kind"] == "decode"]
    if len(decode) >= 4:
        q = len(decode) // 4
        early, late = median(s["step_s"] for s in decode[:q]), median(s["step_s"] for s in decode[-q:])
        report.result(
            f"in the {rows[-1]['output_tokens']}-token run a decode step took {ms(early)} (median of the "
            f"first quarter, context {decode[0]['context_len']}) and {ms(late)} in the last quarter "
            f"(context up to {decode[-1]['context_len']})"
        )
    return rows


def _fit(x: list[float], y: list[float]) -> tuple[float, float]:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def _plot(report: Report, rows, steps, slope, intercept) -> None:
    fig, ax = report.figure(ncols=2)
    a, b = ax[0]
    x = [r["output_tokens"] for r in rows]
    a.plot(x, [r["latency_s"] for r in rows], "o", label="measured")
    a.plot([0, max(x)], [intercept, intercept + slope * max(x)], "--", label=f"fit: {slope * 1000:.1f} ms/token")
    a.set(xlabel="output tokens", ylabel="request latency (s)", title="latency")
    a.legend(fontsize=8)
    decode = [s for s in steps if s["kind"] == "decode"]
    b.plot([s["context_len"] for s in decode], [s["step_s"] * 1000 for s in decode], ".", alpha=0.7)
    b.set(
        xlabel="context length (tokens)",
        ylabel="decode step (ms)",
        title=f"decode steps of the {rows[-1]['output_tokens']}-token run",
    )
    for axis in (a, b):
        axis.grid(alpha=0.3)
    report.save_figure(fig, "output_length.png", f"{NUMBER} {TITLE}")
