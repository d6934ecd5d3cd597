"""Programmatic dependent launch (``nanovllm.layers.pdl``), checked without a GPU:

- every Triton kernel takes the ``PDL`` constexpr and calls ``pdl.wait_then_release(PDL)`` as its
  first statement (the invariant that keeps an early-launched kernel from reading what its
  predecessor is still writing), with a negative control: a kernel that loads first is flagged;
- every launch wrapper passes ``pdl.launch_args``: the constexpr and Triton's ``launch_pdl`` agree
  (a kernel launched early that does not wait would race; one that waits but is not launched early
  gains nothing), checked by running each wrapper on CPU tensors with its kernels replaced by
  recorders, and a wrapper that drops the arguments is caught;
- compiled for sm_90 (offline, no GPU needed), the PTX waits before its first global access and
  the launch carries the attribute; with PDL off neither is there;
- the switch: on for CUDA tensors of compute capability >= 9 unless ``NANOVLLM_PDL=0``; off on
  the CPU and below sm_90.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernels need triton")

from nanovllm.attention import triton_ops  # noqa: E402
from nanovllm.layers import fused_ops, fused_sampler, pdl  # noqa: E402

MODULES = (triton_ops, fused_ops, fused_sampler)


def _kernels():
    for module in MODULES:
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction) and "PDL" in inspect.signature(obj.fn).parameters:
                yield f"{module.__name__}.{name}", obj
            elif isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"):
                yield f"{module.__name__}.{name}", obj  # a launched kernel without the constexpr: flagged below


def _first_statement_waits(fn) -> str | None:
    """None when ``fn``'s first statement (after its docstring) is ``pdl.wait_then_release(PDL)``;
    otherwise what is wrong."""
    if "PDL" not in inspect.signature(fn).parameters:
        return "has no PDL parameter"
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = ast.unparse(body[0]) if body else ""
    return None if first == "pdl.wait_then_release(PDL)" else f"starts with {first!r}"


def test_every_kernel_waits_first():
    kernels = dict(_kernels())
    launched = {
        "_store_kv_kernel", "_decode_kernel", "_merge_kernel", "_prefill_kernel", "_rms_norm_kernel",
        "_silu_mul_kernel", "_rope_kernel", "_qk_norm_rope_kernel", "_sample_kernel", "_sample_merge_kernel",
    }  # fmt: skip
    assert launched <= {name.rsplit(".", 1)[1] for name in kernels}, sorted(kernels)
    problems = {name: _first_statement_waits(k.fn) for name, k in kernels.items()}
    assert not {n: p for n, p in problems.items() if p}, problems


def test_the_first_statement_rule_flags_a_kernel_that_loads_first():
    """Negative control: the rule is not vacuous."""

    def loads_first(x_ptr, PDL):
        """doc"""
        x = x_ptr + 1  # stands in for a load before the wait
        pdl.wait_then_release(PDL)
        return x

    def no_constexpr(x_ptr):
        pdl.wait_then_release(True)

    def waits(x_ptr, PDL):
        pdl.wait_then_release(PDL)

    assert _first_statement_waits(loads_first) == "starts with 'x = x_ptr + 1'"
    assert _first_statement_waits(no_constexpr) == "has no PDL parameter"
    assert _first_statement_waits(waits) is None


class _Recorder:
    """Stands in for a JITFunction: ``kernel[grid](*args, **kwargs)`` records the keyword arguments."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, kwargs))


@pytest.fixture
def recorded(monkeypatch):
    """Every kernel replaced by a recorder and PDL forced on (as on an H200): the wrappers' launches."""
    calls: list = []
    for name, _ in _kernels():
        module_name, attr = name.rsplit(".", 1)
        module = next(m for m in MODULES if m.__name__ == module_name)
        monkeypatch.setattr(module, attr, _Recorder(attr, calls))
    monkeypatch.setattr(pdl, "enabled", lambda x: True)
    return calls


def _run_every_wrapper():
    t, hq, hk, d, blocks, bs = 3, 4, 2, 8, 4, 16
    bf = dict(dtype=torch.bfloat16)
    x = torch.randn(t, 32, **bf)
    fused_ops.rms_norm(x, torch.ones(32, **bf), 1e-6)
    fused_ops.rms_norm(x, torch.ones(32, **bf), 1e-6, residual=x.clone())
    fused_ops.silu_and_mul(torch.randn(t, 64, **bf))
    cos = sin = torch.ones(64, d)
    positions = torch.arange(t)
    fused_ops.rotary_(positions, torch.randn(t, hq, d, **bf), torch.randn(t, hk, d, **bf), cos, sin)
    qkv = torch.randn(t, (hq + 2 * hk) * d, **bf)
    norm = (torch.ones(d, **bf), 1e-6)
    fused_ops.qk_norm_rope(positions, qkv, hq, hk, norm, norm, cos, sin)
    cache = torch.zeros(blocks, bs, hk, d, **bf)
    kv = torch.randn(t, hk, d, **bf)
    triton_ops.store_kv(kv, kv, cache, cache, torch.arange(t))
    q = torch.randn(t, hq, d, **bf)
    tables = torch.zeros(t, 2, dtype=torch.int32)
    lens = torch.full((t,), 5, dtype=torch.int32)
    triton_ops.paged_decode(q, cache, cache, tables, lens, 1.0)
    triton_ops.paged_decode(q, cache, cache, tables, lens, 1.0, num_splits=2)  # + the merge
    triton_ops.paged_prefill(q, cache, cache, torch.tensor([0, t], dtype=torch.int32), lens[:1], tables[:1], 1.0)
    logits = torch.randn(2, 10_000)
    for splits in (1, 4):  # one program per row, and split rows + the merge
        fused_sampler.sample(logits, torch.ones(2), torch.zeros(2, dtype=torch.int64), block=1024, splits=splits)


def test_every_wrapper_launches_with_matching_pdl_arguments(recorded):
    _run_every_wrapper()
    launched = {name for name, _ in recorded}
    assert launched == {
        "_rms_norm_kernel", "_silu_mul_kernel", "_rope_kernel", "_qk_norm_rope_kernel", "_store_kv_kernel",
        "_decode_kernel", "_merge_kernel", "_prefill_kernel", "_sample_kernel", "_sample_merge_kernel",
    }, launched  # fmt: skip
    wrong = [(name, kw.get("PDL"), kw.get("launch_pdl")) for name, kw in recorded]
    wrong = [w for w in wrong if w[1:] != (True, True)]
    assert not wrong, wrong


def test_the_wrapper_check_catches_a_launch_without_the_arguments(recorded, monkeypatch):
    """Negative control: a wrapper that drops ``launch_args`` shows up in the recorded launches."""
    monkeypatch.setattr(pdl, "launch_args", lambda x: {"PDL": True})  # the constexpr, not the launch option
    _run_every_wrapper()
    assert all(kw.get("launch_pdl") is None for _, kw in recorded)
    assert any(kw.get("PDL") for _, kw in recorded)


def test_the_switch(monkeypatch):
    cuda = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    monkeypatch.delenv("NANOVLLM_PDL", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    assert pdl.enabled(cuda) and pdl.launch_args(cuda) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("NANOVLLM_PDL", "0")
    assert not pdl.enabled(cuda) and pdl.launch_args(cuda) == {"PDL": False}
    monkeypatch.setenv("NANOVLLM_PDL", "1")
    monkeypatch.setattr(pdl, "_capable", lambda index: False)  # an A100 (sm_80)
    assert not pdl.enabled(cuda)
    assert pdl.launch_args(torch.zeros(1)) == {"PDL": False}  # the CPU


RMS_SIGNATURE = {
    **dict.fromkeys(["x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr"], "*bf16"),
    **dict.fromkeys(["n_cols", "stride_x", "stride_r", "stride_o", "stride_ro"], "i32"),
    "eps": "fp32",
    **dict.fromkeys(["HAS_RESIDUAL", "BLOCK", "PDL"], "constexpr"),
}


@pytest.mark.parametrize("on", [True, False])
def test_compiled_for_sm90_the_kernel_waits_before_touching_memory(on):
    """Offline compile for an H100/H200 (no GPU): with PDL the PTX's first instruction that reads
    or writes global memory comes after ``griddepcontrol.wait``, and the launch carries the
    attribute; without it there is no ``griddepcontrol`` at all."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(
        fn=fused_ops._rms_norm_kernel,
        signature=RMS_SIGNATURE,
        constexprs={"HAS_RESIDUAL": True, "BLOCK": 1024, "PDL": on},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": on})
    ptx = compiled.asm["ptx"]
    first_access = min(i for i in (ptx.find("ld.global"), ptx.find("st.global")) if i >= 0)
    assert compiled.metadata.launch_pdl is on
    if on:
        wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        assert 0 <= wait < release < first_access, (wait, release, first_access)
    else:
        assert "griddepcontrol" not in ptx
