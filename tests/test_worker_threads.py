"""Test processes share the machine's cores: under pytest-xdist each worker's torch uses its share
of the threads (oversubscribed OpenMP pools made the suite several times slower, on this machine
and on a 16-core GPU host), and its subprocesses inherit the same share."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conformance.plugin import usable_cores

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
needs_xdist = pytest.mark.skipif(WORKERS < 2, reason="checks pytest-xdist's thread sharing: run under -n 2 or more")


@needs_xdist
def test_torch_threads_are_this_workers_share():
    cores = usable_cores()
    share = int(os.environ["OMP_NUM_THREADS"])
    assert torch.get_num_threads() == share, (
        f"torch uses {torch.get_num_threads()} threads, OMP_NUM_THREADS says {share}"
    )
    if cores >= WORKERS:
        assert share * WORKERS <= cores, f"{WORKERS} workers x {share} threads on {cores} cores"


@needs_xdist
def test_subprocesses_inherit_the_share():
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert int(out) == int(os.environ["OMP_NUM_THREADS"])
