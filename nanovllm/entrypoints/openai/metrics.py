"""GET /metrics: Prometheus metrics (``prometheus_client``), vLLM's names under ``nanovllm:``.

``serve --metrics-prefix vllm`` names the series vLLM also exposes as vLLM does (``vllm:``,
``VLLM_SERIES``), so dashboards, autoscalers and routers written for vLLM read them as they are;
the series vLLM does not have keep ``nanovllm:`` (``series_name``).

Per-request figures (TTFT, inter-token latency, end-to-end and queue time, token counts,
finished requests by reason) are observed from every RequestOutput the engine hands the front
end, whichever caller consumes it; engine-wide ones (running / waiting requests, KV-cache
usage, preemptions, prefix-cache queries and hits) are read from the engine's stats snapshot at
scrape time. Each app has its own registry (several servers can live in one process).

With several front-end processes (``serve --api-server-count N``) the per-request series live in
Prometheus multiprocess files in a directory the processes share (``multiprocess_dir``), so any
front end's /metrics counts every front end's requests; ``process_cpu_seconds_total`` and
``process_resident_memory_bytes`` are then the front ends' sums (``FrontEndsCollector``).
"""

from __future__ import annotations

import bisect
import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanovllm.engine.async_llm import AsyncLLM
from nanovllm.outputs import RequestOutput

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
FRONT_END_PIDS_FILE = "front_end_pids"  # in the multiprocess directory: the front ends' pids, a line each
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
METRICS_PREFIXES = ("nanovllm", "vllm")  # serve --metrics-prefix
# the series whose name and meaning vLLM's /metrics shares (its v1 PrometheusStatLogger)
VLLM_SERIES = frozenset(
    {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "request_success",
        "prompt_tokens",
        "generation_tokens",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    }
)


def series_name(series: str, prefix: str = "nanovllm") -> str:
    """``prefix:series`` for a series vLLM also has, else ``nanovllm:series``."""
    if prefix not in METRICS_PREFIXES:
        raise ValueError(f"metrics prefix must be one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}")
    return f"{prefix}:{series}" if series in VLLM_SERIES else f"nanovllm:{series}"


def observe_many(histogram, amount: float, count: int) -> None:
    """``count`` observations of ``amount`` in one update of a Histogram child: a stream chunk of
    several tokens has one inter-token gap per token, and ``observe`` (a lock per bucket and sum)
    costs ~1.7 us each. Works on prometheus_client's child layout (``_upper_bounds``, ``_buckets``,
    ``_sum``: the same exposition as ``count`` observes, tests/test_serve_metrics_many.py); any
    other layout gets the observes one by one."""
    if count <= 0:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for _ in range(count):
            histogram.observe(amount)
        return
    i = bisect.bisect_left(bounds, amount)  # observe's bucket: the first bound >= amount (+Inf last)
    if i < len(buckets) and amount == amount:  # NaN falls in no bucket, as observe has it
        buckets[i].inc(count)
    total.inc(amount * count)


class EngineStatsCollector:
    """Engine-wide gauges and counters from ``AsyncLLM.stats`` (the snapshot after the last step)."""

    def __init__(self, engine: AsyncLLM, model_name: str, prefix: str = "nanovllm"):
        self.engine, self.labels, self.prefix = engine, [model_name], prefix

    def collect(self):
        s = self.engine.stats
        name = ["model_name"]

        def gauge(series, doc, value):
            g = GaugeMetricFamily(series_name(series, self.prefix), doc, labels=name)
            g.add_metric(self.labels, value)
            return g

        def counter(series, doc, value):
            c = CounterMetricFamily(series_name(series, self.prefix), doc, labels=name)
            c.add_metric(self.labels, value)
            return c

        total = s["num_kv_blocks"]
        queries, hits = s["prefix_cache_query_tokens"], s["prefix_cache_hit_tokens"]
        yield gauge("num_requests_running", "Requests in the running batch.", s["running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s["waiting"])
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full).",
            (total - s["num_free_kv_blocks"]) / total if total else 0.0,
        )
        yield gauge("num_kv_cache_blocks", "KV-cache blocks in all.", total)
        yield counter("num_preemptions", "Preemptions (recompute).", s["preemptions"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield gauge(
            "prefix_cache_hit_rate",
            "Prefix-cache hits / queries (tokens), since start.",
            hits / queries if queries else 0.0,
        )
        yield counter("engine_steps", "Engine steps.", s["steps"])


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux ``/proc``; this process's anywhere); 0
    for a process that is gone."""
    if pid == os.getpid():
        t = os.times()
        return t.user + t.system
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def process_resident_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` (Linux ``/proc``; None elsewhere, 0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except FileNotFoundError:
        return 0 if os.path.isdir("/proc/self") else None
    except (OSError, IndexError, ValueError):
        return None


class FrontEndsCollector:
    """``process_cpu_seconds_total`` and ``process_resident_memory_bytes`` summed over the
    server's front-end processes, whose pids the server's main process writes to ``pids_path``
    (this process alone until it has). The single-process server's other ``process_*`` series
    (virtual memory, open files, start time) have no sum that means something: not given."""

    def __init__(self, pids_path: str):
        self.pids_path = pids_path

    def pids(self) -> list[int]:
        try:
            with open(self.pids_path) as f:
                return [int(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return [os.getpid()]

    def collect(self):
        pids = self.pids()
        summed = f", summed over the server's {len(pids)} front-end processes."
        yield CounterMetricFamily(
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds" + summed,
            value=sum(process_cpu_seconds(pid) for pid in pids),
        )
        rss = [process_resident_bytes(pid) for pid in pids]
        if None not in rss:
            yield GaugeMetricFamily(
                "process_resident_memory_bytes", "Resident memory size in bytes" + summed, value=sum(rss)
            )


class ServerMetrics:
    """The app's registry; ``observe`` is an AsyncLLM output observer. ``multiprocess_dir``:
    the Prometheus multiprocess directory of a server with several front-end processes."""

    def __init__(
        self, engine: AsyncLLM, model_name: str, multiprocess_dir: str | None = None, prefix: str = "nanovllm"
    ):
        # no `*_created` series (each counter's and histogram's creation time): a third of the
        # page, and dashboards read none of them (vLLM's /metrics leaves them out too)
        disable_created_metrics()

        def name(series: str) -> str:
            return series_name(series, prefix)

        self.registry = CollectorRegistry()
        labels = ["model_name"]
        if multiprocess_dir is None:
            r: CollectorRegistry | None = self.registry
            # process_cpu_seconds_total and friends of the server's process (as in vLLM's /metrics):
            # `bench serve` reads it to tell a saturated front end from a saturated client
            ProcessCollector(registry=r)
        else:
            from prometheus_client import multiprocess, values

            if values.ValueClass is values.MutexValue:
                raise RuntimeError(
                    "several front-end processes need PROMETHEUS_MULTIPROC_DIR set before prometheus_client "
                    "is imported (the server sets it for the processes it starts)"
                )
            r = None  # the series go to the shared files, which the collector below reads
            multiprocess.MultiProcessCollector(self.registry, path=multiprocess_dir)
            self.registry.register(FrontEndsCollector(os.path.join(multiprocess_dir, FRONT_END_PIDS_FILE)))
        self.requests = Counter(
            name("request_success"),
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter(name("generation_tokens"), "Generated tokens.", labels, registry=r)
        self.ttft = Histogram(
            name("time_to_first_token_seconds"),
            "Arrival to first token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            name("inter_token_latency_seconds"),
            "Time between consecutive output tokens.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            name("e2e_request_latency_seconds"), "Arrival to finish.", labels, buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue = Histogram(
            name("request_queue_time_seconds"),
            "Arrival to first scheduled.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_len = Histogram(
            name("request_prompt_tokens"), "Prompt length.", labels, buckets=TOKEN_BUCKETS, registry=r
        )
        self.gen_len = Histogram(
            name("request_generation_tokens"),
            "Generated tokens per request.",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        # every per-model series exists from start-up, at zero: a scrape before the first request
        # sees the metrics (a labelled metric shows no sample until its label values are used)
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue,
            self.prompt_len,
            self.gen_len,
        ):
            metric.labels(model_name)
        self.registry.register(EngineStatsCollector(engine, model_name, prefix))
        self.model_name = model_name
        # the series touched on every output, looked up once (labels() locks and hashes each call)
        self._ttft, self._itl = self.ttft.labels(model_name), self.itl.labels(model_name)
        self._generation_tokens = self.generation_tokens.labels(model_name)
        self._last: dict[str, tuple[float | None, int]] = {}  # request -> (last token time, tokens so far)
        self.finished_here = 0  # requests this process saw finish (/debug/engine: which front end served)
        engine.output_observers.append(self.observe)

    def observe(self, out: RequestOutput) -> None:
        m, name = out.metrics, self.model_name
        if m is None:
            return
        last_time, last_n = self._last.get(out.request_id, (None, 0))
        n = m.num_generation_tokens
        if n > last_n:
            if last_n == 0 and m.first_token_latency is not None:
                self._ttft.observe(m.first_token_latency)
                # a request seen first when several tokens are out (FINAL_ONLY): their mean gap
                if n > 1 and m.last_token_time is not None:
                    gap = (m.last_token_time - m.first_token_time) / (n - 1)  # type: ignore[operator]
                    observe_many(self._itl, gap, n - 1)
            elif last_time is not None and m.last_token_time is not None:
                observe_many(self._itl, (m.last_token_time - last_time) / (n - last_n), n - last_n)
            self._generation_tokens.inc(n - last_n)
        if not out.finished:
            self._last[out.request_id] = (m.last_token_time, n)
            return
        self._last.pop(out.request_id, None)
        self.finished_here += 1
        reason = out.outputs[0].finish_reason or "unknown"
        self.requests.labels(name, reason).inc()
        self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
        self.prompt_len.labels(name).observe(len(out.prompt_token_ids))
        self.gen_len.labels(name).observe(n)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
        if m.time_in_queue is not None:
            self.queue.labels(name).observe(m.time_in_queue)

    def render(self) -> bytes:
        return generate_latest(self.registry)
