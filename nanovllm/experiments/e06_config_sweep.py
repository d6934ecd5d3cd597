"""06 config sweep: max_num_seqs x max_num_batched_tokens on one workload.

max_num_seqs caps how many sequences run at once (the decode batch); max_num_batched_tokens
caps the tokens of one step (how fast prompts get in, and how much prefill a step mixes with
decodes). The same requests run under each pair; two heat maps show output throughput and
mean time to first token.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.experiments.report import Report, ms
from nanovllm.experiments.workload import engine_variant, random_prompts, run_workload, warm_up

NUMBER, NAME = "06", "config-sweep"
TITLE = "config sweep: max_num_seqs x max_num_batched_tokens"
LOOK_FOR = [
    "which of the two knobs moves throughput more on this workload, and where the best pair lies",
    "how the token budget changes time to first token (a small budget admits prompts slowly)",
]
SWEPT = ("max_num_seqs", "max_num_batched_tokens")


@dataclass(frozen=True)
class Shape:
    num_requests: int
    input_len: int
    max_tokens: int
    max_num_seqs: tuple[int, ...]
    max_num_batched_tokens: tuple[int, ...]


SHAPES = {
    "cpu": Shape(6, 16, 4, (2, 3, 6), (8, 32, 128)),
    "gpu": Shape(256, 512, 128, (16, 64, 256), (512, 2048, 8192)),
}


def engine_args(shape: Shape) -> dict:
    return {"max_num_seqs": max(shape.max_num_seqs), "max_num_batched_tokens": max(shape.max_num_batched_tokens)}


def run(llm, shape: Shape, report: Report) -> list[dict]:
    prompts = random_prompts(llm.llm_engine.vocab_size, [shape.input_len] * shape.num_requests, seed=600)
    warm_up(llm)
    rows = []
    for seqs in shape.max_num_seqs:
        for budget in shape.max_num_batched_tokens:
            engine_variant(llm, max_num_seqs=seqs, max_num_batched_tokens=budget)
            run = run_workload(llm, prompts, shape.max_tokens)
            n = len(run.requests)
            rows.append(
                {
                    "max_num_seqs": seqs,
                    "max_num_batched_tokens": budget,
                    "steps": run.stats["steps"],
                    "output_tokens": run.num_output_tokens,
                    "wall_s": run.wall_s,
                    "output_tok_per_s": run.output_tok_per_s,
                    "total_tok_per_s": (run.num_output_tokens + run.num_prompt_tokens) / run.wall_s,
                    "mean_ttft_s": sum(r.ttft_s for r in run.requests) / n,
                    "mean_latency_s": sum(r.latency_s for r in run.requests) / n,
                }
            )
    report.table(rows)
    report.write_csv("config_sweep.csv", rows)
    _plot(report, shape, rows)
    best = max(rows, key=lambda r: r["output_tok_per_s"])
    worst = min(rows, key=lambda r: r["output_tok_per_s"])
    report.result(
        f"highest throughput {best['output_tok_per_s']:.1f} output tok/s at max_num_seqs="
        f"{best['max_num_seqs']}, max_num_batched_tokens={best['max_num_batched_tokens']}; lowest "
        f"{worst['output_tok_per_s']:.1f} at {worst['max_num_seqs']} x {worst['max_num_batched_tokens']} "
        f"({best['output_tok_per_s'] / worst['output_tok_per_s']:.1f}x apart)"
    )

    def spread(key, values, metric):
        means = [sum(r[metric] for r in rows if r[key] == v) / sum(1 for r in rows if r[key] == v) for v in values]
        return means

    by_seqs = spread("max_num_seqs", shape.max_num_seqs, "output_tok_per_s")
    by_budget = spread("max_num_batched_tokens", shape.max_num_batched_tokens, "output_tok_per_s")
    report.result(
        f"averaged over the other knob, throughput went {by_seqs[0]:.1f} -> {by_seqs[-1]:.1f} tok/s "
        f"across max_num_seqs {shape.max_num_seqs[0]}..{shape.max_num_seqs[-1]} and "
        f"{by_budget[0]:.1f} -> {by_budget[-1]:.1f} across max_num_batched_tokens "
        f"{shape.max_num_batched_tokens[0]}..{shape.max_num_batched_tokens[-1]}"
    )
    ttft = spread("max_num_batched_tokens", shape.max_num_batched_tokens, "mean_ttft_s")
    report.result(
        "mean TTFT (averaged over max_num_seqs): "
        + ", ".join(f"{ms(t)} at budget {b}" for b, t in zip(shape.max_num_batched_tokens, ttft))
    )
    return rows


def _plot(report: Report, shape: Shape, rows) -> None:
    fig, ax = report.figure(ncols=2, size=(4.8, 3.8))
    for axis, metric, label, scale in (
        (ax[0][0], "output_tok_per_s", "output tokens / s", 1.0),
        (ax[0][1], "mean_ttft_s", "mean time to first token (ms)", 1000.0),
    ):
        grid = [
            [
                next(r[metric] for r in rows if r["max_num_seqs"] == s and r["max_num_batched_tokens"] == b) * scale
                for b in shape.max_num_batched_tokens
            ]
            for s in shape.max_num_seqs
        ]
        im = axis.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                axis.text(j, i, f"{v:.3g}", ha="center", va="center", color="white", fontsize=8)
        axis.set_xticks(range(len(shape.max_num_batched_tokens)), shape.max_num_batched_tokens)
        axis.set_yticks(range(len(shape.max_num_seqs)), shape.max_num_seqs)
        axis.set(xlabel="max_num_batched_tokens", ylabel="max_num_seqs", title=label)
        fig.colorbar(im, ax=axis, shrink=0.8)
    report.save_figure(fig, "config_sweep.png", f"{NUMBER} {TITLE}")
