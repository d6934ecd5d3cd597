"""05 KV cache pressure: the same workload on KV caches of decreasing size.

When the running sequences need a block and none is free, the scheduler preempts the most
recently admitted one: its blocks are freed and it is recomputed later from its prompt and
the tokens generated so far. A smaller cache means fewer sequences at once and, below the
workload's full need, preemptions whose recomputation is wasted work.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.core.utils import cdiv
from nanovllm.experiments.report import Report, ratio
from nanovllm.experiments.workload import engine_variant, random_prompts, run_workload, warm_up

NUMBER, NAME = "05", "kv-pressure"
TITLE = "KV cache size vs preemptions, KV usage and throughput"
LOOK_FOR = [
    "below which cache size preemptions start, and how many prompt tokens are recomputed because of them",
    "how many sequences share a decode step at each size, and what that does to throughput",
]
SWEPT = ("num_kvcache_blocks",)


@dataclass(frozen=True)
class Shape:
    num_requests: int
    input_len: int
    max_tokens: int
    cache_blocks: tuple[int, ...]  # the sweep; each must hold one whole request
    block_size: int = 8


SHAPES = {"cpu": Shape(4, 16, 12, (5, 8, 12, 16)), "gpu": Shape(64, 256, 256, (256, 512, 1024, 2048), block_size=16)}


def engine_args(shape: Shape) -> dict:
    return {
        "block_size": shape.block_size,
        "num_kvcache_blocks": max(shape.cache_blocks),
        "max_num_seqs": shape.num_requests,
    }


def full_need(shape: Shape) -> int:
    """Blocks for every request at its full length at once."""
    return shape.num_requests * cdiv(shape.input_len + shape.max_tokens, shape.block_size)


def run(llm, shape: Shape, report: Report) -> list[dict]:
    prompts = random_prompts(llm.llm_engine.vocab_size, [shape.input_len] * shape.num_requests, seed=500)
    warm_up(llm)
    rows, usage = [], {}
    for blocks in sorted(shape.cache_blocks, reverse=True):
        engine_variant(llm, num_kvcache_blocks=blocks)
        run = run_workload(llm, prompts, shape.max_tokens)
        decode = [len(e.seqs) for e in run.events if e.kind == "decode"]
        rows.append(
            {
                "num_blocks": blocks,
                "preemptions": run.stats["preemptions"],
                "recomputed_tokens": run.stats["prompt_tokens_computed"] - run.num_prompt_tokens,
                "peak_used_blocks": max(e.num_blocks - e.num_free_blocks for e in run.events),
                "mean_seqs_per_decode_step": sum(decode) / len(decode) if decode else 0.0,
                "steps": run.stats["steps"],
                "output_tokens": run.num_output_tokens,
                "wall_s": run.wall_s,
                "output_tok_per_s": run.output_tok_per_s,
            }
        )
        usage[blocks] = [(e.num_blocks - e.num_free_blocks) / e.num_blocks for e in run.events]
    rows.sort(key=lambda r: r["num_blocks"])
    report.table(rows)
    report.write_csv("kv_pressure.csv", rows)
    _plot(report, rows, usage)
    need = full_need(shape)
    with_pre = [r for r in rows if r["preemptions"]]
    if with_pre:
        worst = max(with_pre, key=lambda r: r["preemptions"])
        clean = [r["num_blocks"] for r in rows if not r["preemptions"]]
        report.result(
            f"preemptions at {', '.join(str(r['num_blocks']) for r in with_pre)} blocks (most: "
            f"{worst['preemptions']} at {worst['num_blocks']} blocks, recomputing "
            f"{worst['recomputed_tokens']} tokens); none at "
            f"{', '.join(map(str, clean)) or 'any size tried'}; every request at full length needs {need}"
        )
    else:
        report.result(f"no preemptions at any size tried (every request at full length needs {need} blocks)")
    lo, hi = rows[0], rows[-1]
    report.result(
        f"with {lo['num_blocks']} blocks {lo['mean_seqs_per_decode_step']:.1f} sequences shared a decode "
        f"step and output ran at {lo['output_tok_per_s']:.1f} tok/s; with {hi['num_blocks']}: "
        f"{hi['mean_seqs_per_decode_step']:.1f} and {hi['output_tok_per_s']:.1f} tok/s "
        f"({ratio(lo['output_tok_per_s'], hi['output_tok_per_s'])})"
    )
    return rows


def _plot(report: Report, rows, usage) -> None:
    fig, ax = report.figure(ncols=3, size=(4.6, 3.4))
    a, b, c = ax[0]
    x = [r["num_blocks"] for r in rows]
    a.plot(x, [r["preemptions"] for r in rows], "o-", color="#d62728", label="preemptions")
    a2 = a.twinx()
    a2.plot(x, [r["recomputed_tokens"] for r in rows], "s--", color="gray", label="recomputed tokens")
    a.set(xlabel="KV cache blocks", ylabel="preemptions", title="preemptions")
    a2.set_ylabel("recomputed prompt tokens")
    a.legend(loc="upper right", fontsize=7)
    a2.legend(loc="center right", fontsize=7)
    b.plot(x, [r["output_tok_per_s"] for r in rows], "o-", label="output tok/s")
    b2 = b.twinx()
    b2.plot(x, [r["mean_seqs_per_decode_step"] for r in rows], "s--", color="tab:green", label="seqs per decode step")
    b.set(xlabel="KV cache blocks", ylabel="output tokens / s", title="throughput")
    b2.set_ylabel("mean sequences per decode step")
    b.legend(loc="upper left", fontsize=7)
    b2.legend(loc="lower right", fontsize=7)
    for blocks, fractions in sorted(usage.items()):
        c.plot(range(len(fractions)), fractions, label=f"{blocks} blocks", linewidth=1)
    c.set(
        xlabel="step of the run", ylabel="fraction of KV blocks in use", title="KV usage over the run", ylim=(0, 1.05)
    )
    c.legend(fontsize=7)
    for axis in (a, b, c):
        axis.grid(alpha=0.3)
    report.save_figure(fig, "kv_pressure.png", f"{NUMBER} {TITLE}")
