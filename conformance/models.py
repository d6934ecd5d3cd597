"""Which local files a model directory stands for: an engine that serves one fixed model (a server)
or loads one format only (GGUF) is matched to the model a check asks for through these.

A check names an HF directory (a zoo model, or the default model converted from its GGUF file).
The converted directory records the GGUF it came from in ``nanovllm_source.json``
(``{"gguf": PATH}``); a directory may also hold the GGUF itself.
"""

from __future__ import annotations

import json
from pathlib import Path

SOURCE_RECORD = "nanovllm_source.json"


def gguf_source(model: str) -> str | None:
    """The GGUF file ``model`` is (a .gguf path), holds (exactly one), or was converted from."""
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.resolve())
    if not path.is_dir():
        return None
    record = path / SOURCE_RECORD
    if record.is_file():
        try:
            gguf = json.loads(record.read_text()).get("gguf")
        except (OSError, ValueError):
            gguf = None
        if gguf and Path(gguf).is_file():
            return str(Path(gguf).resolve())
    ggufs = sorted(path.glob("*.gguf"))
    return str(ggufs[0].resolve()) if len(ggufs) == 1 else None


def same_model(model: str, served: str) -> bool:
    """True when the model directory ``model`` and the file or directory ``served`` are one model."""
    a, b = Path(model).resolve(), Path(served).resolve()
    if a == b:
        return True
    ga, gb = gguf_source(str(a)), gguf_source(str(b))
    return ga is not None and ga == gb
