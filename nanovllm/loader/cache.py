"""The on-disk cache (``$NANOVLLM_CACHE``, default ``~/.cache/nanovllm``): build a directory once.

``build_once`` is safe across processes (pytest-xdist workers, two engines): one process
builds into a temporary directory while the others wait on a file lock, and the result
appears under its final name by one atomic rename, so no reader sees half a directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("NANOVLLM_CACHE") or Path.home() / ".cache" / "nanovllm")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


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
