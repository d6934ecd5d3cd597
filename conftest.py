"""Shared pytest setup: hypothesis profiles, one GPU per xdist worker, markers' skips."""
from __future__ import annotations

import os

import pytest

# On a GPU host each xdist worker takes one GPU (gw0 -> GPU 0, gw1 -> GPU 1, ...),
# set before torch initialises CUDA. Multi-GPU tests need the whole machine: run
# them with `-m multi_gpu -p no:xdist` or `--dist loadgroup` (they carry xdist_group("multi_gpu")).
_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _worker and "CUDA_VISIBLE_DEVICES" not in os.environ and os.environ.get("NANOVLLM_GPU_PER_WORKER", "1") == "1":
    try:
        import subprocess
        n = int(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
                .stdout.count("GPU "))
    except (OSError, subprocess.SubprocessError, ValueError):
        n = 0
    if n > 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(_worker.removeprefix("gw")) % n)

# xdist workers share the cores: give each its share of threads (OpenMP spin-waits make
# oversubscription far slower than the core count suggests).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    _threads = str(max(1, (os.cpu_count() or 1) // _workers))
    os.environ["OMP_NUM_THREADS"] = _threads
    os.environ.setdefault("MKL_NUM_THREADS", _threads)

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("quick", max_examples=30, stateful_step_count=30, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("conformance", max_examples=300, stateful_step_count=80, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))
except ImportError:  # hypothesis is a test dependency
    pass


def pytest_collection_modifyitems(config, items):
    import torch

    # slow checks (regenerating golden files, the whole mutant table) take many minutes: they run
    # when asked for (-m slow, or NANOVLLM_SLOW=1), not in every pytest run
    if "slow" not in (config.option.markexpr or "") and os.environ.get("NANOVLLM_SLOW") != "1" \
            and os.environ.get("CONFORMANCE_SLOW") != "1":
        later = pytest.mark.skip(reason="slow check: run with -m slow or NANOVLLM_SLOW=1")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(later)

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("gpu") and n_gpu < 1:  # markers, not keywords: tests/gpu/ is a keyword
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
        if item.get_closest_marker("multi_gpu") and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, {n_gpu} visible"))
