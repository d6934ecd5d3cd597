"""Conventions the test suite relies on, checked over its source.

Test engines take their arguments through ``engine_args(device, **kwargs)``: on CUDA it adds
defaults (the KV-cache share of the test process, a cap on sequences) unless the test sets them.
A call ``LLM(path, **engine_args(device), max_num_seqs=4)`` passes a key twice on CUDA only: a
TypeError that no CPU run can show (found by GPU CI). Every such call must pass its own keywords
inside ``engine_args(...)``.
"""

from __future__ import annotations

import ast
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
