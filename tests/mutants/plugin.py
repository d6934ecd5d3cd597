"""pytest plugin of the mutant runner: ``-p tests.mutants.plugin --mutant NAME``.

Switches one named bug on in nanovllm for the whole pytest run (TP workers included, through
``NANOVLLM_MUTANT``) and skips hypothesis's shrinking: under a mutant only *whether* a check
fails matters. The conformance suite knows nothing of mutants; this plugin is nanovllm's.
"""

from __future__ import annotations

import os


def pytest_addoption(parser):
    parser.getgroup("nanovllm mutants").addoption(
        "--mutant",
        default=os.environ.get("NANOVLLM_MUTANT") or None,
        help="activate one named nanovllm mutant for the run (see python -m tests.mutants.runner --list)",
    )


def _no_shrinking() -> None:
    try:
        from hypothesis import Phase, settings
    except ImportError:
        return
    settings.register_profile(
        "mutant-run", settings(settings.default, phases=[Phase.explicit, Phase.reuse, Phase.generate])
    )
    settings.load_profile("mutant-run")


def pytest_configure(config):
    name = config.getoption("--mutant", default=None)
    if name:
        from tests.mutants.runner import activate

        _no_shrinking()
        cm = activate(name)
        cm.__enter__()
        config._nanovllm_mutant = cm


def pytest_unconfigure(config):
    cm = getattr(config, "_nanovllm_mutant", None)
    if cm is not None:
        cm.__exit__(None, None, None)


def pytest_report_header(config):
    mutant = config.getoption("--mutant", default=None)
    return f"MUTANT: {mutant}" if mutant else None
