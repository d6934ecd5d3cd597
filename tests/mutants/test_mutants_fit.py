"""Every mutant of the table still fits the code it edits (seconds, in the CPU suite).

Source-edit mutants copy a function with an ``(old, new)`` edit; when the code changes (a refactor,
the formatter) the edit may no longer match, and that mutant would fail to apply only when the
slow table runs. Entering and leaving each mutant's patch here finds that at once.
"""

from __future__ import annotations

from tests.mutants.runner import registry


def test_every_mutant_applies_and_restores():
    broken = []
    for name, mutant in registry().items():
        try:
            with mutant.make():
                pass
        except Exception as e:  # noqa: BLE001 - each mutant's own error is the report
            broken.append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
    assert not broken, "mutants that no longer fit the code:\n" + "\n".join(broken)


def test_every_entry_names_its_own_mutant_and_lists_checks():
    """An entry whose patch is another mutant's, or whose checks are not node ids, breaks the
    table only when it runs (a GPU-only entry: only on the GPU host)."""
    wrong = [
        name
        for name, m in registry().items()
        if m.make.__name__ != name or not isinstance(m.checks, list) or not all(isinstance(c, str) for c in m.checks)
    ]
    assert not wrong, f"registry entries with another mutant's patch or bad checks: {wrong}"
