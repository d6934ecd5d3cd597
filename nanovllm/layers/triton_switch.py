"""When a Triton kernel path applies to a tensor, and the kernel modules imported only then.

Triton must be importable; a CUDA tensor takes the kernels unless the kernel family's
environment switch is "0" (``NANOVLLM_FUSED_OPS``, ``NANOVLLM_FUSED_SAMPLER``, and
``NANOVLLM_FUSED_QK_ROPE`` for Qwen3's fused q/k norm + RoPE, which also needs the first: for A/B
measurements); a CPU tensor takes them only in the kernel tests under Triton's interpreter
(``NANOVLLM_TRITON_INTERPRET=1``, read once at import: the interpreter's test runner sets it before
the process starts, and a CPU forward pass asks ~240 times per step, where reading the environment
each time cost ~1.5 % of the standard CPU workload's main thread in a sampled profile).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("NANOVLLM_TRITON_INTERPRET") == "1"


def nvidia_ptx(x: torch.Tensor) -> bool:
    """Inline PTX in a kernel can run for ``x``: a CUDA tensor on an NVIDIA GPU (not ROCm), not under
    Triton's interpreter (``TRITON_INTERPRET=1``, which cannot run it). PDL's ``griddepcontrol`` and the
    sampler's ``lg2.approx`` both ask this; PDL also needs sm_90 (``pdl.enabled``)."""
    return x.is_cuda and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


def triton_path(x: torch.Tensor, switch: str) -> bool:
    if not HAVE_TRITON:
        return False
    if x.is_cuda:
        return os.environ.get(switch, "1") == "1"
    return INTERPRET


class LazyKernels:
    """A Triton kernel module (``fused_ops``, ``fused_sampler``) imported on its first use: a run
    whose tensors never take the kernel path (the CPU) never imports it, nor Triton (start-up
    time). ``enabled(x)`` answers without importing where ``triton_path`` says no; any other
    attribute is the module's."""

    def __init__(self, module: str, switch: str):
        self._name, self._switch = module, switch
        self._loaded = None  # the module, once imported

    def _module(self):
        if self._loaded is None:
            self._loaded = importlib.import_module(self._name)
        return self._loaded

    def enabled(self, x: torch.Tensor) -> bool:
        return triton_path(x, self._switch) and self._module().enabled(x)

    def __getattr__(self, name: str):
        return getattr(self._module(), name)
