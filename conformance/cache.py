"""The suite's on-disk cache (``$CONFORMANCE_CACHE``, else ``$NANOVLLM_CACHE``, else
``~/.cache/nanovllm``): zoo models and other built files, each built once.

``build_once`` is safe across processes (pytest-xdist workers, engines in their own process):
one process builds into a temporary directory while the others wait on a file lock, and the
result appears under its final name by one atomic rename, so no reader sees half a directory.
The suite keeps its own copy of this small routine so that it imports nothing from the engine
it checks.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("CONFORMANCE_CACHE") or os.environ.get("NANOVLLM_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "nanovllm"


def build_once(dest: Path, marker: str, build: Callable[[Path], None]) -> str:
    """``dest`` once ``dest/marker`` exists; otherwise ``build(tmp_dir)`` and rename it to ``dest``."""
    if (dest / marker).is_file():
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / marker).is_file():
            tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
            try:
                build(tmp)
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)
