"""`nanovllm bench`: one workload, nanovllm and its peers in the same run, a table of ratios."""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import statistics
import sys

import torch

from nanovllm.bench import peers
from nanovllm.bench.roofline import roofline
from nanovllm.bench.args import PEERS, add_bench_args  # noqa: F401  (re-exported)
from nanovllm.bench.workloads import SHAPES, cpu_workload, gpu_workload, shape_config_dir

logger = logging.getLogger(__name__)


def run_bench(args: argparse.Namespace) -> int:
    from nanovllm.entrypoints.args import engine_kwargs
    from nanovllm.loader.model_loader import resolve_model_dir

    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    kind = args.workload
    if kind == "auto":
        kind = "gpu" if torch.cuda.is_available() else "cpu"
    w = gpu_workload() if kind == "gpu" else cpu_workload()
    w.check_totals()
    eargs = engine_kwargs(args)
    if kind == "gpu":
        model_dir = args.model or shape_config_dir(args.shape)
        load_format = "auto" if args.model else "dummy"
        eargs.setdefault("max_model_len", 4096)
        device, dtype = "cuda", torch.bfloat16
    else:
        model_dir = resolve_model_dir(args.model)
        load_format = "auto"
        eargs.setdefault("dtype", "float32")
        device, dtype = "cpu", torch.float32
    print(f"workload {w.name}: {len(w.prompts)} requests, {w.num_prompt_tokens} prompt tokens, "
          f"{w.num_output_tokens} output tokens; model {args.model or (args.shape if kind == 'gpu' else 'default')}",
          file=sys.stderr)

    results: list[peers.Measurement] = []
    runs = []
    for i in range(args.repeat):
        ms = peers.run_nanovllm(w, model_dir, eargs, load_format, warm_repeat=args.warm and i == 0,
                                profile=args.profile_steps and i == 0)
        runs.append(ms[0])
        results += ms[1:]
        print(f"  nanovllm run {i + 1}: {ms[0].tokens_per_s:.1f} tok/s", file=sys.stderr)
    median_s = statistics.median(m.seconds for m in runs)
    ours = peers.Measurement("nanovllm", runs[0].output_tokens, median_s,
                             f"median of {len(runs)}" if len(runs) > 1 else "")
    results.insert(0, ours)

    random_weights = load_format == "dummy"
    for peer in args.peer:
        try:
            if peer == "hf":
                results.append(peers.run_hf_generate(w, model_dir, device, dtype, random_weights))
            elif peer == "hf-cb":
                results.append(peers.run_hf_continuous_batching(w, model_dir, device, dtype, random_weights))
            elif peer == "vllm":
                python = peers.find_vllm_python(args.vllm_python)
                if python is None:
                    print("  vllm: skipped (no vLLM virtual env found; pass --vllm-python)", file=sys.stderr)
                    continue
                results += peers.run_vllm(w, model_dir, python, dtype=str(dtype).removeprefix("torch."))
        except Exception as e:  # a failing peer is reported, not fatal to the table
            print(f"  {peer}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        print(f"  {results[-1].engine}: {results[-1].tokens_per_s:.1f} tok/s", file=sys.stderr)

    limit = None
    if kind == "gpu":
        shape = SHAPES[args.shape] if not args.model else None
        if shape is not None:
            limit = roofline(w, shape, tp=eargs.get("tensor_parallel_size", 1))
    print_table(w, results, ours, limit)
    if args.json_out:
        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                "device": torch.cuda.get_device_name() if kind == "gpu" else platform.processor() or "cpu",
                "workload": w.name, "engine_args": eargs, "argv": sys.argv}
        rows = [{"engine": m.engine, "output_tokens": m.output_tokens, "seconds": m.seconds,
                 "tokens_per_s": m.tokens_per_s, "note": m.note} for m in results]
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "results": rows,
                       "roofline_tokens_per_s": limit.output_tokens_per_s if limit else None}, f, indent=1)
    return 0


def print_table(w, results, ours, limit) -> None:
    print(f"\n| engine | output tok/s | seconds | nanovllm / engine |")
    print("| --- | ---: | ---: | ---: |")
    for m in results:
        ratio = f"{ours.tokens_per_s / m.tokens_per_s:.2f}x" if m.output_tokens else "n/a (no tokens)"
        print(f"| {m.engine} | {m.tokens_per_s:,.1f} | {m.seconds:.2f} | {ratio} |")
    if limit is not None:
        print(f"\nroofline: {limit.describe()}")
        print(f"nanovllm reaches {ours.tokens_per_s / limit.output_tokens_per_s:.1%} of the physical limit")
