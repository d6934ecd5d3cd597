"""The layout's promise: the core, the engine loop, SamplingParams and EngineConfig import no torch
(nor do the property tests' fake executor and harness, which run that engine loop).

For each module, a fresh interpreter runs ``import <module>, sys; assert 'torch' not in
sys.modules`` (a module imported in this process would find torch loaded already by others).
Every module of ``nanovllm/core/`` is checked, found on disk, so a new one is covered too.
Negative control: a worker module, which imports torch, is reported.
"""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ["nanovllm.core"] + [f"nanovllm.core.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "nanovllm" / "core")])]
TORCH_FREE = CORE + ["nanovllm.engine.engine", "nanovllm.sampling_params", "nanovllm.config"]
# the property tests' fake executor and harness run the real engine loop without torch, too
TORCH_FREE_TESTS = ["tests.properties.fake_runner", "tests.properties.harness"]
# the fast core tests (tests/core/, what mutmut runs per mutant) run without torch too
TORCH_FREE_TESTS += [f"tests.core.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "tests" / "core")])]


def _import_check(module: str) -> str | None:
    """None when importing ``module`` in a fresh interpreter loads no torch, else why it failed."""
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch imported'"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def torch_importers(modules: list[str]) -> dict[str, str]:
    """module -> the failure (``AssertionError: torch imported``, or an import error) for each
    module whose import in a fresh interpreter fails or loads torch."""
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(modules, pool.map(_import_check, modules)))
    return {m: why for m, why in results.items() if why is not None}


def test_core_modules_found():
    """The list is read from disk: it must hold the core's known modules (else the check is vacuous)."""
    for module in (
        "nanovllm.core.scheduler",
        "nanovllm.core.block_manager",
        "nanovllm.core.sequence",
        "nanovllm.core.model_input",
        "nanovllm.core.stop",
    ):
        assert module in CORE, f"{module} not found under nanovllm/core/: {CORE}"


def test_core_and_engine_loop_import_no_torch():
    assert torch_importers(TORCH_FREE + TORCH_FREE_TESTS) == {}


def test_negative_torch_importer_is_reported():
    """A module known to import torch is reported, and for loading torch (not for an import error)."""
    reported = torch_importers(["nanovllm.worker.model_runner"])
    assert reported == {"nanovllm.worker.model_runner": "AssertionError: torch imported"}
