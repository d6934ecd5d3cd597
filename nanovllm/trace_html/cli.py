"""``nanovllm trace --html run.html [prompts] [sampling and engine flags]``: run prompts with the
engine's tracer on and write the run as a self-contained HTML page (and/or its JSON).

Without prompts it runs experiment 04's workload (shared prefix, chunked prefill, a KV cache
small enough to preempt) on experiment 04's engine settings, unless flags override them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompt strings (none: experiment 04's demo workload)")
    parser.add_argument("--prompts-file", help="a file with one prompt per line")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    parser.add_argument("--html", metavar="FILE", help="write the trace viewer page here")
    parser.add_argument("--json", metavar="FILE", dest="json_out", help="write the trace document (JSON) here")
    parser.add_argument(
        "--print",
        action="store_true",
        dest="print_steps",
        help="also print each step as `generate --trace` does (stderr)",
    )
    parser.add_argument("--title", default=None, help="the page's title")


def _prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise FileNotFoundError(f"--prompts-file {args.prompts_file!r}: {e.strerror}") from None
    return prompts


def check_output(flag: str, path: str) -> None:
    """Refuse an output path that cannot be written before the run, not after it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder; give a file name")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path!r}: not writable")


def _print_event(event) -> None:
    print(event.format(), file=sys.stderr, flush=True)


def cmd_trace(args: argparse.Namespace, engine_args: dict, params) -> int:
    """``params``: the SamplingParams from the sampling flags (used for given prompts)."""
    from nanovllm.llm import LLM
    from nanovllm.sampling_params import SamplingParams
    from nanovllm.trace_html import trace_document, write_html

    if not args.html and not args.json_out:
        raise ValueError("nanovllm trace needs --html FILE and/or --json FILE (where to write the trace)")
    for flag, path in (("--html", args.html), ("--json", args.json_out)):
        if path:
            check_output(flag, path)
    prompts = _prompts(args)
    demo = not prompts
    if demo:
        from nanovllm.experiments import e04_scheduler_watch as e04

        shape = e04.SHAPES["cpu"]
        engine_args = {**e04.engine_args(shape), **engine_args}
    llm = LLM(args.model, trace=_print_event if args.print_steps else True, **engine_args)
    try:
        if demo:
            prompts = e04.prompts(shape, llm.llm_engine.vocab_size)  # type: ignore[assignment]
            params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in shape.max_tokens]
            outs = llm.generate(prompts, params, use_tqdm=False)
        elif args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.llm_engine
        title = args.title or ("nanovllm trace: experiment 04's workload" if demo else "nanovllm trace")
        doc = trace_document(
            engine.tracer.events, engine, outs, title=title, command=" ".join(["nanovllm"] + sys.argv[1:])
        )
    finally:
        llm.close()
    steps = doc["steps"]
    print(
        f"{len(steps)} steps, {len(doc['requests'])} requests, "
        f"{sum(len(s['preempted']) for s in steps)} preemptions, "
        f"{sum(1 for s in steps for q in s['seqs'] if q['num_cached_tokens'])} prefix-cache hits"
    )
    if args.html:
        print(f"wrote {write_html(args.html, doc)}")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json_out}")
    return 0
