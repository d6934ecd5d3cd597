"""Programmatic dependent launch (PDL) for the Triton kernels, on Hopper and later GPUs.

Two dependent kernels in a stream normally run strictly one after the other: the second is
launched only once the first has finished and flushed its writes, and the gap between them (a
microsecond or two, in a CUDA graph as well) is paid once per kernel, ~300 times per decode step
of a 28-layer model. A kernel launched with PDL (``launch_pdl``) may be scheduled while the kernel
before it is still running; it then waits (``griddepcontrol.wait``) until that kernel has finished
and its writes are visible, and lets its own successor be scheduled early
(``griddepcontrol.launch_dependents``). Only the launch and scheduling overlap, never the work.

Invariant: a kernel launched with PDL calls :func:`wait_then_release` before its first load or
store of anything another kernel writes. Doing it first thing in the kernel keeps that true by
construction (the kernels here do) and makes the chain transitive: a kernel that starts early
waits for its predecessor, which finished only after waiting for its own. Two relaxations, both off
by default and kept to the invariant: ``decode_gemm``'s preloading kernel reads its weights (no
kernel's output) before its wait, and RMSNorm / SiLU-and-mul may release their successor before they
wait (``release_then_wait``, ``fused_ops.EARLY_RELEASE``) so that such a kernel starts one kernel
earlier; the successor's own wait still orders its reads after them. Both rest on no kernel launched
with PDL writing a weight (weights are written only when loaded, with plain copies).

``NANOVLLM_PDL=0`` turns it off (A/B runs); it is off below compute capability 9.0, on ROCm, on
the CPU, under Triton's interpreter (``TRITON_INTERPRET=1``: it cannot run the ``griddepcontrol``
instructions) and with a Triton older than 3.4 (no ``launch_pdl``; ``wait_then_release`` is then a
no-op).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from nanovllm.layers.triton_switch import nvidia_ptx

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    SUPPORTED = True
except ImportError:  # Triton < 3.4: PDL stays off, and the kernels' `if PDL:` branch is never compiled
    SUPPORTED = False
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    if not (SUPPORTED and nvidia_ptx(x)) or os.environ.get("NANOVLLM_PDL", "1") != "1":
        return False
    return _capable(x.device.index if x.device.index is not None else torch.cuda.current_device())


def launch_args(x: torch.Tensor) -> dict:
    """The keyword arguments of a launch on ``x``'s device: the kernel's ``PDL`` constexpr and,
    when it is on, Triton's ``launch_pdl`` option (the two always agree)."""
    return {"PDL": True, "launch_pdl": True} if enabled(x) else {"PDL": False}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """First thing in a kernel: wait for the kernel before it, then let the next one launch."""
    if PDL:  # only ever True where SUPPORTED (enabled)
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def release_then_wait(PDL: tl.constexpr):
    """First thing in a kernel whose successor preloads what no kernel writes (a linear layer's weights,
    ``decode_gemm``'s preloading kernel): let the successor launch, then wait. The successor's own wait
    still orders its reads of this kernel's outputs, and this kernel's wait those of its predecessor."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def enter(PDL: tl.constexpr, EARLY: tl.constexpr):
    """First thing in a kernel that may release early (``fused_ops.EARLY_RELEASE``): ``release_then_wait``
    with EARLY, else ``wait_then_release``."""
    if EARLY:
        release_then_wait(PDL)
    else:
        wait_then_release(PDL)
