"""`nanovllm bench latency`: time to first token and time per output token of one batch at a time.

For each ``--batch-size`` (default 1 and 8): ``--num-iters-warmup`` untimed batches, then
``--num-iters`` timed ones, each of fresh random prompts (``--input-len`` ids below the
vocabulary size, seeded; fresh so that no prefix-cache hit shortens a prefill), every request
generating exactly ``--output-len`` tokens (``ignore_eos``). Per request, from its
``RequestOutput.metrics``: TTFT = first token time - arrival time, TPOT = (last token time -
first token time) / (output tokens - 1); per batch, its wall time. Reported: p50 and p90 of each
(``percentile``: linear interpolation, numpy's default).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field

from nanovllm.bench.json_out import run_meta, write_json
from nanovllm.bench.serve import percentile

DEFAULT_BATCH_SIZES = (1, 8)
DEFAULT_INPUT_LEN = 32
DEFAULT_OUTPUT_LEN = 128


@dataclass
class LatencyResult:
    batch_size: int
    ttft: list[float] = field(default_factory=list)  # seconds, one per request
    tpot: list[float] = field(default_factory=list)  # seconds, one per request with >= 2 tokens
    batch_seconds: list[float] = field(default_factory=list)
    output_tokens: int = 0

    def summary(self) -> dict:
        out: dict[str, object] = {
            "batch_size": self.batch_size,
            "requests": len(self.ttft),
            "batches": len(self.batch_seconds),
            "output_tokens_per_s": self.output_tokens / sum(self.batch_seconds),
        }
        for name, xs in (("ttft_ms", self.ttft), ("tpot_ms", self.tpot), ("batch_ms", self.batch_seconds)):
            out[name] = {f"p{p}": percentile(xs, p) * 1e3 if xs else None for p in (50, 90)}
        return out


def request_latencies(out) -> tuple[float, float | None]:
    """(TTFT, TPOT) of one finished RequestOutput, in seconds (TPOT None for one token)."""
    m = out.metrics
    if m is None or m.first_token_time is None or m.last_token_time is None:
        raise RuntimeError(f"request {out.request_id}: no token times in its metrics")
    n = len(out.outputs[0].token_ids)
    tpot = (m.last_token_time - m.first_token_time) / (n - 1) if n > 1 else None
    return m.first_token_time - m.arrival_time, tpot


def measure_batch_size(
    llm,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters: int,
    num_warmup: int,
    vocab_size: int,
    seed: int = 0,
) -> LatencyResult:
    from nanovllm import SamplingParams

    rng = random.Random(seed * 1000 + batch_size)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    result = LatencyResult(batch_size)
    for i in range(num_warmup + num_iters):
        prompts = [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(batch_size)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        if i < num_warmup:
            continue
        result.batch_seconds.append(elapsed)
        for out in outs:
            ttft, tpot = request_latencies(out)
            result.ttft.append(ttft)
            if tpot is not None:
                result.tpot.append(tpot)
            result.output_tokens += len(out.outputs[0].token_ids)
    return result


def run_latency(args: argparse.Namespace) -> int:
    from nanovllm import LLM
    from nanovllm.bench.lengths import check_fits, max_model_len
    from nanovllm.entrypoints.args import engine_kwargs
    from nanovllm.loader.model_loader import resolve_model_dir

    sizes = args.batch_size or list(DEFAULT_BATCH_SIZES)
    input_len = args.input_len or DEFAULT_INPUT_LEN
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    eargs = engine_kwargs(args)
    # before the weights load: a batch that does not fit would fail (or time fewer tokens) after it
    limit = max_model_len(resolve_model_dir(args.model), eargs)
    check_fits(limit, input_len, output_len, f"--input-len {input_len} --output-len {output_len}")
    llm = LLM(args.model, **eargs)
    try:
        vocab_size = llm.llm_engine.vocab_size
        device = llm.llm_engine.config.device
        print(
            f"latency: batch sizes {sizes}, input {input_len} tokens, output {output_len} tokens, "
            f"{args.num_iters} timed batches each (+{args.num_iters_warmup} warm-up); "
            f"model {args.model or 'default'}, {device}",
            file=sys.stderr,
        )
        results = [
            measure_batch_size(llm, b, input_len, output_len, args.num_iters, args.num_iters_warmup, vocab_size)
            for b in sizes
        ]
    finally:
        llm.close()
    print_table([r.summary() for r in results])
    if args.json_out:
        write_json(
            args.json_out,
            {
                "meta": run_meta("latency", eargs, str(device)),
                "input_len": input_len,
                "output_len": output_len,
                "results": [r.summary() for r in results],
            },
        )
    return 0


def print_table(sums: list[dict]) -> None:
    def ms(x):
        return "n/a" if x is None else f"{x:,.1f}"

    print("\n| batch | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) | TPOT p90 (ms) | batch p50 (ms) | output tok/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s in sums:
        print(
            f"| {s['batch_size']} | {ms(s['ttft_ms']['p50'])} | {ms(s['ttft_ms']['p90'])} | "
            f"{ms(s['tpot_ms']['p50'])} | {ms(s['tpot_ms']['p90'])} | {ms(s['batch_ms']['p50'])} | "
            f"{s['output_tokens_per_s']:,.1f} |"
        )
