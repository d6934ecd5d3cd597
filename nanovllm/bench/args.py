"""`nanovllm bench`'s flags, and its subcommands `bench serve` and `bench latency` (torch-free,
so the CLI's --help loads no torch). Engine flags are added by the CLI
(``nanovllm/entrypoints/args.py``); nothing here imports the CLI module."""

from __future__ import annotations

import argparse

from nanovllm.bench.datasets import NAMED
from nanovllm.bench.workloads import SHAPES
from nanovllm.entrypoints.args import add_engine_args

PEERS = ("hf", "hf-cb", "vllm")
SELF_PEER = "nanovllm:"  # nanovllm:KEY=VALUE,...: nanovllm with these engine arguments changed


def peer_name(text: str) -> str:
    """A --peer value: a known peer, or nanovllm:KEY=VALUE[,KEY=VALUE] (checked when it runs)."""
    if text in PEERS or (text.startswith(SELF_PEER) and "=" in text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: not one of {', '.join(PEERS)} and not nanovllm:KEY=VALUE (e.g. nanovllm:kv_cache_dtype=fp8)"
    )


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def add_length_args(p: argparse.ArgumentParser, input_default: str, output_default: str) -> None:
    p.add_argument(
        "--input-len",
        "--random-input-len",  # vLLM's name for the random dataset's
        type=positive_int,
        default=None,
        help=f"prompt length in tokens (random token ids) (default: {input_default})",
    )
    p.add_argument(
        "--output-len",
        "--random-output-len",
        type=positive_int,
        default=None,
        help=f"output tokens of every request (ignore_eos: exactly that many) (default: {output_default})",
    )


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dataset",
        "--workload",
        "--dataset-name",  # vLLM's name
        dest="dataset",
        default="auto",
        metavar="NAME|FILE.jsonl",
        help=f"the requests: {', '.join(NAMED)} (the standard cpu and gpu workloads; random: "
        "--num-prompts prompts of --input-len random ids; auto: random when --input-len is "
        "given, else gpu with CUDA, else cpu), or a JSONL file of requests, one per line: "
        '{"prompt": TEXT} or {"prompt_token_ids": [IDS]}, optional "max_tokens" (default: auto)',
    )
    p.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help="requests to run: the first N of the dataset, or N random prompts "
        "(default: all of the dataset; 32 for random)",
    )
    add_length_args(p, "128, --dataset random only", "the dataset's; 128 for random and JSONL lines without max_tokens")
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen3-0.6b",
        help="random-weight model shape for the gpu workload (default: qwen3-0.6b)",
    )
    p.add_argument(
        "--peer",
        action="append",
        type=peer_name,
        default=[],
        help="also run this peer on the same workload (repeatable): hf, hf-cb, vllm, or nanovllm:KEY=VALUE[,KEY=VALUE] "
        "(nanovllm itself with engine arguments changed, e.g. nanovllm:kv_cache_dtype=fp8; run --repeat times) "
        "(default: none)",
    )
    p.add_argument(
        "--repeat", type=positive_int, default=1, help="timed runs of nanovllm; the median is reported (default: 1)"
    )
    p.add_argument(
        "--peer-repeat",
        type=positive_int,
        default=1,
        help="timed runs of each hf, hf-cb and vllm peer (vLLM's cold runs each after a prefix-cache reset); "
        "the median is reported (default: 1)",
    )
    p.add_argument(
        "--warm", action="store_true", help="also time nanovllm on the same prompts again (prefix cache warm)"
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of a virtual env with vllm(-cpu) installed (default: $NANOVLLM_VLLM_PYTHON or ./.venv-vllm)",
    )
    p.add_argument(
        "--json-out", "--output-json", default=None, help="write the measurements as JSON here (default: none)"
    )
    p.add_argument(
        "--profile-steps",
        action="store_true",
        help="print where each engine step's time goes (the engine's step_profiler hook)",
    )


def add_bench_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-size",
        type=positive_int,
        action="append",
        default=None,
        help="requests per batch (repeatable) (default: 1 and 8)",
    )
    add_length_args(p, "32", "128")
    p.add_argument("--num-iters", type=positive_int, default=5, help="timed batches per batch size (default: 5)")
    p.add_argument(
        "--num-iters-warmup", type=non_negative_int, default=1, help="untimed batches per batch size first (default: 1)"
    )
    p.add_argument(
        "--json-out", "--output-json", default=None, help="write the measurements as JSON here (default: none)"
    )


def _run_latency(args: argparse.Namespace) -> int:
    from nanovllm.bench.latency import run_latency

    return run_latency(args)


def _run_serve(args: argparse.Namespace) -> int:
    # imported when the command runs: asyncio and the HTTP client cost every other command's start-up
    from nanovllm.bench.serve import run_bench_serve

    return run_bench_serve(args)


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        "--dataset",
        "--dataset-name",  # vLLM's name
        dest="workload",
        choices=("cpu", "gpu", "random"),
        default="cpu",
        help="the requests: the standard cpu or gpu workload, or random (--num-prompts prompts of --input-len "
        "random ids, --output-len tokens each) (default: cpu)",
    )
    p.add_argument(
        "--num-prompts", type=positive_int, default=None, help="requests (random: default 32; others: the first N)"
    )
    add_length_args(p, "128", "128")
    p.add_argument("--shape", default="qwen3-0.6b", help="random-weight model shape for the gpu workload")
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests per second (Poisson); inf: all at once"
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument(
        "--client-processes",
        type=positive_int,
        default=None,
        help="client processes sending the requests (each an event loop with its share of them, all starting "
        "together), so the client is not what limits the measurement (default: 1 on up to 4 CPUs, else "
        "min(4, CPUs / 4))",
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="benchmark this running server instead of starting one (random prompts: the vocabulary of "
        "the model it serves, read from its /v1/models root, or of --model)",
    )
    p.add_argument("--api-key", default=None, help="API key of the --base-url server")
    p.add_argument(
        "--peer", action="append", choices=("vllm",), default=[], help="also start and measure vllm serve (repeatable)"
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="python of vLLM's virtual env (default: $NANOVLLM_VLLM_PYTHON or ./.venv-vllm)",
    )
    p.add_argument("--vllm-arg", action="append", default=[], help="extra argument for vllm serve (repeatable)")
    p.add_argument(
        "--serve-variant",
        action="append",
        default=None,
        metavar="FLAGS",
        help="also start nanovllm serve with these extra flags and measure it as its own row, side by "
        "side (repeatable; e.g. --serve-variant=--no-engine-process)",
    )
    p.add_argument("--offline", action="store_true", help="also run the workload offline (LLM.generate)")
    p.add_argument(
        "--server-log-dir",
        default=None,
        help="keep each started server's log here, one file per row (nanovllm servers then log at INFO: the "
        "engine core says where its time went)",
    )
    p.add_argument("--json-out", default=None, help="write the measurements as JSON here")


def add_bench_subcommands(bench: argparse.ArgumentParser) -> None:
    """`nanovllm bench serve ...`, `nanovllm bench latency ...` and `nanovllm bench throughput ...`
    (vllm bench's name for the offline `nanovllm bench ...`, which it runs) beside it."""
    subs = bench.add_subparsers(dest="bench_command", required=False, metavar="{throughput,serve,latency}")
    p = subs.add_parser(
        "throughput",
        help="the offline throughput benchmark: the same as plain `nanovllm bench` (vllm bench's name)",
        description="Offline throughput (output tokens per second) of a workload, side by side with "
        "peers: the same run as `nanovllm bench` with the same flags.",
    )
    add_bench_args(p)
    add_engine_args(p)
    p.set_defaults(func=bench.get_default("func"))
    p = subs.add_parser("serve", help="serving benchmark over HTTP (TTFT, ITL, end-to-end; vs vllm serve)")
    add_bench_serve_args(p)
    add_engine_args(p)
    p.set_defaults(func=_run_serve)
    p = subs.add_parser(
        "latency",
        help="latency at batch 1 and 8: time to first token, time per output token",
        description="Time to first token and time per output token (p50, p90) of batches "
        "of random prompts, each batch run alone (vllm bench latency's knobs).",
    )
    add_bench_latency_args(p)
    add_engine_args(p)
    p.set_defaults(func=_run_latency)
