"""An HTTP server in a subprocess, for tests and ``nanovllm bench serve``: started on 127.0.0.1
on a free port, ready once ``/health`` answers 200, stopped (SIGTERM, then SIGKILL) on exit.

On Linux the child also gets SIGTERM if this process dies first (PR_SET_PDEATHSIG), so a killed
test run or benchmark leaves no server behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def nanovllm_serve_command(model: str | None, *args: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "nanovllm.entrypoints.cli", "serve", *([model] if model else []), *args]


@contextlib.contextmanager
def server(
    cmd: list[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    env: dict | None = None,
    ready_timeout: float = 300.0,
    headers: dict | None = None,
    keep_log: str | None = None,
) -> Iterator[str]:
    """Run ``cmd --host HOST --port PORT``; yield its base URL once healthy. The server's output
    goes to a temporary log file, whose end is shown if it fails to start; ``keep_log`` is a path
    to copy it to once the server has stopped."""
    port = port or free_port(host)
    log = tempfile.NamedTemporaryFile("w+", prefix="nanovllm-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [*cmd, "--host", host, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        preexec_fn=_die_with_parent,
    )
    url = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} before it was ready:\n{_tail(log.name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready after {ready_timeout:.0f} s:\n{_tail(log.name)}")
            try:
                req = urllib.request.Request(f"{url}/health", headers=headers or {})
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        log.close()
        if keep_log:
            shutil.copyfile(log.name, keep_log)
        os.unlink(log.name)


def _tail(path: str, n: int = 4000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]
