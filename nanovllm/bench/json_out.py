"""The benchmarks' --json-out files: strict JSON, which every parser reads. Python's json writes a
float infinity or NaN as ``Infinity``/``NaN``, which JSON does not have (``bench serve``'s default
request rate, infinity, made files that JSON.parse refused); they are written as the strings
"inf", "-inf" and "nan", as vLLM's benchmarks write an infinite request rate.

Every mode's file has the same layout: ``meta`` (``run_meta``: the same keys in every mode), the
mode's own settings at the top level, and ``results``, a list of rows."""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys

META_KEYS = ("mode", "date", "host", "device", "nanovllm_version", "argv", "engine_args")


def device_name(device: str) -> str:
    """``cuda`` as the GPU's name (``NVIDIA H200``), ``cpu`` as the processor's model name
    (/proc/cpuinfo's, where ``platform.processor()`` says only ``x86_64`` or nothing)."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def run_meta(mode: str, engine_args: dict, device: str | None) -> dict:
    """What ran, where and when: the ``meta`` block of every --json-out file. ``device`` is the
    engine's device (``cuda``, ``cpu``), written as its name; None where the bench cannot know it
    (``bench serve``: the server may be on another machine)."""
    from nanovllm import __version__

    meta = {
        "mode": mode,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": None if device is None else device_name(device),
        "nanovllm_version": __version__,
        "argv": sys.argv,
        "engine_args": engine_args,
    }
    assert tuple(meta) == META_KEYS
    return meta


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
