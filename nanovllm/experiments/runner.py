"""``nanovllm experiment NN [engine flags]``: pick the shape, load the engine, run, report.

The shape is the experiment's "gpu" one when the engine will run on CUDA, else its "cpu" one
(``--shape`` overrides). Engine flags override the experiment's own engine settings, except
the ones it sweeps (SWEPT), which it must set itself.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from nanovllm.experiments import MODULES, load
from nanovllm.experiments.report import Report

DEFAULT_OUT = "nanovllm-experiments"


def target_device(engine_args: dict) -> str:
    device = engine_args.get("device") or "auto"
    if device == "auto":
        device = os.environ.get("NANOVLLM_DEVICE", "auto") or "auto"
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def run_experiment(
    key,
    *,
    model: str | None = None,
    shape="auto",
    out_dir: str | os.PathLike = DEFAULT_OUT,
    engine_args: dict | None = None,
    echo=print,
) -> Report:
    """Run one experiment; ``shape``: "auto", "cpu", "gpu" or a Shape instance of that experiment.
    Returns its Report (files written, result lines)."""
    from nanovllm.llm import LLM

    exp = load(key)
    engine_args = dict(engine_args or {})
    clash = sorted(set(engine_args) & set(exp.SWEPT))
    if clash:
        raise ValueError(
            f"experiment {exp.NUMBER} ({exp.NAME}) sweeps {', '.join(clash)} itself; "
            f"leave --{clash[0].replace('_', '-')} out"
        )
    if isinstance(shape, str):
        if shape not in ("auto", "cpu", "gpu"):
            raise ValueError(f"shape must be 'auto', 'cpu' or 'gpu', got {shape!r}")
        shape_name = ("gpu" if target_device(engine_args) == "cuda" else "cpu") if shape == "auto" else shape
        shape_obj = exp.SHAPES[shape_name]
    elif isinstance(shape, exp.Shape):
        shape_name, shape_obj = "custom", shape
    else:
        raise TypeError(f"shape must be a name or a {exp.__name__}.Shape, got {type(shape).__name__}")
    args = {**exp.engine_args(shape_obj), **engine_args}
    report = Report(Path(out_dir) / f"{exp.NUMBER}-{exp.NAME}", echo)
    report.header(exp.NUMBER, exp.TITLE, exp.LOOK_FOR, f"shape {shape_name}: {shape_obj}")
    start = time.perf_counter()
    llm = LLM(model, trace=True, **args)
    load_s = time.perf_counter() - start
    try:
        cfg = llm.llm_engine.config
        import torch

        echo(
            f"   engine: {cfg.model or 'default model (SmolLM2-135M-Instruct)'} on {cfg.device} {cfg.dtype}, "
            f"block_size {cfg.block_size}, {llm.llm_engine.block_manager.num_blocks} KV blocks, "
            f"max_num_seqs {cfg.max_num_seqs}, max_num_batched_tokens {cfg.max_num_batched_tokens}, "
            f"{torch.get_num_threads()} CPU threads; loaded in {load_s:.1f} s"
        )
        exp.run(llm, shape_obj, report)
    finally:
        llm.close()
    wall = time.perf_counter() - start
    echo(f"   wall time {wall:.1f} s (model load {load_s:.1f} s)")
    report.write_text(
        "results.json",
        json.dumps(
            {
                "experiment": exp.NUMBER,
                "name": exp.NAME,
                "shape": shape_name,
                "shape_values": repr(shape_obj),
                "engine_args": args,
                "device": cfg.device,
                "results": report.results,
                "wall_s": round(wall, 2),
                "load_s": round(load_s, 2),
            },
            indent=1,
            default=str,
        ),
    )
    return report


def add_experiment_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", help=f"an experiment number ({', '.join(MODULES)}), its name, 'all', or 'list'")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help=f"output folder, one subfolder per experiment (default: {DEFAULT_OUT}/)"
    )
    parser.add_argument(
        "--shape",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="workload size: auto = gpu on CUDA, else cpu (default: auto)",
    )


def cmd_experiment(args: argparse.Namespace, engine_args: dict) -> int:
    if args.experiment == "list":
        for number in MODULES:
            exp = load(number)
            print(f"{exp.NUMBER}  {exp.NAME:<16} {exp.TITLE}")
        return 0
    keys = list(MODULES) if args.experiment == "all" else [args.experiment]
    for key in keys:
        run_experiment(key, model=args.model, shape=args.shape, out_dir=args.out, engine_args=engine_args)
    return 0
