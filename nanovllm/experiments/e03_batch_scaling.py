"""03 batch scaling: more sequences per step, more tokens per second — until what?

``batch`` requests with the same short prompt length and output length start together,
so every decode step carries ``batch`` sequences. The usual expectation: a decode step reads
all the weights once whatever the batch, so a step of many sequences costs little more than
a step of one, until compute (or, on a GPU, the KV reads) catch up. The run measures it.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.experiments.report import Report, median, ms, ratio
from nanovllm.experiments.workload import random_prompts, run_workload, warm_up

NUMBER, NAME = "03", "batch-scaling"
TITLE = "batch size vs throughput and time per output token"
LOOK_FOR = [
    "how output throughput changes as the batch doubles, and where the gain per doubling falls off",
    "what a decode step costs at batch 1 against the largest batch (the time per output token each request sees)",
]
SWEPT: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shape:
    batch_sizes: tuple[int, ...]
    input_len: int
    max_tokens: int


SHAPES = {"cpu": Shape((1, 2, 4, 8, 16), 16, 16), "gpu": Shape((1, 4, 16, 64, 128, 256, 512), 128, 128)}


def engine_args(shape: Shape) -> dict:
    return {"max_num_seqs": max(shape.batch_sizes), "max_model_len": shape.input_len + shape.max_tokens + 16}


def run(llm, shape: Shape, report: Report) -> list[dict]:
    vocab = llm.llm_engine.vocab_size
    warm_up(llm)
    rows = []
    for b in shape.batch_sizes:
        run = run_workload(llm, random_prompts(vocab, [shape.input_len] * b, seed=300 + b), shape.max_tokens)
        decode = run.step_times("decode")
        rows.append(
            {
                "batch": b,
                "output_tokens": run.num_output_tokens,
                "wall_s": run.wall_s,
                "output_tok_per_s": run.output_tok_per_s,
                "decode_step_s": median(decode),
                "ttft_s": median(r.ttft_s for r in run.requests),
                "max_seqs_in_step": max(len(e.seqs) for e in run.events),
                "steps": run.stats["steps"],
            }
        )
    report.table(rows)
    report.write_csv("batch_scaling.csv", rows)
    _plot(report, rows)
    first, last = rows[0], rows[-1]
    gains = [
        (rows[i]["batch"], rows[i]["output_tok_per_s"] / rows[i - 1]["output_tok_per_s"]) for i in range(1, len(rows))
    ]
    flat = next((b for b, g in gains if g < 1.2), None)
    tail = (
        f"the gain from one batch size to the next fell below 1.2x first at batch {flat}"
        if flat is not None
        else f"still rising at the largest batch ({gains[-1][1]:.2f}x over the previous)"
        if gains
        else ""
    )
    report.result(
        f"throughput rose {ratio(first['output_tok_per_s'], last['output_tok_per_s'])} from batch "
        f"{first['batch']} ({first['output_tok_per_s']:.1f} tok/s) to {last['batch']} "
        f"({last['output_tok_per_s']:.1f} tok/s); {tail}"
    )
    report.result(
        f"a decode step took {ms(first['decode_step_s'])} at batch {first['batch']} and "
        f"{ms(last['decode_step_s'])} at batch {last['batch']} "
        f"({ratio(first['decode_step_s'], last['decode_step_s'])} the time for "
        f"{ratio(first['batch'], last['batch'])} the tokens)"
    )
    return rows


def _plot(report: Report, rows: list[dict]) -> None:
    x = [r["batch"] for r in rows]
    fig, ax = report.figure(ncols=2)
    a, b = ax[0]
    a.plot(x, [r["output_tok_per_s"] for r in rows], "o-")
    a.set(xlabel="batch size (sequences per step)", ylabel="output tokens / s", title="throughput")
    b.plot(x, [r["decode_step_s"] * 1000 for r in rows], "o-", color="tab:orange")
    b.set(xlabel="batch size", ylabel="decode step = time per output token (ms)", title="time per output token")
    for axis in (a, b):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    report.save_figure(fig, "batch_scaling.png", f"{NUMBER} {TITLE}")
