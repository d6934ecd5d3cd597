"""`nanovllm serve --api-server-count 2`: two front-end processes over one engine core answer as
one server. Greedy answers equal offline ``LLM.generate`` whichever front end took the
connection; both front ends take connections (``SO_REUSEPORT``); /metrics counts every front
end's requests on each of them, and a front end that has served nothing has the engine's stats;
a second server on the port is refused; SIGTERM (twice) stops the front ends and then the core,
and removes the metrics directory; a front end that dies stops the whole server (no process is
left behind).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import tempfile
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the serve extra (httpx) is not installed")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")

from conformance.zoo import ZOO, zoo_model  # noqa: E402
from nanovllm import SamplingParams  # noqa: E402
from nanovllm.bench.server_process import free_port  # noqa: E402
from nanovllm.entrypoints.cli import main  # noqa: E402
from nanovllm.entrypoints.openai.metrics import process_cpu_seconds, process_resident_bytes  # noqa: E402
from nanovllm.entrypoints.openai.server_socket import _bind  # noqa: E402
from tests.chat_templates import TURN_ENDS  # noqa: E402
from tests.conftest import cached_llm, prompts_for, zoo_serve_flags  # noqa: E402
from tests.test_serve_shutdown import MODEL, _alive, _wait_healthy, start_server  # noqa: E402

MAX_MODEL_LEN = 256
N_REQUESTS = 32


class Pool:
    """A `serve --api-server-count 2` subprocess with its log."""

    def __init__(self):
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        # greedy by the server's default (each front end must apply it: the requests leave temperature out)
        flags = [
            *zoo_serve_flags(MAX_MODEL_LEN),
            "--api-server-count",
            "2",
            "--override-generation-config",
            '{"temperature": 0}',
            "--metrics-prefix",  # each front end names the series as vLLM does, from the shared files too
            "vllm",
            "--chat-template",  # each front end renders chat prompts with the server's template
            TURN_ENDS,
            "--allowed-origins",  # and answers a browser's preflight from that origin
            '["https://app.example"]',
        ]
        self.proc = start_server(self.log, self.port, flags, env={"NANOVLLM_SERVER_DEV_MODE": "1"})
        _wait_healthy(self.proc, self.url, self.log.name)

    def text(self) -> str:
        return open(self.log.name).read()

    def pids(self) -> tuple[int, list[int], str]:
        """The engine core's pid, the front ends' pids and the metrics directory, from the log."""
        text = self.text()
        core = re.search(r"engine core ready in process (\d+)", text)
        fronts = re.search(r"2 API server processes \((\d+), (\d+)\) on \S+; metrics in (\S+)", text)
        assert core and fronts, f"the server did not log its processes:\n{text[-3000:]}"
        return int(core.group(1)), [int(fronts.group(1)), int(fronts.group(2))], fronts.group(3)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def pool():
    p = Pool()
    try:
        yield p
    finally:
        p.close()


async def _fresh(method: str, url: str, **kw) -> httpx.Response:
    """One request on a connection of its own (so the kernel picks the front end anew)."""
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.request(method, url, **kw)


async def _completion(url: str, prompt: list[int], stream: bool) -> str:
    body = {"model": "zoo", "prompt": prompt, "max_tokens": 10, "ignore_eos": True}  # greedy: the server's default
    if not stream:
        r = await _fresh("POST", f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    import json

    text = ""
    async with httpx.AsyncClient(timeout=60) as c:
        async with c.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
    return text


async def _front_ends(url: str, tries: int = 64) -> dict[int, dict]:
    """/debug/engine of each front end (by pid), asked on fresh connections until both answered."""
    seen: dict[int, dict] = {}
    for _ in range(tries):
        state = (await _fresh("GET", f"{url}/debug/engine")).json()  # checks the engine's invariants too
        seen[state["front_end_pid"]] = state
        if len(seen) == 2:
            break
    return seen


def _metric(text: str, name: str) -> float:
    found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return sum(float(v) for v in found)


def test_two_front_ends_answer_as_one_server_and_stop_on_sigterm(pool):
    vocab = ZOO[MODEL].vocab_size
    prompts = prompts_for(vocab, [3 + (i * 7) % 40 for i in range(N_REQUESTS)], seed=6)
    offline = cached_llm(zoo_model(MODEL), block_size=16, seed=0, max_model_len=MAX_MODEL_LEN)
    want = [
        o.outputs[0].text
        for o in offline.generate(
            prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
        )
    ]
    core, fronts, metrics_dir = pool.pids()
    # where it listens, once it does (uvicorn leaves its own line out when given sockets)
    assert f"nanovllm serve running on {pool.url} with 2 API server processes" in pool.text()

    # a few requests on one kept-alive connection (one front end); then every front end's
    # /metrics, the other's too, has the engine's stats (each reads the core's from its start)
    one_front_end = 4
    with httpx.Client(base_url=pool.url, timeout=60, limits=httpx.Limits(max_connections=1)) as c:
        for i in range(one_front_end):
            r = c.post("/v1/completions", json={"model": "zoo", "prompt": [5, 6, 7 + i], "max_tokens": 6})
            assert r.status_code == 200, r.text
    steps = {
        _metric(httpx.get(f"{pool.url}/metrics", timeout=30).text, "nanovllm:engine_steps_total") for _ in range(8)
    }
    assert len(steps) == 1 and steps.pop() >= 6, f"front ends disagree on the engine's steps: {steps}"

    async def run():
        got = await asyncio.wait_for(
            asyncio.gather(*(_completion(pool.url, p, stream=i % 2 == 0) for i, p in enumerate(prompts))), 120
        )
        return got, await _front_ends(pool.url)

    got, seen = asyncio.run(run())
    assert got == want  # each front end got its own requests' tokens, all of them

    # each on a fresh connection, as those that reached both front ends above (the kernel picks one
    # per connection; 16 all to one front end is unlikely, not excluded): --chat-template renders
    conv = [{"role": "user", "content": "w10 w20"}]
    want_ids = offline.chat_prompts(conv, chat_template=TURN_ENDS)[0]["prompt_token_ids"]
    assert want_ids != offline.chat_prompts(conv)[0]["prompt_token_ids"]  # the zoo's own template differs

    async def tokenize() -> list:
        body = {"model": "zoo", "messages": conv}
        return await asyncio.gather(*(_fresh("POST", f"{pool.url}/tokenize", json=body) for _ in range(16)))

    assert [r.json()["tokens"] for r in asyncio.run(tokenize())] == [want_ids] * 16

    async def preflights() -> list:
        headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        return await asyncio.gather(
            *(_fresh("OPTIONS", f"{pool.url}/v1/completions", headers=headers) for _ in range(16))
        )

    assert {r.headers.get("access-control-allow-origin") for r in asyncio.run(preflights())} == {"https://app.example"}
    assert sorted(seen) == sorted(fronts), f"front ends answering: {sorted(seen)}, started: {fronts}"
    finished = {pid: state["front_end_finished"] for pid, state in seen.items()}
    # both took requests: a /metrics of one process would count fewer than all of them
    total = N_REQUESTS + one_front_end
    assert sum(finished.values()) == total and all(0 < n < total for n in finished.values()), finished
    for state in seen.values():
        s = state["stats"]
        assert state["requests"] == [] and s["num_free_kv_blocks"] == s["num_kv_blocks"], state

    for _ in range(4):  # whichever front end answers, it counts every request
        text = httpx.get(f"{pool.url}/metrics", timeout=30).text
        assert _metric(text, "vllm:request_success_total") == total
        assert _metric(text, "vllm:generation_tokens_total") == N_REQUESTS * 10 + one_front_end * 6
        assert "nanovllm:request_success" not in text
    cpu = _metric(text, "process_cpu_seconds_total")
    each = [process_cpu_seconds(pid) for pid in fronts]
    assert max(each) < cpu <= sum(each) + 0.05, (cpu, each)  # the front ends' sum, not one of them
    rss, each_rss = _metric(text, "process_resident_memory_bytes"), [process_resident_bytes(pid) for pid in fronts]
    assert 0.8 * sum(each_rss) < rss < 1.2 * sum(each_rss) and rss > 1.2 * max(each_rss), (rss, each_rss)

    # a second server on the port is refused before it starts anything; SO_REUSEPORT alone would
    # have let it in (the negative control: the bind the check prevents succeeds)
    assert main(["serve", "--port", str(pool.port), "--api-server-count", "2"]) == 2
    _bind(socket.AF_INET, "127.0.0.1", pool.port, reuse_port=True, listen=False).close()

    pool.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    pool.proc.send_signal(signal.SIGTERM)  # a second one (an impatient supervisor) waits for the stop
    status = pool.proc.wait(timeout=90)
    text = pool.text()
    assert status == 128 + signal.SIGTERM, f"exit status {status}:\n{text[-3000:]}"
    assert "engine core: " in text and "closed the pipe; the engine core leaves" not in text, text[-3000:]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in (core, *fronts)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in (core, *fronts)), "a process outlived the server"
    assert not os.path.exists(metrics_dir), f"{metrics_dir} left behind"


def test_a_front_end_that_dies_stops_the_server(pool):
    core, fronts, metrics_dir = pool.pids()
    os.kill(fronts[1], signal.SIGKILL)
    status = pool.proc.wait(timeout=90)
    text = pool.text()
    assert status == 1, f"exit status {status}:\n{text[-3000:]}"
    assert f"API server 1 (pid {fronts[1]}) exited on its own" in text, text[-3000:]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in (core, fronts[0])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(core) and not _alive(fronts[0]), "a process outlived the server"
    assert not os.path.exists(metrics_dir)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--api-server-count", "0"], "--api-server-count must be >= 1, got 0"),
        (["--api-server-count", "2", "--no-engine-process"], "--api-server-count 2 needs the engine core"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0 seconds, got -1"),
        (["--chat-template", "missing.jinja"], "--chat-template 'missing.jinja': no such file"),
    ],
)
@pytest.mark.parametrize("default_model", ["installed", "hidden"])
def test_api_server_count_checked_before_anything_starts(flags, message, default_model, capsys, monkeypatch):
    """Bad flag values: exit status 2 and a message naming the flag, before the model is looked
    up (a GPU host without the default model's package got the model's error instead)."""
    if default_model == "hidden":
        monkeypatch.setenv("NANOVLLM_NO_DEFAULT_MODEL", "1")
    assert main(["serve", "--port", str(free_port()), *flags]) == 2
    assert message in capsys.readouterr().err


def test_a_busy_port_stops_serve_before_the_model_loads(capsys, monkeypatch):
    """One front end: a port some server listens on is refused before the model loads (it took
    the whole load, then uvicorn's exit status 3). The control: a free port reaches the load."""
    from nanovllm.entrypoints.openai import api_server

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(api_server.AsyncLLM, "from_engine_args", load)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        assert main(["serve", zoo_model(MODEL), "--port", str(port)]) == 2
        assert f"--host 127.0.0.1 --port {port}: cannot bind: Address already in use" in capsys.readouterr().err
    finally:
        busy.close()
    with pytest.raises(Loaded):  # the control: the same flags on a free port reach the model's load
        main(["serve", zoo_model(MODEL), "--port", str(free_port())])
