"""The benchmarks' --json-out files: strict JSON, which every parser reads. Python's json writes a
float infinity or NaN as ``Infinity``/``NaN``, which JSON does not have (``bench serve``'s default
request rate, infinity, made files that JSON.parse refused); they are written as the strings
"inf", "-inf" and "nan", as vLLM's benchmarks write an infinite request rate."""

from __future__ import annotations

import json
import math


def finite(value):
    """``value`` with every non-finite float inside it (dicts, lists, tuples) as a string."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(finite(obj), f, indent=1, allow_nan=False)
        f.write("\n")
