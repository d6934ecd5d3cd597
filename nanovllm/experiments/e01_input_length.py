"""01 input length: how the prompt's length drives time to first token and prefill speed.

One request at a time (batch 1), prompts of growing length, a few output tokens each.
Time to first token (TTFT) is the prefill of the whole prompt plus one sample; the
decode steps after it show whether a longer context slows each output token.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.experiments.report import Report, median, ms, ratio
from nanovllm.experiments.workload import random_prompts, run_workload, warm_up

NUMBER, NAME = "01", "input-length"
TITLE = "input length vs time to first token and throughput"
LOOK_FOR = [
    "how TTFT grows with the prompt: in proportion, faster (attention is quadratic), or slower "
    "(fixed costs dominate short prompts)",
    "whether prefill speed (prompt tokens/s) rises with length, and whether time per output token "
    "depends on the context length",
]
SWEPT: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shape:
    input_lens: tuple[int, ...]
    max_tokens: int
    repeat: int = 1


SHAPES = {"cpu": Shape((16, 64, 128, 256, 512), 8), "gpu": Shape((128, 512, 1024, 2048, 4096, 8000), 64, repeat=3)}


def engine_args(shape: Shape) -> dict:
    return {"max_model_len": max(shape.input_lens) + shape.max_tokens + 16}


def run(llm, shape: Shape, report: Report) -> list[dict]:
    vocab = llm.llm_engine.vocab_size
    warm_up(llm)
    rows = []
    for i, n in enumerate(shape.input_lens):
        runs = [
            run_workload(llm, random_prompts(vocab, [n], seed=100 * i + r), shape.max_tokens)
            for r in range(shape.repeat)
        ]
        reqs = [run.requests[0] for run in runs]
        ttft = median(r.ttft_s for r in reqs)
        rows.append(
            {
                "input_len": n,
                "output_tokens": reqs[0].num_output_tokens,
                "ttft_s": ttft,
                "prefill_tok_per_s": n / ttft,
                "tpot_s": median(r.tpot_s for r in reqs),
                "latency_s": median(r.latency_s for r in reqs),
                "output_tok_per_s": median(run.output_tok_per_s for run in runs),
                "steps": runs[0].stats["steps"],
            }
        )
    report.table(rows)
    report.write_csv("input_length.csv", rows)
    _plot(report, rows)
    first, last = rows[0], rows[-1]
    report.result(
        f"TTFT went from {ms(first['ttft_s'])} at {first['input_len']} prompt tokens to "
        f"{ms(last['ttft_s'])} at {last['input_len']} ({ratio(first['ttft_s'], last['ttft_s'])} "
        f"for {ratio(first['input_len'], last['input_len'])} the tokens)"
    )
    peak = max(rows, key=lambda r: r["prefill_tok_per_s"])
    report.result(
        f"prefill speed: {first['prefill_tok_per_s']:.0f} tok/s at {first['input_len']} tokens, "
        f"{last['prefill_tok_per_s']:.0f} at {last['input_len']}, highest {peak['prefill_tok_per_s']:.0f} "
        f"at {peak['input_len']}; time per output token {ms(first['tpot_s'])} -> {ms(last['tpot_s'])}"
    )
    return rows


def _plot(report: Report, rows: list[dict]) -> None:
    x = [r["input_len"] for r in rows]
    fig, ax = report.figure(ncols=2)
    a, b = ax[0]
    a.plot(x, [r["ttft_s"] * 1000 for r in rows], "o-")
    a.set(xlabel="prompt tokens", ylabel="time to first token (ms)", title="TTFT")
    b.plot(x, [r["prefill_tok_per_s"] for r in rows], "o-", label="prefill tok/s")
    b.set(xlabel="prompt tokens", ylabel="prompt tokens / s", title="prefill speed and time per output token")
    c = b.twinx()
    c.plot(x, [(r["tpot_s"] or 0) * 1000 for r in rows], "s--", color="tab:red", label="ms per output token")
    c.set_ylabel("ms per output token", color="tab:red")
    for axis in (a, b):
        axis.set_xscale("log", base=2)
        axis.grid(alpha=0.3)
    b.legend(loc="upper left", fontsize=8)
    c.legend(loc="lower right", fontsize=8)
    report.save_figure(fig, "input_length.png", f"{NUMBER} {TITLE}")
