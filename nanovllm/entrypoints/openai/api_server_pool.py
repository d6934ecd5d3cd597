"""`nanovllm serve --api-server-count N`: N front-end processes on one listening socket, one
engine core (vLLM's ``--api-server-count``).

One front end (HTTP, JSON, detokenization, metrics) saturates its interpreter before a fast GPU
runs out of work: on an H200 the server's process was 89-96 % busy while serving 80-93 % of the
offline throughput. With N front ends the kernel hands each new connection to one of them; each
has its own pipe to the engine core, which routes every request's updates back to the pipe that
added it (``engine/core_process.py``).

Each front end listens on a socket of its own, bound to the same address with ``SO_REUSEPORT``
(Linux), and the kernel spreads new connections over them by their address hash. With one shared
listening socket the front end that happened to be waiting took a whole burst of connections (24
of 24 in a test) while the other idled. Elsewhere the front ends share this process's socket.

    this process       binds the socket (it listens once a front end serves it), starts the
                       engine core, hands each front end the socket and its pipe, then waits:
                       when a front end or the core exits, or on SIGINT / SIGTERM, it stops
                       them all (front ends first, so their requests end cleanly) and exits
    front end i        uvicorn + the FastAPI app over a ProcessAsyncLLM on its own pipe
                       (``AttachedCoreClient``); leaves if this process dies (``lifeline``)
    engine core        as with one front end; its control pipe is this process's

/metrics answers the same on every front end: the per-request series are Prometheus
multiprocess files in a directory of this run (``PROMETHEUS_MULTIPROC_DIR``, set here for the
children, removed at exit), and ``process_cpu_seconds_total`` sums the front ends' CPU time.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import wait

from nanovllm.entrypoints.openai.cli_args import DEFAULT_SHUTDOWN_TIMEOUT_S
from nanovllm.entrypoints.openai.http_options import scheme, uvicorn_options
from nanovllm.entrypoints.openai.server_socket import REUSE_PORT, bind_socket

logger = logging.getLogger(__name__)
_STOP_MARGIN_S = 10.0  # a front end's own stop after its --shutdown-timeout


def serve_pool(args, engine_kwargs: dict) -> int:
    """Serve with ``args.api_server_count`` front ends until a signal or a process's exit; the
    exit status: 128 + the signal, or 1 when a front end or the core ended on its own."""
    from nanovllm.engine.core_client import EngineCoreClient
    from nanovllm.entrypoints.openai.metrics import FRONT_END_PIDS_FILE

    count = args.api_server_count
    sock = bind_socket(args.host, args.port)
    metrics_dir = tempfile.mkdtemp(prefix="nanovllm-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # the children's prometheus_client reads it at import
    previous = {s: signal.signal(s, _raise_exit) for s in (signal.SIGTERM, signal.SIGINT)}
    client = None
    front_ends: list = []
    status = 1
    try:
        client = EngineCoreClient(
            args.model, {"load_format": getattr(args, "load_format", "auto"), **engine_kwargs}, front_ends=count
        )
        ctx = mp.get_context("spawn")
        settings = _front_end_settings(args, metrics_dir, sock)
        for i, conn in enumerate(client.front_end_conns):
            p = ctx.Process(
                target=run_front_end,
                name=f"nanovllm-api-server-{i}",
                args=(i, None if REUSE_PORT else sock, conn, client.process.pid, os.getpid(), settings),
            )
            p.start()
            front_ends.append(p)
        for conn in client.front_end_conns:  # the front ends hold them now: a closed one reads as EOF in the core
            conn.close()
        with open(os.path.join(metrics_dir, FRONT_END_PIDS_FILE), "w") as f:
            f.write("".join(f"{p.pid}\n" for p in front_ends))
        logger.info(
            "%d API server processes (%s) on %s://%s:%d; metrics in %s",
            count,
            ", ".join(str(p.pid) for p in front_ends),
            scheme(getattr(args, "http_options", None)),
            *sock.getsockname()[:2],
            metrics_dir,
        )
        listening = _wait_listening(args.host, sock.getsockname()[1], [*front_ends, client.process])
        if listening and args.uvicorn_log_level in ("info", "debug", "trace"):  # uvicorn's own line,
            # which it leaves out when given sockets: where the server listens
            print(
                f"INFO:     nanovllm serve running on {scheme(getattr(args, 'http_options', None))}://{args.host}:{sock.getsockname()[1]} with {count} API "
                "server processes (Press CTRL+C to quit)",
                file=sys.stderr,
                flush=True,
            )
        sentinels = {p.sentinel: f"API server {i} (pid {p.pid})" for i, p in enumerate(front_ends)}
        sentinels[client.process.sentinel] = f"the engine core (pid {client.process.pid})"
        ended = wait(list(sentinels))
        for s in ended:
            logger.error("%s exited on its own; stopping the server", sentinels[s])
    except _Exit as e:
        status = 128 + e.signum
        logger.info("signal %d: stopping %d API server processes and the engine core", e.signum, len(front_ends))
    finally:
        for s in previous:  # a second Ctrl-C or SIGTERM waits for the stop too
            signal.signal(s, _already_stopping)
        _stop_front_ends(front_ends, getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S) + _STOP_MARGIN_S)
        if client is not None:
            client.shutdown()
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status


class _Exit(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_exit(signum, frame) -> None:
    raise _Exit(signum)


def _already_stopping(signum, frame) -> None:
    logger.info("signal %d: already stopping", signum)


def _wait_listening(host: str, port: int, processes: list, timeout_s: float = 120.0) -> bool:
    """Wait until a front end accepts connections on the port (True), or a process exits or the
    time runs out (False)."""
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(p.is_alive() for p in processes):
        try:
            socket.create_connection((target, port), timeout=1.0).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def _stop_front_ends(front_ends: list, timeout_s: float) -> None:
    """SIGTERM to each (uvicorn's graceful shutdown: open requests run for --shutdown-timeout,
    then are stopped), then wait up to ``timeout_s``; SIGKILL what is left."""
    for p in front_ends:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s  # one grace period for all of them, stopping at once
    for p in front_ends:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            logger.warning("API server pid %d did not stop in %.0f s; killing it", p.pid, timeout_s)
            p.kill()
            p.join()


def _front_end_settings(args, metrics_dir: str, sock: socket.socket) -> dict:
    from nanovllm.entrypoints.openai.cli_args import served_names

    return {
        "served_model_names": served_names(args),
        "api_key": args.api_key,
        "sampling_defaults": getattr(args, "sampling_defaults", None),
        "metrics_prefix": getattr(args, "metrics_prefix", "nanovllm"),
        "chat_template": getattr(args, "chat_template_text", None),
        "http_options": getattr(args, "http_options", None),
        "uvicorn_log_level": args.uvicorn_log_level,
        "shutdown_timeout": getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S),
        "log_level": logging.getLogger().getEffectiveLevel(),
        "metrics_dir": metrics_dir,
        "address": sock.getsockname()[:2],  # port 0 given: the one this process's socket got
    }


def run_front_end(index: int, sock: socket.socket | None, conn, core_pid: int, parent_pid: int, settings: dict) -> None:
    """A front-end process's main (a ``spawn`` target); ``sock``: the socket shared by all front
    ends, or None to bind one of its own to ``settings["address"]`` (``SO_REUSEPORT``)."""
    from nanovllm.engine.lifeline import watch_parent
    from nanovllm.entrypoints.openai.cli_args import run_event_loop

    logging.basicConfig(level=settings["log_level"], format=f"%(levelname)s api-server-{index} %(name)s: %(message)s")
    watch_parent(parent_pid)
    if sock is None:
        host, port = settings["address"]
        sock = bind_socket(host, port, check_free=False)  # the main process checked the port
    try:
        run_event_loop()(_serve_front_end(sock, conn, core_pid, settings))
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it stopped on again; it is done
        pass


async def _serve_front_end(sock: socket.socket, conn, core_pid: int, settings: dict) -> None:
    import uvicorn

    from nanovllm.engine.async_llm_process import ProcessAsyncLLM
    from nanovllm.engine.core_client import AttachedCoreClient
    from nanovllm.entrypoints.openai.api_server import _exit_on_sigterm, build_app

    engine = ProcessAsyncLLM(AttachedCoreClient(conn, core_pid))
    # read the core's messages from the start: a front end that has served nothing yet still
    # gets the engine's stats (its /metrics), and its pipe never fills with them
    engine._start()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        app = build_app(
            engine,
            settings["served_model_names"],
            api_key=settings["api_key"],
            metrics_dir=settings["metrics_dir"],
            sampling_defaults=settings["sampling_defaults"],
            metrics_prefix=settings["metrics_prefix"],
            chat_template=settings["chat_template"],
            http_options=settings["http_options"],
        )
        config = uvicorn.Config(
            app,
            log_level=settings["uvicorn_log_level"],
            timeout_graceful_shutdown=settings["shutdown_timeout"],
            **uvicorn_options(settings["http_options"]),
        )
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        engine.shutdown()
        signal.signal(signal.SIGTERM, previous)
