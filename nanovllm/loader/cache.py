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


def remembered_sha256(path: str | os.PathLike) -> str:
    """``sha256_file(path)``, remembered in the cache under the file's identity (its resolved
    path, device, inode, size and modification time in ns): a start-up reads a few bytes instead
    of hashing the whole file (the default GGUF: ~0.07 s). A file changed in place gets a new
    modification time, so a new identity and a new hash. Where the cache is not writable the
    file is hashed every time."""
    st = os.stat(path)
    identity = f"{os.path.realpath(path)}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
    memo = cache_root() / "sha256" / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.txt"
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = sha256_file(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, memo)  # readers see the whole digest or none
    except OSError:
        pass
    return digest


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
