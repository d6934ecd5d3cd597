"""The Triton kernel tests on a CPU, through Triton's interpreter (no GPU needed).

TRITON_INTERPRET must be set before triton is imported, so the kernel tests run
in a subprocess with a small grid (test_triton_kernels.py, interpreter mode).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(_cuda(), reason="a CUDA host runs these kernel tests on the GPU itself (tests/gpu)")
def test_kernels_under_triton_interpreter():
    here = Path(__file__).resolve().parent
    env = dict(os.environ, TRITON_INTERPRET="1", NANOVLLM_TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-rs",
            str(here / "test_triton_kernels.py"),
            str(here / "test_fused_ops.py"),
            str(here / "test_fused_sampler.py"),
            str(here / "test_decode_gemm.py"),
        ],
        cwd=here.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert "passed" in tail and "skipped" not in tail, tail
