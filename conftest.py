"""Shared pytest setup: devices and GPU sharing, threads per worker, hypothesis profiles, skips."""

from __future__ import annotations

import os

import pytest

# ---------------------------------------------------------------- devices and GPU sharing
# The engine's device="auto" means CUDA where there is one. Tests choose their device
# explicitly instead: the default for the test session is the CPU (NANOVLLM_DEVICE), and the
# end-to-end checks that must also run on a GPU take a ``device`` parameter (tests/conftest.py,
# conformance/conftest.py) that includes "cuda" on a CUDA host.
os.environ.setdefault("NANOVLLM_DEVICE", "cpu")


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_share() -> tuple[int, float] | None:
    """How this test process shares the GPUs: (its default CUDA device, the KV-cache GiB each
    test engine on it may take), or None without a GPU.

    The one place that decides it. pytest-xdist workers spread over the GPUs (gw0 -> GPU 0,
    gw1 -> GPU 1, ...); the workers of one GPU split 85% of its memory evenly, and each worker's
    share is split between the engines it may hold at once (ENGINES_PER_WORKER), 30% of each
    engine's part for its KV cache, the rest for weights, activations and CUDA graphs. Test
    engines pass it as ``kv_cache_memory_gib`` (the conformance harness as its knob), so no
    test engine sizes itself from ``gpu_memory_utilization`` of the whole device.
    """
    n = _cuda_devices()
    if n == 0:
        return None
    import torch

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = worker % n
    per_gpu = -(-workers // n)
    total = torch.cuda.get_device_properties(index).total_memory / 2**30
    per_engine = 0.85 * total / per_gpu / ENGINES_PER_WORKER
    return index, round(min(1.0, 0.3 * per_engine), 3)


GIB_PER_WORKER = float(os.environ.get("NANOVLLM_TEST_GIB_PER_WORKER", "8.5"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``pytest -n auto`` on a GPU host: the usable cores, but at most one worker per 8.5 GiB of GPU
    memory (NANOVLLM_TEST_GIB_PER_WORKER). Every worker keeps engines loaded and each engine holds a
    CUDA context, weights, graphs and a measured activation reserve beside its KV-cache share: 16
    workers passed on a 141 GB H200 (8.8 GiB each), while on an 80 GB H100 14 CUDA checks found too
    little memory free (5 GiB each). Without a GPU: pytest-xdist's own count (None)."""
    n = _cuda_devices()
    if n == 0:
        return None
    import torch

    from conformance.plugin import usable_cores

    gib = sum(torch.cuda.get_device_properties(i).total_memory for i in range(n)) / 2**30
    return max(1, min(usable_cores(), int(gib // GIB_PER_WORKER)))


ENGINES_PER_WORKER = 16  # tests/conftest.py keeps 8 engines loaded, the conformance pool 8 more
_share = gpu_share()
if _share is not None:
    import torch

    torch.cuda.set_device(_share[0])
    os.environ.setdefault("NANOVLLM_TEST_KV_CACHE_GIB", str(_share[1]))
    os.environ.setdefault("CONFORMANCE_KV_CACHE_GIB", str(_share[1]))

# Test engines on the CPU take a small KV cache unless a test sizes it (``kv_cache_memory_gib``):
# a worker keeps up to 16 engines alive (tests/conftest.py's 8, the conformance pool's 8), and at the
# engine's default of 4 GiB each its address space reached 50 GB, merged by the kernel into single
# mappings of up to 39 GB. Forking such a worker (a server, a CLI run) failed with ENOMEM once one
# mapping exceeded the machine's RAM: 16 server tests errored in 3 of 6 full runs on a 24 GB
# machine (2026-12-06). The variable reaches the workers' subprocesses too.
os.environ.setdefault("NANOVLLM_CPU_KVCACHE_SPACE", "0.5")

# xdist workers share the cores: give each its share of threads (OpenMP spin-waits make
# oversubscription far slower than the core count suggests: 16 workers of 16 threads each on a
# 16-core GPU host ran the suite several times slower). The variables reach the worker's
# subprocesses (CLI tests, servers, TP workers); torch in this process is already imported, and the
# conformance plugin sets its thread count (conformance/plugin.py).
from conformance.plugin import usable_cores  # noqa: E402

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    _threads = max(1, usable_cores() // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    os.environ.setdefault("MKL_NUM_THREADS", str(_threads))

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "quick", max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.register_profile(
        "conformance",
        max_examples=300,
        stateful_step_count=80,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    # mutation runs (make mutation): few examples, the same ones for every mutant, no example
    # database (a mutant's failing example must not be replayed against the next mutant)
    settings.register_profile(
        "mutation",
        max_examples=10,
        stateful_step_count=20,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))
except ImportError:  # hypothesis is a test dependency
    pass


def pytest_configure(config):
    # multi-GPU tests carry xdist_group("multi_gpu"): one worker runs them all, holding every GPU
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadgroup"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        if item.get_closest_marker("multi_gpu") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("multi_gpu"))

    # slow checks (regenerating golden files, the whole mutant table) take many minutes: they run
    # when asked for (-m slow, or NANOVLLM_SLOW=1), not in every pytest run
    if (
        "slow" not in (config.option.markexpr or "")
        and os.environ.get("NANOVLLM_SLOW") != "1"
        and os.environ.get("CONFORMANCE_SLOW") != "1"
    ):
        later = pytest.mark.skip(reason="slow check: run with -m slow or NANOVLLM_SLOW=1")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(later)

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("gpu") and n_gpu < 1:  # markers, not keywords: tests/gpu/ is a keyword
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
        if item.get_closest_marker("multi_gpu") and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, {n_gpu} visible"))


# the conformance suite's pytest plugin (options such as --engine, fixtures, the honest exit) for the
# repository's own pytest runs; an installed nanovllm's pytest11 entry point (conformance/autoload.py)
# loads it under the same name only into runs of the suite
pytest_plugins = ["conformance.plugin"]
