"""The suite's pytest plugin enters only runs of the suite: a project with its own ``--device``
option still starts in an environment where nanovllm (and so the suite) is installed.

The environment is the one a wheel built from this pyproject.toml leaves: a driver replaces the
installed nanovllm's entry points with those pyproject.toml declares (an editable install keeps
the entry points of the day it was made), then runs pytest in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from conformance.autoload import SUITE_DIR, targets_suite

ROOT = Path(__file__).resolve().parent.parent

DRIVER = """
import importlib.metadata as md, sys

fake = md.PathDistribution.at(sys.argv[1])
real = md.distributions
md.distributions = lambda **kw: [d for d in real(**kw) if (d.metadata or {}).get("Name") != "nanovllm"] + [fake]
import pytest

sys.exit(pytest.main(sys.argv[2:]))
"""


def pytest_with_entry_points(tmp_path: Path, entry_points: dict[str, str], cwd: Path, *args: str):
    dist = tmp_path / "nanovllm-0.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nanovllm\nVersion: 0.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (dist / "entry_points.txt").write_text(f"[pytest11]\n{lines}")
    (tmp_path / "driver.py").write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for var in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_XDIST_WORKER"):
        env.pop(var, None)
    cmd = [sys.executable, str(tmp_path / "driver.py"), str(dist), "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def foreign_project(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "conftest.py").write_text(
        textwrap.dedent("""
        def pytest_addoption(parser):
            parser.addoption("--device", default="cpu")
            parser.addoption("--engine", default="v8")
        """)
    )
    (proj / "test_mine.py").write_text(
        "def test_device(request):\n    assert request.config.getoption('--device') == 'tpu'\n"
    )
    return proj


def declared_entry_points() -> dict[str, str]:
    """pyproject.toml's [project.entry-points.pytest11] table (its "name" = "module" lines)."""
    table = (ROOT / "pyproject.toml").read_text().split("[project.entry-points.pytest11]\n", 1)[1].split("\n[", 1)[0]
    found = dict(re.findall(r'^"?([\w.-]+)"?\s*=\s*"([\w.:]+)"', table, re.M))
    assert found, "no pytest11 entry point in pyproject.toml"
    return found


def test_a_project_with_its_own_device_option_starts(tmp_path):
    proj = foreign_project(tmp_path)
    out = pytest_with_entry_points(tmp_path, declared_entry_points(), proj, "--device", "tpu")
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr


def test_control_the_plugin_itself_as_entry_point_breaks_that_project(tmp_path):
    """The old entry point (the plugin loaded into every run): the same project fails to start."""
    proj = foreign_project(tmp_path)
    out = pytest_with_entry_points(tmp_path, {"conformance.plugin": "conformance.plugin"}, proj, "--device", "tpu")
    # "option dest 'device' already used", or the plugin's --device refusing the project's value
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "1 passed" not in text and "device" in text, text


def test_the_suite_still_gets_its_options_through_the_entry_point(tmp_path):
    """pytest --pyargs conformance from elsewhere: --list-engines is the plugin's option."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = pytest_with_entry_points(
        tmp_path, declared_entry_points(), elsewhere, "--pyargs", "conformance", "--list-engines"
    )
    assert out.returncode == 0 and "\nnanovllm " in "\n" + out.stdout, out.stdout + out.stderr


def test_which_runs_are_the_suites(tmp_path):
    assert targets_suite(["conformance"], True, tmp_path)
    assert targets_suite(["conformance.test_rules"], True, tmp_path)
    assert targets_suite([f"{SUITE_DIR}/test_rules.py::test_bitwise_rule_rejects_one_token"], False, tmp_path)
    assert targets_suite([], False, SUITE_DIR)
    assert not targets_suite(["conformance"], False, tmp_path)  # a directory of that name here, not the package
    assert not targets_suite(["tests", "conformance_extra"], True, tmp_path)
    assert not targets_suite([], False, tmp_path)
