"""A child process that must not outlive its parent (engine core, tensor-parallel workers)."""

from __future__ import annotations

import os
import threading
import time


def exit_with_parent(parent_pid: int) -> None:
    """Leave (exit status 1) once the parent is gone, even if the child is stuck elsewhere."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def watch_parent(parent_pid: int) -> None:
    threading.Thread(target=exit_with_parent, args=(parent_pid,), name="nanovllm-lifeline", daemon=True).start()
