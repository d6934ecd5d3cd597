"""Start an OpenAI-compatible server, run the suite against it through the openai adapter, stop it.

    python -m conformance.server --model-path golden:llama-mha-hd64 --port 8011 \\
        --serve "vllm serve {model} --host 127.0.0.1 --port {port} --dtype float32" \\
        -- --report docs/conformance/openai-vllm.md

``--model-path`` is a path, ``golden:NAME`` (the HF directory of a golden file's model, built on
first use) or ``golden-source:NAME`` (what the reference loaded: the GGUF file of the default
model). In the server command, ``{model}`` is replaced by that resolved path, ``{port}`` by
``--port`` and ``{python}`` by this Python interpreter (e.g. ``{python} -m nanovllm.serve``).

The server command runs in its own process group on this machine (bind it to 127.0.0.1); the
run waits for ``/v1/models`` to answer (``--ready-timeout``), sets CONFORMANCE_OPENAI_BASE_URL
and CONFORMANCE_OPENAI_MODEL_PATH, runs ``python -m conformance --engine openai ARGS``, and stops
the whole process group (SIGTERM, then SIGKILL) however the run ends. The server's output goes
to ``--log`` (by default a temporary file, removed after a run that passed and kept, with its
path printed, otherwise; its tail is printed when the server fails to start).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path


def wait_ready(base_url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base_url}/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{base_url}/models did not answer within {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


@contextmanager
def served(command: str, base_url: str, log: Path, ready_timeout: float = 600):
    argv = shlex.split(command)
    with open(log, "ab") as out:
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:  # no such program, not executable
            raise SystemExit(
                f"--serve: cannot start {argv[0]!r}: {e.strerror} (is it installed and on PATH?)"
            ) from None
    try:
        try:
            wait_ready(base_url, proc, ready_timeout)
        except (RuntimeError, TimeoutError) as e:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"{e}; server log tail ({log}):\n{tail}") from None
        yield proc
    finally:
        stop(proc)


def resolve_model(spec: str) -> str:
    """A local model path from a path, golden:NAME or golden-source:NAME."""
    kind, sep, name = spec.partition(":")
    if not sep or kind not in ("golden", "golden-source"):
        if not Path(spec).exists():
            raise SystemExit(
                f"--model-path {spec}: no such file or directory (a model directory, a .gguf, or golden:NAME)"
            )
        return spec
    import golden

    if name not in golden.NAMES:
        raise SystemExit(f"--model-path {spec}: {name!r} is not a golden model; known: {', '.join(golden.NAMES)}")
    g = golden.load(name)
    return golden.model_dir(g) if kind == "golden" else golden.source_path(g)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m conformance.server",
        description=__doc__,
        epilog="Arguments after -- go to python -m conformance.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--serve", required=True, help="the command that starts the server (one string)")
    ap.add_argument("--port", type=int, required=True, help="the port the command binds on 127.0.0.1")
    ap.add_argument(
        "--model-path",
        required=True,
        help="the local model the server runs: a path (HF directory or .gguf), golden:NAME or golden-source:NAME",
    )
    ap.add_argument("--model", help="the served model name (default: the first one /v1/models lists)")
    ap.add_argument("--server-kind", help="vllm | nanovllm | llama-cpp | generic (default: probed)")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--log", type=Path, help="server output (default: a temporary file)")
    args, rest = ap.parse_known_args(argv)
    rest = rest[1:] if rest[:1] == ["--"] else rest
    base_url = f"http://127.0.0.1:{args.port}/v1"
    argv = sys.argv[1:] if argv is None else list(argv)
    model = resolve_model(args.model_path)
    command = args.serve.format(model=model, port=args.port, python=sys.executable)
    env = dict(
        os.environ,
        CONFORMANCE_OPENAI_BASE_URL=base_url,
        CONFORMANCE_OPENAI_MODEL_PATH=model,
        # the report's command line: this one, which starts the server too
        CONFORMANCE_COMMAND=shlex.join(["python", "-m", "conformance.server", *argv]),
    )
    if args.model:
        env["CONFORMANCE_OPENAI_MODEL"] = args.model
    if args.server_kind:
        env["CONFORMANCE_OPENAI_SERVER"] = args.server_kind
    log = args.log or Path(tempfile.mkstemp(prefix="conformance-server-", suffix=".log")[1])
    print(f"starting: {command}", flush=True)
    status = 1
    try:
        with served(command, base_url, log, args.ready_timeout):
            print(f"server ready at {base_url}", flush=True)
            run = [sys.executable, "-m", "conformance", "--engine", "openai", *rest]
            status = subprocess.run(run, env=env).returncode
    finally:
        if args.log is None and status == 0:
            log.unlink(missing_ok=True)
        else:
            print(f"server log: {log}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
