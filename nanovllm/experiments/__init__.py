"""The study course's experiments 01-07, runnable: ``nanovllm experiment 03`` (or a name).

Each module defines NUMBER, NAME, TITLE, LOOK_FOR (what to watch, not what to conclude),
SWEPT (engine arguments it sets itself), ``Shape`` with SHAPES["cpu"] (about a minute on a
laptop CPU with the default model) and SHAPES["gpu"] (chosen on CUDA), ``engine_args(shape)``
and ``run(llm, shape, report)``, which measures, prints a table and its results (computed from
the data), and writes CSV and PNG files. ``runner.run_experiment`` ties them together.
"""

from __future__ import annotations

import importlib

MODULES = {
    "01": "e01_input_length",
    "02": "e02_output_length",
    "03": "e03_batch_scaling",
    "04": "e04_scheduler_watch",
    "05": "e05_kv_pressure",
    "06": "e06_config_sweep",
    "07": "e07_mixed_batch",
}


def load(key: str):
    """The experiment module for a number ("3", "03") or a name ("batch-scaling")."""
    key = str(key).strip().lower()
    if key.isdigit():
        key = key.zfill(2)
    if key in MODULES:
        return importlib.import_module(f"nanovllm.experiments.{MODULES[key]}")
    for mod_name in MODULES.values():
        mod = importlib.import_module(f"nanovllm.experiments.{mod_name}")
        if key in (mod.NAME, mod_name):
            return mod
    names = ", ".join(f"{n} ({importlib.import_module(f'nanovllm.experiments.{m}').NAME})" for n, m in MODULES.items())
    raise ValueError(f"experiment {key!r} is not known; choose one of {names}, or 'all'")
