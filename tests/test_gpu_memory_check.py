"""The start-up check of gpu_memory_utilization counts the memory this process's CUDA caching
allocator holds but no tensor uses as free (an engine closed earlier in this process: benchmark
repeats, a notebook that makes a second LLM). Without that, `nanovllm bench --repeat 3` on an H200
refused its second engine: "only 16.5 GiB are free (other processes or engines hold 123.3 GiB)".

Runs on the CPU: torch.cuda's memory queries are replaced by a scripted device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanovllm.worker.model_runner import ModelRunner

GIB = 2**30


def _check(monkeypatch, free_gib, reserved_gib, allocated_gib, fraction=0.9, total_gib=140):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (free_gib * GIB, total_gib * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: reserved_gib * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: allocated_gib * GIB)
    runner = SimpleNamespace(
        config=SimpleNamespace(kv_cache_memory_gib=None, num_kvcache_blocks=None, gpu_memory_utilization=fraction),
        device=torch.device("cuda:0"),
    )
    return ModelRunner._check_gpu_memory(runner)  # type: ignore[arg-type]


def test_a_closed_engines_cached_memory_counts_as_free(monkeypatch):
    # the previous engine's 123 GiB sit in this process's allocator, unused: the next engine starts
    _check(monkeypatch, free_gib=16.5, reserved_gib=123.3, allocated_gib=0.5)


def test_memory_in_use_still_refuses(monkeypatch):
    # negative control: the same numbers with the memory in use by live tensors are refused
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 asks for 126.0 GiB .* only 16.5 GiB are free"):
        _check(monkeypatch, free_gib=16.5, reserved_gib=123.3, allocated_gib=123.3)


def test_closing_a_cuda_executor_waits_for_the_device_before_freeing(monkeypatch):
    """LocalExecutor.close on CUDA synchronizes the device before it frees the KV cache and the
    weights (a step launched and then interrupted may still be running). Scripted runner: the
    order of calls is what is checked; control: a CPU runner frees the same without synchronizing
    or emptying a device cache."""
    from nanovllm.worker.local_executor import LocalExecutor

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    for device in ("cuda", "cpu"):
        calls.clear()
        executor = LocalExecutor.__new__(LocalExecutor)
        executor.runner = SimpleNamespace(
            device=torch.device(device),
            free_kv_cache=lambda: calls.append("free_kv_cache"),
            release=lambda: calls.append("release"),
        )
        executor.close()
        if device == "cuda":
            assert calls == ["synchronize", "free_kv_cache", "release", "empty_cache"], calls
        else:
            assert calls == ["free_kv_cache", "release"], calls
