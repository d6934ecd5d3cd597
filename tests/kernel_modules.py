"""Every module of the package that defines a Triton kernel, found by its source: a kernel added in a
new module is checked by the tests that walk them (PDL placement, alignment specialisation) without
anyone listing it. Only those modules are imported."""

from __future__ import annotations

import importlib
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "nanovllm"


def kernel_modules() -> tuple:
    return tuple(
        importlib.import_module(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "triton.jit" in path.read_text()
    )
