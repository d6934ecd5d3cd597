"""Small arithmetic shared by the core and the worker."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many size-``b`` pieces hold ``a`` items."""
    return -(-a // b)
