"""The conformance suite as a tool for other engines: adapters found by entry point and by
``--adapter module:Class``, ``--list-engines``, ``--help``, the honest exit and the report."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.adapters import ENTRY_POINT_GROUP, adapter_class, load_spec, registered
from conformance.adapters.base import Capability, EngineAdapter
from conformance.plugin import verdict

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_DIR = ROOT / "docs" / "conformance"


def run_conformance(*args: str, pythonpath: list[Path] = (), timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), *map(str, pythonpath)]))
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(
        [sys.executable, "-m", "conformance", *args, "-p", "no:xdist"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A directory holding an installed-looking distribution that registers an adapter 'toy'."""
    (tmp_path / "toy_engine.py").write_text(
        textwrap.dedent("""
        from conformance.adapters.base import C, EngineAdapter

        class Toy(EngineAdapter):
            name = "toy"
            capabilities = {C.GREEDY}

        class Missing(EngineAdapter):
            name = "missing"

            @classmethod
            def unavailable(cls):
                return "toy engine not installed here"
    """)
    )
    info = tmp_path / "toy_engine-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engine\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoy = toy_engine:Toy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_entry_point_adapter_is_found(plugin_dir):
    assert registered()["toy"] == "toy_engine:Toy"
    cls = adapter_class("toy")
    assert cls.name == "toy" and cls.capabilities == frozenset({Capability.GREEDY})


def test_adapter_spec_errors_name_the_spec():
    with pytest.raises(KeyError, match="unknown engine 'nope'.*--adapter module:Class"):
        adapter_class("nope")
    with pytest.raises(ValueError, match="not of the form module:Class"):
        load_spec("conformance.adapters.base")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_spec("no_such_module:X")
    with pytest.raises(ValueError, match="not a subclass"):
        load_spec("conformance.adapters.base:Sampling")


def test_capabilities_are_the_enum():
    class Strings(EngineAdapter):
        name = "strings"
        capabilities = {"greedy", "logprobs"}

    assert Strings.capabilities == {Capability.GREEDY, Capability.LOGPROBS}
    assert all(isinstance(c, Capability) for c in Strings.capabilities)
    with pytest.raises(ValueError, match="unknown capability 'greedyy'"):

        class Typo(EngineAdapter):
            name = "typo"
            capabilities = {"greedyy"}


def test_verdict_rule():
    """More than half unchecked, or the engine unavailable, fails; other skips do not count."""
    assert verdict({"a": "checked", "b": "unchecked:seed", "c": "skipped", "d": "skipped"}, False)[0]
    ok, summary = verdict({"a": "checked", "b": "unchecked:seed", "c": "unchecked:top_k"}, False)
    assert not ok and "more than half" in summary and "seed x1" in summary and "top_k x1" in summary
    assert verdict({"a": "checked", "b": "unchecked:seed", "c": "unchecked:top_k"}, True)[0]
    ok, summary = verdict({"a": "checked", "b": "checked", "c": "unchecked:engine unavailable"}, False)
    assert not ok and "unavailable" in summary
    assert verdict({"a": "checked", "b": "failed"}, False)[0]  # failures fail through pytest itself


def test_list_engines_and_help(plugin_dir):
    out = run_conformance("--list-engines", pythonpath=[plugin_dir])
    assert out.returncode == 0, out.stderr
    for name in ("nanovllm", "hf", "hf-cb", "vllm", "openai", "llama-cpp", "toy"):
        assert f"\n{name} " in "\n" + out.stdout, (name, out.stdout)
    helped = run_conformance("--help")
    assert helped.returncode == 0
    for word in ("--adapter", "--allow-skips", "--list-engines", "--report", "examples:", ENTRY_POINT_GROUP):
        assert word in helped.stdout, word


def test_unavailable_engine_fails_the_run_and_says_so(plugin_dir, tmp_path):
    report = tmp_path / "missing.md"
    out = run_conformance(
        "--adapter", "toy_engine:Missing", "--report", str(report), "-k", "contracts", pythonpath=[plugin_dir]
    )
    assert out.returncode == 1, out.stdout[-2000:]
    assert "the engine is unavailable here" in out.stdout and "toy engine not installed here" in out.stdout
    text = report.read_text()
    assert "0 checked and passed" in text and "`engine unavailable` x" in text and "exit status 1" in text
    assert "--adapter toy_engine:Missing" in text  # the command line to paste back
    accepted = run_conformance(
        "--adapter", "toy_engine:Missing", "-k", "contracts", "--allow-skips", pythonpath=[plugin_dir]
    )
    assert accepted.returncode == 0, accepted.stdout[-2000:]


def test_example_adapter_passes_its_checks_and_a_wrong_engine_fails(tmp_path):
    """The adapter of WRITING_AN_ADAPTER.md against one zoo model; then the same engine with its
    tokens shifted by one (a wrong engine) must fail the same checks."""
    report = tmp_path / "naive.md"
    # one device: the counts below are per device (a CUDA host would run each check twice)
    out = run_conformance(
        "--adapter",
        "example_adapter:NaiveAdapter",
        "--report",
        str(report),
        "--device",
        "cpu",
        "-k",
        "llama-mha-hd64 and (greedy or prompt_logprobs)",
        pythonpath=[EXAMPLE_DIR],
    )
    assert out.returncode == 0, out.stdout[-3000:]
    assert "3 checked and passed, 0 failed, 0 unchecked" in report.read_text()
    (tmp_path / "wrong_engine.py").write_text(
        textwrap.dedent("""
        from example_adapter import NaiveAdapter

        class Wrong(NaiveAdapter):
            name = "wrong"

            def _one(self, prompt, p):
                r = super()._one(prompt, p)
                r.token_ids = [t + 1 for t in r.token_ids]
                return r
    """)
    )
    bad = run_conformance(
        "--adapter",
        "wrong_engine:Wrong",
        "--device",
        "cpu",
        "-k",
        "llama-mha-hd64 and greedy",
        pythonpath=[EXAMPLE_DIR, tmp_path],
    )
    assert bad.returncode == 1 and "2 failed" in bad.stdout, bad.stdout[-3000:]
