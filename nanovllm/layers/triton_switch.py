"""When a Triton kernel path applies to a tensor.

Triton must be importable; a CUDA tensor takes the kernels unless the kernel family's
environment switch is "0" (``NANOVLLM_FUSED_OPS``, ``NANOVLLM_FUSED_SAMPLER``: for A/B
measurements); a CPU tensor takes them only in the kernel tests under Triton's interpreter
(``NANOVLLM_TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def triton_path(x: torch.Tensor, switch: str) -> bool:
    if not HAVE_TRITON:
        return False
    if x.is_cuda:
        return os.environ.get(switch, "1") == "1"
    return os.environ.get("NANOVLLM_TRITON_INTERPRET") == "1"
