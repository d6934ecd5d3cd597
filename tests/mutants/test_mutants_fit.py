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


def test_a_replacement_must_take_every_call_the_original_takes():
    """Negative control of ``check_signature`` (run by every ``_patched``): a wrapper with fewer
    parameters than the function it replaces, or other names for them, is refused; a wrapper that
    passes extra positional and keyword arguments through is accepted."""
    import types

    import pytest

    from tests.mutants.core import _patched, check_signature

    def orig(q, k, v, meta, scale, k_scale=1.0, v_scale=1.0, *, head_major=False):
        return q

    def too_few(q, k, v, meta, scale):
        return q

    def renamed(q, k, v, meta, scale, ks=1.0, vs=1.0, *, head_major=False):
        return q

    def passes_through(q, k, v, meta, scale, *args, **kwargs):
        return q

    check_signature(orig, passes_through, "m.orig")
    for bad in (too_few, renamed):
        with pytest.raises(AssertionError, match="does not take the calls"):
            check_signature(orig, bad, "m.orig")
    module = types.SimpleNamespace(orig=orig, __name__="m")
    with pytest.raises(AssertionError, match="m.orig"):
        with _patched((module, "orig", too_few)):
            pass
    assert module.orig is orig, "a refused patch must leave the original in place"
