"""`nanovllm serve` stopped with SIGTERM (what a process manager or ``docker stop`` sends) shuts
its engine down before it exits: the engine core is told to stop, stops, and is gone; the exit
status is 143, as a shell reports for SIGTERM. (uvicorn raises the signal again after its own
graceful shutdown; with the default handler that ended the process before the engine's shutdown,
and the core only left later, on a closed pipe.)
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request

import httpx
import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")

from conformance.zoo import zoo_model  # noqa: E402
from nanovllm.bench.serve import core_busy_period  # noqa: E402
from nanovllm.bench.server_process import free_port, nanovllm_serve_command  # noqa: E402

MODEL = "qwen3-gqa2-hd64-tied"


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{open(log_path).read()[-3000:]}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"the server was not healthy in {timeout_s:.0f} s:\n{open(log_path).read()[-3000:]}")


def start_server(log, port: int, flags: list[str], env: dict | None = None, new_session: bool = False):
    """`nanovllm serve` of the zoo model with ``flags`` on 127.0.0.1:``port``, logging at INFO to
    ``log``; one OpenMP thread; in a session (process group) of its own if ``new_session``."""
    cmd = nanovllm_serve_command(zoo_model(MODEL), *flags, "--log-level", "INFO")
    return subprocess.Popen(
        [*cmd, "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        start_new_session=new_session,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_stops_the_engine_core_before_the_server_exits():
    port = free_port("127.0.0.1")
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = start_server(log, port, ["--max-model-len", "256", "--num-kvcache-blocks", "64"])
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{port}", log.name)
            sent = time.time()
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True},
                timeout=60,
            )
            answered = time.time()
            assert r.status_code == 200, r.text
            proc.send_signal(signal.SIGTERM)
            status = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = open(log.name).read()
        busy = core_busy_period(log.name)  # as `bench serve` reads it from a kept log
    core = re.search(r"engine core ready in process (\d+)", text)
    assert core, f"the server did not log its engine core's pid:\n{text[-3000:]}"
    assert status == 128 + signal.SIGTERM, f"exit status {status}:\n{text[-3000:]}"
    assert "engine core: " in text, f"the engine core did not log its stop:\n{text[-3000:]}"
    # its busy period in Unix time lies inside the request's send and answer
    assert busy is not None and sent <= busy[0] <= busy[1] <= answered, (sent, busy, answered, text[-3000:])
    assert "closed the pipe" not in text, f"the engine core was not told to stop; it left on a closed pipe:\n{text}"
    assert not _alive(int(core.group(1))), "the engine core outlived the server"
    # the serve extra's event loop: uvloop where it is installed, asyncio's otherwise
    want = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    assert re.search(rf"event loop: {want}\b", text), f"not on {want}'s event loop:\n{text[-3000:]}"


@pytest.mark.parametrize("api_servers", [1, 2])
def test_sigterm_to_the_whole_process_group_lets_open_streams_finish(api_servers):
    """A process manager that signals every process of the server (systemd's default, `timeout`,
    a test harness's killpg) must not stop the engine core ahead of its front ends: the core
    ignores SIGTERM and leaves when its front end stops it, so a stream open at the signal ends
    with all its tokens within uvicorn's graceful shutdown, and nothing is left running."""
    port = free_port("127.0.0.1")
    flags = ["--max-model-len", "256", "--num-kvcache-blocks", "64", "--api-server-count", str(api_servers)]
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = start_server(log, port, flags, new_session=True)  # its own process group, signalled below
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{port}", log.name)
            body = {"prompt": [5, 6, 7], "max_tokens": 48, "ignore_eos": True, "stream": True, "temperature": 0}
            chunks, done = 0, False
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if chunks == 1:
                            os.killpg(proc.pid, signal.SIGTERM)
                        last = line
                    done = done or line == "data: [DONE]"
            status = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        text = open(log.name).read()
    assert done and '"finish_reason": "length"' in last, f"the stream was cut after {chunks} chunks:\n{text[-3000:]}"
    assert "the engine core failed" not in text, text[-3000:]
    assert status == 128 + signal.SIGTERM, f"exit status {status}:\n{text[-3000:]}"
    core = re.search(r"engine core ready in process (\d+)", text)
    assert core and not _alive(int(core.group(1))), "the engine core outlived the server"


def _wait_running(base: str, n: int, timeout_s: float = 30.0) -> None:
    """Until the engine runs ``n`` requests (its /metrics gauge)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"^nanovllm:num_requests_running\{[^}]*\} (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
        if found and float(found.group(1)) >= n:
            return
        time.sleep(0.05)
    raise TimeoutError(f"the engine did not run {n} requests in {timeout_s:.0f} s")


@pytest.mark.parametrize("api_servers", [1, 2])
def test_requests_still_running_when_the_grace_period_ends_get_an_answer(api_servers):
    """Ctrl-C while a stream and a plain request run past --shutdown-timeout (0 here: at once):
    the stream ends with an error event and [DONE], the plain request gets a 503, both naming
    the shutdown; the server logs no traceback, exits with 130, and its engine core is gone.
    (Before, uvicorn cancelled them: the stream was cut mid-answer and a traceback logged.)"""
    port = free_port("127.0.0.1")
    flags = ["--max-model-len", "4096", "--num-kvcache-blocks", "600", "--shutdown-timeout", "0"]
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        proc = start_server(log, port, [*flags, "--api-server-count", str(api_servers)])
        try:
            _wait_healthy(proc, f"http://127.0.0.1:{port}", log.name)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                plain = pool.submit(httpx.post, url, json=body, timeout=60)
                lines: list[str] = []
                with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
                    for line in r.iter_lines():
                        if not line:
                            continue
                        lines.append(line)
                        if len(lines) == 1:  # once: a second Ctrl-C is uvicorn's "force quit"
                            _wait_running(f"http://127.0.0.1:{port}", 2)  # the plain request too
                            os.kill(proc.pid, signal.SIGINT)
                answer = plain.result()
            status = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = open(log.name).read()
    assert lines[-1] == "data: [DONE]", f"the stream was cut:\n{lines[-3:]}\n{text[-3000:]}"
    last = json.loads(lines[-2][len("data: ") :])
    assert "shutting down" in last["error"]["message"], lines[-2]
    assert len(lines) - 2 < 4000, "the stream ran to its end: nothing was stopped"
    assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"], answer.text
    assert "Traceback" not in text, text[-3000:]
    assert status == 128 + signal.SIGINT, f"exit status {status}:\n{text[-3000:]}"
    core = re.search(r"engine core ready in process (\d+)", text)
    assert core and not _alive(int(core.group(1))), "the engine core outlived the server"
