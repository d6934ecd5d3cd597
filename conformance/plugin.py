"""The suite's pytest plugin (entry point ``pytest11``): options, fixtures, and an honest exit.

    pytest --pyargs conformance --engine NAME            # a registered engine
    pytest --pyargs conformance --adapter mypkg.mod:MyAdapter
    pytest --pyargs conformance --list-engines

Options: ``--engine NAME`` (env CONFORMANCE_ENGINE, default nanovllm), ``--adapter module:Class``
(any subclass of ``conformance.adapters.base.EngineAdapter``; overrides --engine),
``--list-engines``, ``--allow-skips``, ``--block-size N``, ``--device cpu|cuda|all``,
``--check-timeout S``.

Honest exit: a check the engine cannot take is skipped with the capability named, in the
words "engine X lacks capability Y" (``harness.require``, ``harness.skip_lacking``) or "engine X
is not available here: why". When the engine is unavailable here, or more than half of the checks
that could run on this machine were skipped that way, the run fails (exit 1) and the summary
names what went unchecked; ``--allow-skips`` accepts such a run. Skips that are not the engine's
(slow checks not asked for, no GPU on this machine) do not count either way.

Fixtures: ``engines`` (an EnginePool of the chosen engine), ``engine_name``, ``figure``
(records a key figure of a check: the report shows it).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest

SUITE_DIR = Path(__file__).resolve().parent
STATUS = "conformance_status"  # the user property that carries a check's outcome to the report
UNCHECKED_RE = re.compile(r"engine \S+ (?:lacks capability '?(\w+)'?|is not available here)")
_state: dict = {"status": {}, "skips": {}, "verdict": None}  # this process's outcomes (the controller's under xdist)


def positive_int(text: str) -> int:
    """--block-size: a whole number of tokens, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a block size: give a whole number of tokens >= 1 (e.g. 16)")
    return value


def positive_seconds(text: str) -> float:
    """--check-timeout: seconds, more than 0 (fractions are kept: 0.5 is half a second)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a timeout: give the seconds a check may run, a number > 0 (e.g. 900; "
            "env CONFORMANCE_CHECK_TIMEOUT)"
        )
    return value


def add_options(add) -> None:
    """The options the plugin and ``python -m conformance`` share, with one validation: ``add`` is
    pytest's ``group.addoption`` or argparse's ``add_argument``."""
    add(
        "--block-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="KV block size of every engine, >= 1 (default 16, or the engine's smallest)",
    )
    add(
        "--device",
        default=os.environ.get("CONFORMANCE_DEVICE", "all"),
        choices=("all", "cpu", "cuda"),
        help="device the engine runs on: cpu, cuda, or all (cpu, plus cuda where torch sees a GPU: "
        "each check runs on every one; env CONFORMANCE_DEVICE)",
    )
    add(
        "--check-timeout",
        type=positive_seconds,
        default=os.environ.get("CONFORMANCE_CHECK_TIMEOUT", "900"),
        metavar="S",
        help="seconds (> 0, fractions allowed) after which a running check fails instead of hanging "
        "the suite (default 900, env CONFORMANCE_CHECK_TIMEOUT)",
    )


def spec_error(engine: str, adapter: str | None) -> str | None:
    """One line saying what is wrong with --engine / --adapter (unknown name, module that does not
    import, not an EngineAdapter, a capability typo in the class), or None when the class loads."""
    from conformance.adapters import adapter_class, load_spec

    try:
        load_spec(adapter) if adapter else adapter_class(engine)
    except (KeyError, ValueError) as e:
        if adapter:
            return f"--adapter {adapter}: {e.args[0].removeprefix(f'adapter {adapter!r}: ')}"
        return f"--engine {engine}: {e.args[0]}"
    return None


def pytest_addoption(parser):
    group = parser.getgroup("conformance", "conformance suite (checks an engine through its adapter)")
    group.addoption(
        "--engine",
        default=os.environ.get("CONFORMANCE_ENGINE", "nanovllm"),
        help="engine to check: a built-in name (nanovllm, hf, hf-cb, vllm, openai, llama-cpp) "
        "or one an installed package registers; see --list-engines (default: nanovllm, "
        "env CONFORMANCE_ENGINE)",
    )
    group.addoption(
        "--adapter",
        default=None,
        metavar="MODULE:CLASS",
        help="check the engine of this adapter class (a subclass of "
        "conformance.adapters.base.EngineAdapter); overrides --engine",
    )
    group.addoption(
        "--list-engines",
        action="store_true",
        help="list the engines this installation knows, whether each can run here, and exit",
    )
    group.addoption(
        "--allow-skips",
        action="store_true",
        help="accept a run in which the engine was unavailable or more than half of the checks "
        "were skipped for missing capabilities (the default fails it)",
    )
    add_options(group.addoption)


def engine_spec(config) -> str:
    return config.getoption("--adapter") or config.getoption("--engine")


def list_engines() -> str:
    """One line per known engine: name, where its adapter lives, and whether it can run here."""
    from conformance.adapters import registered

    lines = []
    for name, spec in sorted(registered().items()):
        try:
            from conformance.adapters import load_spec

            why = load_spec(spec).unavailable()
            state = "available" if why is None else f"unavailable: {why}"
        except Exception as e:  # noqa: BLE001 - a broken adapter is listed, not fatal
            state = f"broken: {e}"
        lines.append(f"{name:12s} {spec}\n{'':12s} {state}")
    return "\n".join(lines)


def pytest_cmdline_main(config):
    if config.getoption("--list-engines", False):
        print(list_engines())
        return 0
    return None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's share, not the host's
    count that os.cpu_count() reports), as pytest-xdist's ``-n auto`` counts them."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def _share_cores_between_workers() -> None:
    """Under pytest-xdist, give each worker its share of the cores. Two workers with two torch
    threads each on two cores make every small matmul wait on a descheduled OpenMP thread
    (measured here: 12.9 ms instead of 0.5 ms for an [11, 576] x [576, 1536] linear). An
    OMP_NUM_THREADS already set (by the user, or by a conftest after torch was imported, when
    torch's pool no longer reads it) is applied as the count."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1:
        import torch

        threads = os.environ.get("OMP_NUM_THREADS", "")
        torch.set_num_threads(
            int(threads) if threads.isdigit() and int(threads) > 0 else max(1, usable_cores() // workers)
        )


def pytest_configure(config):
    _share_cores_between_workers()
    for line in (
        "gpu: needs one CUDA GPU (skipped with the reason where there is none)",
        "multi_gpu: needs two or more CUDA GPUs",
        "slow: long-running; deselect with -m 'not slow'",
        "xdist_group(name): checks that must share one pytest-xdist worker",
        "pinned_device: the check chooses its devices itself (run once)",
    ):
        config.addinivalue_line("markers", line)
    _state.update(status={}, skips={}, verdict=None)


def in_suite(item) -> bool:
    return SUITE_DIR in Path(str(item.fspath)).resolve().parents


def _group_by_model(items) -> None:
    """Run the checks of one golden model together (engines are loaded once per model: that
    matters for engines in their own process, which the pool keeps only a few of)."""
    slots = [i for i, it in enumerate(items) if "name" in getattr(getattr(it, "callspec", None), "params", {})]
    order = sorted((items[i] for i in slots), key=lambda it: str(it.callspec.params["name"]))
    for i, it in zip(slots, order):
        items[i] = it


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    suite = [it for it in items if in_suite(it)]
    if not suite:
        return
    problem = spec_error(config.getoption("--engine"), config.getoption("--adapter"))
    if problem:
        raise pytest.UsageError(problem)
    _group_by_model(items)
    # the suite's slow checks (regenerating golden files) take many minutes: they run when asked
    # for (-m slow, or CONFORMANCE_SLOW=1), not in every pytest run
    if "slow" not in (config.option.markexpr or "") and os.environ.get("CONFORMANCE_SLOW") != "1":
        later = pytest.mark.skip(reason="slow conformance check: run with -m slow or CONFORMANCE_SLOW=1")
        for item in suite:
            if item.get_closest_marker("slow"):
                item.add_marker(later)
    n_gpu = None
    for item in suite:
        markers = {m for m in GPUS_NEEDED if item.get_closest_marker(m)}
        if markers:
            n_gpu = _gpus() if n_gpu is None else n_gpu
            reason = gpu_shortfall(markers, n_gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


GPUS_NEEDED = {"gpu": 1, "multi_gpu": 2}  # marker -> CUDA GPUs the check needs


def gpu_shortfall(markers: set[str], n_gpu: int) -> str | None:
    """Why a check with these markers cannot run on a host with ``n_gpu`` GPUs (None: it can)."""
    for marker in sorted(markers):
        need = GPUS_NEEDED[marker]
        if n_gpu < need:
            return f"needs {need} CUDA GPU(s), {n_gpu} visible"
    return None


def pytest_report_header(config):
    return f"conformance engine: {engine_spec(config)}"


# --------------------------------------------------------------------------- honest exit
def _classify(call) -> str | None:
    """checked | failed | unchecked:<capability or 'engine unavailable'> | skipped (not the engine's)."""
    if call.excinfo is None:
        return "checked" if call.when == "call" else None
    exc = call.excinfo.value
    if isinstance(exc, pytest.skip.Exception):
        m = UNCHECKED_RE.search(str(exc))
        if m:
            return f"unchecked:{m.group(1) or 'engine unavailable'}"
        return "skipped"
    return "failed"


def uses_engine(item) -> bool:
    """Whether a check runs the engine (asks for the ``engines`` fixture, directly or through another
    fixture); the others are self-tests of the suite's rules and files, the same for every engine."""
    return "engines" in getattr(item, "fixturenames", ())


def _self_test_status(call) -> str | None:
    """self-test:passed | self-test:failed | self-test:skipped: never counted as checks of the engine."""
    if call.excinfo is None:
        return "self-test:passed" if call.when == "call" else None
    return "self-test:skipped" if isinstance(call.excinfo.value, pytest.skip.Exception) else "self-test:failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if in_suite(item) and call.when in ("setup", "call"):
        status = _classify(call) if uses_engine(item) else _self_test_status(call)
        if status:
            item.user_properties[:] = [p for p in item.user_properties if p[0] != STATUS]
            item.user_properties.append((STATUS, status))
    yield


def pytest_runtest_logreport(report):
    """Runs where results arrive (the controller under xdist): keep each check's last status, and
    why it was skipped."""
    statuses = [v for k, v in report.user_properties if k == STATUS]
    if statuses and report.when in ("setup", "call"):
        _state["status"][report.nodeid] = statuses[-1]
        if report.skipped and isinstance(report.longrepr, tuple):
            _state["skips"][report.nodeid] = str(report.longrepr[2]).removeprefix("Skipped: ")


def verdict(statuses: dict[str, str], allow_skips: bool) -> tuple[bool, str]:
    """(ok, summary): the run fails when the engine was unavailable or more than half of the checks
    that could run here were skipped for a missing capability, unless skips are allowed. Self-tests
    (checks that never run the engine) are counted apart: they check the suite, not the engine."""
    counted = {k: v for k, v in statuses.items() if v != "skipped" and not v.startswith("self-test:")}
    selftests = Counter(v.split(":", 1)[1] for v in statuses.values() if v.startswith("self-test:"))
    unchecked = Counter(v.split(":", 1)[1] for v in counted.values() if v.startswith("unchecked:"))
    n_un = sum(unchecked.values())
    checked = sum(v == "checked" for v in counted.values())
    failed = sum(v == "failed" for v in counted.values())
    by_cap = ", ".join(f"{cap} x{n}" for cap, n in unchecked.most_common())
    summary = (
        f"{checked} checked, {failed} failed, {n_un} unchecked"
        + (f" (by capability: {by_cap})" if by_cap else "")
        + f", of {len(counted)} checks that could run here"
    )
    if selftests:
        summary += "; rule self-tests (no engine): " + ", ".join(f"{n} {how}" for how, n in sorted(selftests.items()))
    unavailable = unchecked.get("engine unavailable", 0) > 0
    too_many = n_un * 2 > len(counted)
    if (unavailable or too_many) and not allow_skips:
        why = "the engine is unavailable here" if unavailable else "more than half of the checks went unchecked"
        return False, f"FAILED: {why}: {summary} (--allow-skips accepts this)"
    return True, summary


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    statuses = _state["status"]
    if not statuses or hasattr(session.config, "workerinput"):  # xdist workers: the controller judges
        return
    ok, summary = verdict(statuses, session.config.getoption("--allow-skips"))
    _state["verdict"] = (ok, summary)
    if not ok and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    v = _state["verdict"]
    if v:
        ok, summary = v
        # a run in which no check ran the engine is not green, whatever its self-tests did
        engine_ran = any(s != "skipped" and not s.startswith("self-test:") for s in _state["status"].values())
        colour = {"red": True} if not ok else {"green": True} if engine_ran else {"yellow": True}
        terminalreporter.section(f"conformance: engine {engine_spec(config)}", bold=True, **colour)
        terminalreporter.line(summary if engine_ran else f"{summary}: no check ran the engine")
        reasons = Counter(_state["skips"].values())
        if reasons:
            terminalreporter.line("skipped, by reason:")
            for reason, n in reasons.most_common():
                terminalreporter.line(f"  {n} x {reason}")


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def engine_name(request) -> str:
    return engine_spec(request.config)


def selected_devices(config) -> list[str]:
    choice = config.getoption("--device")
    if choice != "all":
        return [choice]
    return ["cpu"] + (["cuda"] if _gpus() else [])


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
    from conformance.harness import EnginePool

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
    seconds = request.config.getoption("--check-timeout")
    if not in_suite(request.node) or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise CheckTimeout(f"check exceeded --check-timeout={seconds:g} s")

    try:
        previous = signal.signal(signal.SIGALRM, on_alarm)
    except ValueError:  # not the main thread
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)  # fractions of a second too (signal.alarm rounds down to 0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
