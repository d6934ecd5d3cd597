"""The conformance suite is engine-agnostic: outside its nanovllm adapter, no module of
``conformance/`` imports nanovllm (statically, or through importlib / __import__ with a literal)."""

from __future__ import annotations

import ast
from pathlib import Path

import conformance

SUITE = Path(conformance.__file__).resolve().parent
ALLOWED = {SUITE / "adapters" / "nanovllm_adapter.py"}


def nanovllm_imports(source: str, filename: str = "<source>") -> list[str]:
    """'line N: what' for every import of nanovllm in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"line {node.lineno}: {n}" for n in names if n == "nanovllm" or n.startswith("nanovllm.")]
    return found


def test_scanner_finds_every_form_of_import():
    """Negative control: each way of importing nanovllm is caught; look-alike names are not."""
    bad = (
        "import nanovllm\nimport os, nanovllm.engine as e\nfrom nanovllm.loader.cache import x\n"
        "def f():\n    import importlib\n    importlib.import_module('nanovllm.worker')\n"
        "    __import__('nanovllm')\n"
    )
    assert len(nanovllm_imports(bad)) == 5, nanovllm_imports(bad)
    fine = "import nanovllm_extras\nfrom conformance.adapters import base\nx = 'import nanovllm'\n"
    assert nanovllm_imports(fine) == []


def test_conformance_imports_no_nanovllm_outside_its_adapter():
    files = sorted(p for p in SUITE.rglob("*.py") if p not in ALLOWED)
    assert len(files) > 10, f"only {len(files)} modules found under {SUITE}: wrong directory?"
    offenders = {str(p.relative_to(SUITE)): hits for p in files if (hits := nanovllm_imports(p.read_text(), str(p)))}
    assert not offenders, f"conformance/ modules importing nanovllm: {offenders}"
    # the allowed adapter really is the one that imports it (else ALLOWED is stale)
    assert all(nanovllm_imports(p.read_text()) for p in ALLOWED)
