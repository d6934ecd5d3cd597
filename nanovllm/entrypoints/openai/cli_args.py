"""`nanovllm serve [MODEL] --host 127.0.0.1 --port 8000 [engine flags]`: its arguments and command.

Imports nothing heavy: the CLI's --help does not load torch or FastAPI.
"""

from __future__ import annotations

import argparse
import os

DEFAULT_SHUTDOWN_TIMEOUT_S = 5  # --shutdown-timeout: uvicorn's graceful timeout as this server has used it


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from nanovllm.entrypoints.cli import add_engine_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (streaming, /metrics)")
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct); same as --model",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000; 0: any free port)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("NANOVLLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $NANOVLLM_API_KEY; none: open)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) the API accepts (default: MODEL as given, or SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights (benchmarks of a model shape)",
    )
    p.add_argument(
        "--engine-process",
        dest="core_process",  # not engine_*: those are EngineConfig fields
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in its own process, so HTTP and text work never wait for the "
        "model's step loop (default); --no-engine-process runs it on a thread of the server",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="N",
        help="front-end processes (HTTP, JSON, text) sharing the port, over one engine core: more "
        "than 1 when one front end cannot keep up with the engine (a fast GPU, many streams)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="sampling defaults for fields a request leaves out: auto (default), the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens); vllm, the engine's own; or a folder's generation_config.json",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="sampling defaults over --generation-config's, e.g. '{\"temperature\": 0.5}' (the same keys)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGINT or SIGTERM, how long open requests may still run (default: 5); then each "
        "open stream ends with an error event and [DONE], and its request is stopped",
    )
    p.add_argument(
        "--metrics-prefix",
        default="nanovllm",
        choices=["nanovllm", "vllm"],
        help="name of /metrics' series: nanovllm (default), or vllm: the series vLLM also exposes get "
        "vLLM's names (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...), for dashboards, "
        "autoscalers and routers written for vLLM; the others keep nanovllm:",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a chat template (jinja2), by its file's path or as its text, used instead of the model's own "
        "for /v1/chat/completions and /tokenize (default: the model's)",
    )
    p.add_argument(
        "--allowed-origins",
        default="[]",
        metavar="JSON",
        help="origins a browser may call the server from (CORS), a JSON list such as "
        "'[\"https://app.example\"]' or '[\"*\"]' (default: [], none; vLLM's default is every origin)",
    )
    p.add_argument("--allowed-methods", default='["*"]', metavar="JSON", help='CORS: allowed methods (default: ["*"])')
    p.add_argument("--allowed-headers", default='["*"]', metavar="JSON", help='CORS: allowed headers (default: ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies) (default: off)")
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this key (default: HTTP)")
    p.add_argument(
        "--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS with this certificate (default: HTTP)"
    )
    p.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="leave out uvicorn's log line per request (default: logged)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level of uvicorn, the HTTP server (default: info)",
    )
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from nanovllm.entrypoints.cli import engine_kwargs
    from nanovllm.entrypoints.openai.api_server import serve

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree: give one")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_server_count > 1 and not args.core_process:
        raise ValueError(
            f"--api-server-count {args.api_server_count} needs the engine core in its own process: "
            "drop --no-engine-process"
        )
    # the flags first, then what they name (the model, the port), then the model loads: a bad
    # flag or a busy port stops the server at once, naming it, whatever the machine has installed
    from nanovllm.entrypoints.chat_template import load_chat_template
    from nanovllm.entrypoints.openai.generation_defaults import sampling_defaults
    from nanovllm.entrypoints.openai.http_options import http_options

    args.chat_template_text = load_chat_template(args.chat_template)
    args.http_options = http_options(args)
    from nanovllm.loader.model_loader import resolve_model_dir

    args.sampling_defaults = sampling_defaults(
        args.generation_config, args.override_generation_config, resolve_model_dir(args.model)
    )
    if args.api_server_count > 1:
        from nanovllm.entrypoints.openai.api_server_pool import serve_pool

        return serve_pool(args, engine_kwargs(args))
    from nanovllm.entrypoints.openai.server_socket import bind_socket

    sock = bind_socket(args.host, args.port, reuse_port=False)
    try:
        run_event_loop()(serve(args, engine_kwargs(args), sock))
    finally:
        sock.close()
    return 0


def run_event_loop():
    """``uvloop.run`` where uvloop is installed (the ``serve`` extra; vLLM's server runs on it
    too), else ``asyncio.run``: the server's front end spends its time in the event loop (HTTP,
    server-sent events), which uvloop runs faster. ``NANOVLLM_UVLOOP=0`` keeps asyncio's loop."""
    import asyncio
    import os

    if os.environ.get("NANOVLLM_UVLOOP", "1") == "0":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def served_names(args) -> list[str]:
    from nanovllm.loader.default_model import DEFAULT_MODEL_NAME

    if args.served_model_name:
        return list(args.served_model_name)
    return [args.model or DEFAULT_MODEL_NAME]
