"""``pytest -n auto`` on a GPU host takes at most one worker per 8.5 GiB of GPU memory (the root
conftest's ``pytest_xdist_auto_num_workers``): 16 workers on an 80 GB H100 ran 14 CUDA checks out of
memory (2026-12-05), 9 passed there, and 16 pass on a 141 GB H200. Checked here without a GPU, on
the hook itself, with the device's memory and the cores patched."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

import conformance.plugin


@pytest.fixture
def hook(monkeypatch):
    root = sys.modules.get("conftest")
    if root is None or not hasattr(root, "pytest_xdist_auto_num_workers"):
        pytest.skip("the repository's root conftest.py is not loaded as 'conftest' (run pytest from the repository)")
    device = SimpleNamespace(total_memory=0, gpus=1)
    monkeypatch.setattr(root, "_cuda_devices", lambda: device.gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: device)
    monkeypatch.setattr(conformance.plugin, "usable_cores", lambda: 16)

    def workers(gib: float, gpus: int = 1):
        device.total_memory, device.gpus = int(gib * 2**30), gpus
        return root.pytest_xdist_auto_num_workers(None)

    return workers


def test_workers_follow_gpu_memory(hook):
    assert hook(79.2) == 9  # an H100 80 GB: what passed there
    assert hook(139.8) == 16  # an H200: the cores are the limit
    assert hook(79.2, gpus=2) == 16  # two H100s: 18 by memory, 16 cores
    assert hook(4.0) == 1  # a small GPU still gets one worker


def test_no_gpu_leaves_the_count_to_xdist(hook):
    assert hook(79.2, gpus=0) is None


def test_the_old_count_is_refused_on_an_h100(hook):
    """Control: the count that ran out of memory (one worker per core, 16) is not what an H100 gets."""
    assert hook(79.2) < 16
