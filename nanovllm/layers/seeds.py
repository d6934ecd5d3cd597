"""Seeds of the per-row random streams (plain Python: no Triton import for the CPU path)."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def mix_seed(a: int, b: int) -> int:
    """A 62-bit seed from two integers (splitmix64 finaliser): distinct (a, b) give
    unrelated Philox streams."""
    z = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 2
