"""Conformance suite setup: ``--engine NAME`` picks the adapter (default nanovllm).

Options:
  --engine NAME        nanovllm | hf | hf-cb | vllm | nano-vllm (env CONFORMANCE_ENGINE)
  --check-timeout S    a check still running after S seconds fails (no hang; env
                       CONFORMANCE_CHECK_TIMEOUT, default 900)

Fixtures: ``engines`` (an EnginePool of the chosen engine), ``figure`` (records
a key figure of a check: the report shows it).
"""
from __future__ import annotations

import os
import signal

import pytest

from conformance.harness import EnginePool


def pytest_addoption(parser):
    group = parser.getgroup("conformance")
    group.addoption("--engine", default=os.environ.get("CONFORMANCE_ENGINE", "nanovllm"),
                    help="engine adapter to check: nanovllm (default), hf, hf-cb, vllm, nano-vllm")
    group.addoption("--block-size", type=int, default=None,
                    help="KV block size of every engine (default 16, or the engine's smallest)")
    group.addoption("--device", default=os.environ.get("CONFORMANCE_DEVICE", "all"),
                    choices=("all", "cpu", "cuda"),
                    help="device the engine runs on: cpu, cuda, or all (cpu, plus cuda where torch sees a GPU: "
                         "each check runs on every one)")
    group.addoption("--check-timeout", type=float,
                    default=float(os.environ.get("CONFORMANCE_CHECK_TIMEOUT", "900")),
                    help="seconds after which a running check fails (hang protection)")


def _share_cores_between_workers() -> None:
    """Under pytest-xdist, give each worker its share of the cores. Two workers with two torch
    threads each on two cores make every small matmul wait on a descheduled OpenMP thread
    (measured here: 12.9 ms instead of 0.5 ms for an [11, 576] x [576, 1536] linear)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_configure(config):
    _share_cores_between_workers()
    config.addinivalue_line("markers", "nanovllm_only: checks nanovllm itself; skipped for other engines")
    config.addinivalue_line("markers", "pinned_device: the check chooses its devices itself (run once)")


def _group_by_model(items) -> None:
    """Run the checks of one golden model together (engines are loaded once per model: that
    matters for engines in their own process, which the pool keeps only a few of)."""
    slots = [i for i, it in enumerate(items) if "name" in getattr(getattr(it, "callspec", None), "params", {})]
    order = sorted((items[i] for i in slots), key=lambda it: str(it.callspec.params["name"]))
    for i, it in zip(slots, order):
        items[i] = it


def pytest_collection_modifyitems(config, items):
    _group_by_model(items)
    # the suite's slow checks (regenerating golden files, the whole mutant table) take many
    # minutes: they run when asked for (-m slow, or CONFORMANCE_SLOW=1), not in every pytest run
    if "slow" not in (config.option.markexpr or "") and os.environ.get("CONFORMANCE_SLOW") != "1":
        later = pytest.mark.skip(reason="slow conformance check: run with -m slow or CONFORMANCE_SLOW=1")
        for item in items:
            if item.get_closest_marker("slow") and "conformance" in str(item.fspath):
                item.add_marker(later)
    engine = config.getoption("--engine")
    if engine == "nanovllm":
        return
    skip = pytest.mark.skip(reason=f"a test of nanovllm's internals; engine {engine} is checked end to end only")
    for item in items:
        if item.get_closest_marker("nanovllm_only"):
            item.add_marker(skip)


def pytest_report_header(config):
    return f"conformance engine: {config.getoption('--engine')}"


@pytest.fixture(scope="session")
def engine_name(request) -> str:
    return request.config.getoption("--engine")


def selected_devices(config) -> list[str]:
    choice = config.getoption("--device")
    if choice != "all":
        return [choice]
    try:
        import torch
    except ImportError:
        return ["cpu"]
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    """With more than one device selected, every check that uses ``engines`` runs on each (test
    ids gain [cpu] / [cuda]); checks that pin their device (``pinned_device``) run once."""
    if "engines" not in metafunc.fixturenames or metafunc.definition.get_closest_marker("pinned_device"):
        return
    devices = selected_devices(metafunc.config)
    if len(devices) > 1:
        metafunc.parametrize("engine_device", devices, indirect=True, scope="session")


@pytest.fixture(scope="session")
def engine_device(request) -> str:
    return getattr(request, "param", None) or selected_devices(request.config)[0]


@pytest.fixture(scope="session")
def engines(engine_name, engine_device, request):
    pool = EnginePool(engine_name, block_size=request.config.getoption("--block-size"), device=engine_device)
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _close_owned_engines(request):
    yield
    if "engines" in request.fixturenames:
        request.getfixturevalue("engines").close_owned()


@pytest.fixture
def figure(record_property):
    """figure(name, value): a key figure of this check, shown in the report."""
    def record(name: str, value) -> None:
        record_property(name, value if isinstance(value, (int, str)) else f"{value:.3g}")
    return record


class CheckTimeout(Exception):
    pass


@pytest.fixture(autouse=True)
def _check_timeout(request):
    """Fail a check that runs too long instead of hanging the suite (main thread only)."""
    seconds = int(request.config.getoption("--check-timeout") or 0)
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise CheckTimeout(f"check exceeded --check-timeout={seconds} s")
    try:
        previous = signal.signal(signal.SIGALRM, on_alarm)
    except ValueError:  # not the main thread
        yield
        return
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
