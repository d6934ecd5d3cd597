"""Every conformance check that runs the engine is run against a wrong engine, and fails.

A check that no wrong engine ever meets can lose its teeth (a flipped sign, a value compared with
itself) and still pass a right engine: two such edits once survived the whole test suite.
``tests/conformance_faults.py`` holds faulty nanovllm adapters (one bug each) and the registry
``CONTROLS`` (check -> the faults it must catch) with ``EXEMPT`` (checks that cannot be controlled
on a CPU, and why). Here:

- fast: every check that takes the ``engines`` fixture (as the suite's plugin counts them,
  ``conformance.plugin.uses_engine``) is in the registry, and the registry names no check that is
  gone;
- slow: each fault, in one ``python -m conformance --adapter conformance_faults:<Fault>`` run over
  its checks, fails every one of them (read from the ``--report`` table), with the expected words;
  the plain nanovllm adapter passes the same selection, so a fault "caught" is not a broken check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import conformance_faults as cf
from tests.test_conformance_tool import ROOT, run_conformance

TESTS_DIR = Path(__file__).resolve().parent
ROW = re.compile(r"^\| (test_\w+)::(test_\w+)(\[[^\]]*\])? \| (pass|FAIL|ERROR|skip) \| (.*) \| [\d.]+ \|$", re.M)
LACKS = re.compile(r"lacks capability (\w+)")
FAILURE = re.compile(r"^- \*\*test_\w+::(test_\w+)(?:\[[^\]]*\])?\*\*: (.*)$", re.M)

# a pytest plugin that prints, for each collected check of the suite, whether it runs the engine
LISTER = """
from conformance.plugin import in_suite, uses_engine

def pytest_collection_finish(session):
    for item in session.items:
        if in_suite(item):
            print("CHECK", item.originalname, uses_engine(item))
"""


def engine_checks(tmp_path: Path) -> set[str]:
    """The check functions of ``conformance/`` that run the engine, as the suite's plugin sees them
    (a subprocess: a second pytest session in this one would reset the plugin's state)."""
    (tmp_path / "engine_check_lister.py").write_text(LISTER)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
        + ["-p", "engine_check_lister", "conformance", "--device", "cpu"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    found = re.findall(r"^CHECK (\w+) (True|False)$", out.stdout, re.M)
    assert found, out.stdout[-2000:]
    return {name for name, engine in found if engine == "True"}


def test_every_engine_check_has_a_control_or_an_exemption(tmp_path):
    checks = engine_checks(tmp_path)
    assert len(checks) > 30, f"only {len(checks)} engine-using checks collected: the lister is broken"
    assert not cf.missing(checks), (
        f"checks without a wrong-engine control: {cf.missing(checks)}; add a fault and a CONTROLS entry "
        "to tests/conformance_faults.py (or an EXEMPT reason where no CPU run can control it)"
    )
    stale = sorted((set(cf.CONTROLS) | set(cf.EXEMPT)) - checks)
    assert not stale, f"tests/conformance_faults.py names checks that are gone or no longer run the engine: {stale}"
    assert not set(cf.CONTROLS) & set(cf.EXEMPT), "a check is both controlled and exempt"
    # negative control: a check the registry does not know is reported, by name
    assert cf.missing(checks | {"test_fake_check_nobody_controls"}) == ["test_fake_check_nobody_controls"]


def test_every_control_names_a_fault_and_selects_its_check():
    known = cf.faults()
    for check, controls in cf.CONTROLS.items():
        assert controls, f"{check}: no control"
        for c in controls:
            assert c.fault in known, f"{check}: unknown fault {c.fault!r}"
            assert check in c.k, f"{check}: its -k expression {c.k!r} does not name it"
            assert known[c.fault].__doc__, f"{c.fault}: say which bug it models"
    unused = sorted(set(known) - {c.fault for controls in cf.CONTROLS.values() for c in controls})
    assert not unused, f"faults no check is controlled by: {unused}"
    for name, gap in cf.GAPS.items():
        assert name == gap.fault and issubclass(getattr(cf, name), cf.Fault) and name not in known and gap.expect, (
            f"GAPS[{name!r}]: a fault class, a -k, why"
        )


def lacking_here() -> set[str]:
    """Capabilities plain nanovllm lacks on this host (batch_invariant without AVX-512 or on a CUDA
    host, cuda_graph without a GPU): a check that needs one is skipped by the fault and the plain
    engine alike, and cannot be controlled here."""
    from conformance.adapters.base import Capability
    from conformance.adapters.nanovllm_adapter import NanovllmAdapter

    return {c.value for c in Capability} - {c.value for c in NanovllmAdapter().capabilities}


def report_rows(report: Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """({check function: results of its rows}, {check function: failure messages}) of a report.
    A row skipped for a capability that nanovllm lacks on this host reads "lacking"."""
    text = report.read_text()
    lacking = lacking_here()
    rows: dict[str, list[str]] = {}
    for _module, check, _param, result, figure in ROW.findall(text):
        skipped_for = LACKS.search(figure) if result == "skip" else None
        rows.setdefault(check, []).append("lacking" if skipped_for and skipped_for[1] in lacking else result)
    messages: dict[str, list[str]] = {}
    for check, message in FAILURE.findall(text):
        messages.setdefault(check, []).append(message)
    return rows, messages


def test_report_rows_are_read_per_check(tmp_path, monkeypatch):
    """The parser above against the report's format (conformance/__main__.py write_report): a skip
    for a capability nanovllm lacks on this host is told apart from any other skip."""
    monkeypatch.setattr(sys.modules[__name__], "lacking_here", lambda: {"batch_invariant"})
    report = tmp_path / "r.md"
    report.write_text(
        textwrap.dedent("""\
        | check | result | key figure | seconds |
        | --- | --- | --- | --- |
        | test_reference::test_greedy_matches_reference[llama-mha-hd64] | FAIL | exact: 3/11 | 0.5 |
        | test_contracts::test_stop_token_ids | pass |  | 0.1 |
        | test_self_consistency::test_batch_invariance_of_logprobs | skip | engine f lacks capability batch_invariant | 0.0 |
        | test_sampling::test_seed_zero_is_a_seed | skip | engine f lacks capability seed | 0.0 |

        ## Failures

        - **test_reference::test_greedy_matches_reference[llama-mha-hd64]**: AssertionError: 8 failed
        """)
    )
    rows, messages = report_rows(report)
    assert rows == {
        "test_greedy_matches_reference": ["FAIL"],
        "test_stop_token_ids": ["pass"],
        "test_batch_invariance_of_logprobs": ["lacking"],
        "test_seed_zero_is_a_seed": ["skip"],
    }
    assert messages == {"test_greedy_matches_reference": ["AssertionError: 8 failed"]}


def run_selection(adapter: str, k: str, report: Path) -> subprocess.CompletedProcess:
    return run_conformance(
        "--adapter", adapter, "--report", str(report), "--check-timeout", "300", "-k", k, pythonpath=[TESTS_DIR]
    )


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(cf.faults()))
def test_fault_fails_every_check_it_controls(fault, tmp_path):
    """One run of the faulty engine over its checks: exit 1, and each check failed, for the bug."""
    want = cf.checks_of(fault)
    report = tmp_path / f"{fault}.md"
    out = run_selection(f"conformance_faults:{fault}", cf.selection(fault), report)
    log = out.stdout[-3000:] + out.stderr[-2000:]
    assert report.is_file(), log
    rows, messages = report_rows(report)
    assert set(rows) == set(want), f"the -k selection ran {sorted(rows)}, the registry lists {sorted(want)}"
    here = {check: results for check, results in rows.items() if results != ["lacking"] * len(results)}
    if not here:
        pytest.skip(f"nanovllm lacks a capability these checks need on this host: {sorted(rows)}")
    passed = sorted(check for check, results in here.items() if results != ["FAIL"] * len(results))
    assert not passed, f"fault {fault} was NOT caught by {passed} (results {rows}): the check lost its teeth"
    for check in here:
        expect = want[check]
        assert any(expect in m for m in messages.get(check, [])), (
            f"{check} failed under {fault}, but not for the injected bug (no {expect!r}): {messages.get(check)}"
        )
    assert out.returncode == 1, log


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(cf.GAPS) or [None])
def test_known_gaps_are_still_gaps(fault, tmp_path):
    """Findings: a fault that no check catches today passes its checks (see GAPS). When this fails,
    a check has learned to catch it: move it from GAPS to CONTROLS."""
    if fault is None:
        pytest.skip("no known gap: every fault of tests/conformance_faults.py is a control of some check")
    gap = cf.GAPS[fault]
    report = tmp_path / f"{fault}.md"
    out = run_selection(f"conformance_faults:{fault}", gap.k, report)
    rows, messages = report_rows(report)
    assert rows and all(set(r) <= {"pass", "lacking"} for r in rows.values()), (
        f"{fault} is caught now ({rows}: {messages}): move it from GAPS to CONTROLS"
    )
    assert out.returncode == 0, out.stdout[-3000:]


@pytest.mark.slow
def test_plain_engine_passes_every_controlled_check(tmp_path):
    """Positive control: nanovllm without a fault passes every selection the faults fail."""
    report = tmp_path / "plain.md"
    out = run_selection("conformance.adapters.nanovllm_adapter:NanovllmAdapter", cf.selection(), report)
    rows, messages = report_rows(report)
    assert set(rows) == set(cf.CONTROLS), f"missing from the run: {sorted(set(cf.CONTROLS) - set(rows))}"
    bad = {check: results for check, results in rows.items() if not set(results) <= {"pass", "lacking"}}
    assert not bad, f"the plain engine does not pass {bad}: {messages}"
    assert out.returncode == 0, out.stdout[-3000:]
