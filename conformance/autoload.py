"""The suite's pytest11 entry point: loads ``conformance.plugin`` only into runs of the suite.

An installed nanovllm would otherwise put the plugin's options (--engine, --device, --block-size,
...) into every pytest run of the environment, and a project whose conftest.py adds an option of
the same name would fail to start ("option dest 'device' already used"). This module adds no
option, fixture or hook of its own beyond the one below: it loads the plugin when the command
line names the suite (``--pyargs conformance``, a path inside the installed package) or pytest
starts inside the suite's directory. ``-p conformance.plugin`` loads it in any other case
(``python -m conformance`` passes it; the repository's conftest.py names it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

SUITE_DIR = Path(__file__).resolve().parent


def targets_suite(args: list[str], pyargs: bool, invocation_dir: Path) -> bool:
    """Whether pytest's positional arguments (or, without any, its starting directory) name the suite."""
    for arg in args:
        target = str(arg).split("::")[0]
        if pyargs and (target == "conformance" or target.startswith("conformance.")):
            return True
        path = (invocation_dir / target).resolve()
        if path == SUITE_DIR or SUITE_DIR in path.parents:
            return True
    here = invocation_dir.resolve()
    return not args and (here == SUITE_DIR or SUITE_DIR in here.parents)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    ns = early_config.known_args_namespace
    if targets_suite(ns.file_or_dir or [], ns.pyargs, early_config.invocation_params.dir):
        early_config.pluginmanager.import_plugin("conformance.plugin")
