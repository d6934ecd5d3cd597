"""The kernel switches: on a CUDA tensor a kernel family runs unless its environment switch is "0";
Qwen3's fused q/k norm + RoPE (``models.llama.fused_qk``) needs both its own switch and the fused
elementwise ops' one. A stand-in object plays the CUDA tensor (only ``is_cuda`` is read)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("triton", reason="the switches answer False without triton")

from nanovllm.models.llama import fused_qk  # noqa: E402

CUDA = types.SimpleNamespace(is_cuda=True)


@pytest.mark.parametrize(
    "env,enabled",
    [({}, True), ({"NANOVLLM_FUSED_QK_ROPE": "0"}, False), ({"NANOVLLM_FUSED_OPS": "0"}, False)],
)
def test_fused_qk_rope_switches(monkeypatch, env, enabled):
    for name in ("NANOVLLM_FUSED_QK_ROPE", "NANOVLLM_FUSED_OPS", "NANOVLLM_TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert fused_qk.enabled(CUDA) is enabled


def test_a_cpu_tensor_takes_no_kernel_outside_the_interpreter(monkeypatch):
    import torch

    monkeypatch.delenv("NANOVLLM_TRITON_INTERPRET", raising=False)
    assert fused_qk.enabled(torch.zeros(1)) is False


@pytest.mark.parametrize("value,expected", [(None, "8"), ("0", "None"), ("1", "8")])
def test_the_mixed_step_split_is_on_unless_turned_off(value, expected):
    """NANOVLLM_MIXED_DECODE_SPLIT: on by default and at "1", off at "0" (read at import, so each
    case in a fresh interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "NANOVLLM_MIXED_DECODE_SPLIT"}
    if value is not None:
        env["NANOVLLM_MIXED_DECODE_SPLIT"] = value
    out = subprocess.run(
        [sys.executable, "-c", "from nanovllm.attention import triton_backend as b; print(b.MIN_SPLIT_DECODES)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == expected, out.stdout + out.stderr


@pytest.mark.parametrize("value,expected", [(None, "False"), ("0", "False"), ("1", "True")])
def test_the_interpreter_switch_is_read_when_the_process_starts(value, expected):
    """NANOVLLM_TRITON_INTERPRET=1 in the environment a process starts with sends CPU tensors to the
    Triton kernels (the interpreter's test runner); otherwise they stay on the PyTorch path."""
    env = {k: v for k, v in os.environ.items() if k != "NANOVLLM_TRITON_INTERPRET"}
    if value is not None:
        env["NANOVLLM_TRITON_INTERPRET"] = value
    code = (
        "import torch; from nanovllm.layers.triton_switch import triton_path; print(triton_path(torch.zeros(1), 'X'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected, out.stdout + out.stderr


def test_inline_ptx_runs_only_for_cuda_tensors_of_an_nvidia_gpu_outside_the_interpreter(monkeypatch):
    """``nvidia_ptx``: the one place that says where the kernels' inline PTX (PDL's griddepcontrol, the
    sampler's lg2.approx) can run; each exclusion flips it."""
    from nanovllm.layers.triton_switch import nvidia_ptx

    cuda = types.SimpleNamespace(is_cuda=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert nvidia_ptx(cuda) and not nvidia_ptx(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not nvidia_ptx(cuda)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not nvidia_ptx(cuda)


def test_the_sampler_asks_for_the_fast_log_where_inline_ptx_runs(monkeypatch):
    """The fused sampler's FAST_LOG constexpr is ``nvidia_ptx`` of its logits (recorded launches: a
    CPU tensor gives False; the same call with ``nvidia_ptx`` saying yes gives True)."""
    fused_sampler = pytest.importorskip("nanovllm.layers.fused_sampler", reason="needs triton")
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs.get("FAST_LOG"))

    monkeypatch.setattr(fused_sampler, "_sample_kernel", Recorder())
    monkeypatch.setattr(fused_sampler, "_sample_merge_kernel", Recorder())
    logits = torch.randn(2, 5000)
    args = (logits, torch.ones(2), torch.zeros(2, dtype=torch.int64))
    fused_sampler.sample(*args, block=1024, splits=1)
    monkeypatch.setattr(fused_sampler, "nvidia_ptx", lambda x: True)
    fused_sampler.sample(*args, block=1024, splits=1)
    assert seen == [False, True], seen
