"""Conventions the test suite relies on, checked over its source.

Test engines take their arguments through ``engine_args(device, **kwargs)``: on CUDA it adds
defaults (the KV-cache share of the test process, a cap on sequences) unless the test sets them.
A call ``LLM(path, **engine_args(device), max_num_seqs=4)`` passes a key twice on CUDA only: a
TypeError that no CPU run can show (found by GPU CI). Every such call must pass its own keywords
inside ``engine_args(...)``.

Kernel tests written for Triton's interpreter run on a CPU-only CI only through
``tests/gpu/test_triton_interpret.py``, which lists its files: every file that reads
``NANOVLLM_TRITON_INTERPRET`` must be on that list.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mixed_calls(source: str) -> list[int]:
    """Lines of calls that unpack ``**engine_args(...)`` next to other keyword arguments."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        spread = [
            k
            for k in node.keywords
            if k.arg is None and isinstance(k.value, ast.Call) and getattr(k.value.func, "id", None) == "engine_args"
        ]
        if spread and len(node.keywords) > len(spread):
            lines.append(node.lineno)
    return lines


def test_the_check_sees_a_mixed_call():
    assert _mixed_calls("LLM(p, **engine_args(d), max_num_seqs=4)") == [1]
    assert _mixed_calls("LLM(p, **engine_args(d, max_num_seqs=4))") == []


def test_engine_args_carry_every_keyword():
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in ("tests", "conformance")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in _mixed_calls(path.read_text())
    ]
    assert not bad, "pass keywords inside engine_args(...), not next to it: " + ", ".join(bad)


def test_the_device_hook_keeps_a_tests_own_device_parametrization(monkeypatch):
    """On a CUDA host the conftest parametrizes every ``device`` argument over cpu and cuda; a test
    that parametrizes ``device`` itself must keep its own values: a second parametrization of the
    name fails the whole module's collection, and every test in it goes unrun (GPU CI, session 12:
    tests/test_api.py). Checked here with the host's devices faked."""
    import types

    import pytest

    from tests import conftest

    monkeypatch.setattr(conftest, "available_devices", lambda: ["cpu", "cuda"])
    calls: list = []

    def metafunc(*marks):
        definition = types.SimpleNamespace(iter_markers=lambda name: [m.mark for m in marks if m.mark.name == name])
        return types.SimpleNamespace(
            fixturenames=["device", "expected"], definition=definition, parametrize=lambda *a, **k: calls.append(a[0])
        )

    conftest.pytest_generate_tests(metafunc(pytest.mark.parametrize("device,expected", [("cpu", 1)])))
    conftest.pytest_generate_tests(metafunc(pytest.mark.parametrize(("expected", "device"), [(1, "cpu")])))
    conftest.pytest_generate_tests(metafunc(pytest.mark.parametrize(argnames="device", argvalues=["cpu"])))
    assert calls == []
    conftest.pytest_generate_tests(metafunc(pytest.mark.parametrize("expected", [1]), pytest.mark.slow))
    assert calls == ["device"]


GPU_TESTS = ROOT / "tests" / "gpu"


def _interpreter_gaps(runner_source: str, files: dict[str, str]) -> set[str]:
    """Kernel test files written for Triton's interpreter (they read ``NANOVLLM_TRITON_INTERPRET``)
    that the interpreter runner does not run: on a CPU-only CI they would never run at all."""
    listed = set(re.findall(r'"(test_\w+\.py)"', runner_source))
    supports = {name for name, text in files.items() if "NANOVLLM_TRITON_INTERPRET" in text}
    return supports - listed - {"test_triton_interpret.py"}


def test_the_interpreter_runner_runs_every_kernel_test_file_written_for_it():
    files = {p.name: p.read_text() for p in GPU_TESTS.glob("test_*.py")}
    assert not _interpreter_gaps(files["test_triton_interpret.py"], files)


def test_the_gap_check_sees_a_file_the_runner_misses():
    """Negative control: a new interpreter-ready kernel test file that the runner does not list."""
    files = {p.name: p.read_text() for p in GPU_TESTS.glob("test_*.py")}
    files["test_new_kernel.py"] = 'INTERPRET = os.environ.get("NANOVLLM_TRITON_INTERPRET") == "1"'
    assert _interpreter_gaps(files["test_triton_interpret.py"], files) == {"test_new_kernel.py"}
