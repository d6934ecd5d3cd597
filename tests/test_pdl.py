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
tl = triton.language

from nanovllm.attention import triton_ops  # noqa: E402
from nanovllm.layers import decode_gemm, fused_ops, fused_sampler, pdl  # noqa: E402
from tests.compile_hints import METADATA_POINTERS, runtime_hints  # noqa: E402
from tests.kernel_modules import kernel_modules  # noqa: E402

MODULES = kernel_modules()
HELPERS = {
    "wait_then_release",
    "release_then_wait",
    "enter",
    "_fp8_to_f16_asm",
    "_fp8_to_finite_f16_asm",
    "_fp8_pairs_to_f16_asm",
    "_finite_f16_asm",
    "pairs_accumulator",
    "pairs_joined",
    "_opaque16",
    "_prefill_tile",
    "_decode_tile",
    "slot_offset",
    "fp8_saturate",
    "_log2",
}  # jit functions called by kernels


def _kernels():
    for module in MODULES:
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction) and name not in HELPERS:
                yield f"{module.__name__}.{name}", obj  # every launched kernel: its first statement is checked


WAITS = (
    "pdl.wait_then_release(PDL)",
    # RMSNorm and SiLU-and-mul may let their successor launch first (fused_ops.EARLY_RELEASE): still no
    # access before the wait
    "pdl.enter(PDL, EARLY)",
)
# kernels that load what no kernel writes before they wait: the pointer parameters they may touch there
PRELOADS = {"_preload_gemm_kernel": {"w_ptr"}}


def _first_statement_waits(fn) -> str | None:
    """None when ``fn``'s first statement (after its docstring) is the wait (``WAITS``), or, for a kernel
    in ``PRELOADS``, when the statements before the wait store nothing and name no pointer parameter
    but the ones it preloads; otherwise what is wrong."""
    params = inspect.signature(fn).parameters
    if "PDL" not in params:
        return "has no PDL parameter"
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    preloaded = PRELOADS.get(fn.__name__, set())
    before = []
    for statement in body:
        if ast.unparse(statement) in WAITS:
            break
        before.append(statement)
    else:
        return "never waits"
    for statement in before:
        text = ast.unparse(statement)
        names = {n.id for n in ast.walk(statement) if isinstance(n, ast.Name)}
        pointers = {n for n in names if n in params and n.endswith("_ptr")}
        if not preloaded:
            return f"starts with {ast.unparse(before[0])!r}"
        if "store" in text or "atomic" in text or pointers - preloaded:
            return f"before its wait: {text!r}"
    return None


def test_every_kernel_waits_first():
    kernels = dict(_kernels())
    launched = {
        "_store_kv_kernel", "_decode_kernel", "_merge_kernel", "_prefill_kernel", "_rms_norm_kernel",
        "_silu_mul_kernel", "_rope_kernel", "_qk_norm_rope_kernel", "_sample_kernel", "_sample_merge_kernel",
        "_decode_gemm_kernel", "_preload_gemm_kernel",
    }  # fmt: skip
    assert {triton_ops, fused_ops, fused_sampler} <= set(MODULES), MODULES
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

    def _preload_gemm_kernel(x_ptr, w_ptr, PDL):
        w = tl.load(w_ptr)
        x = tl.load(x_ptr)  # an input another kernel writes, read before the wait
        pdl.wait_then_release(PDL)
        return w, x

    assert _first_statement_waits(_preload_gemm_kernel) == "before its wait: 'x = tl.load(x_ptr)'"

    def _preload_gemm_kernel(x_ptr, w_ptr, PDL):  # noqa: F811 (the same name: PRELOADS is by name)
        w = tl.load(w_ptr)  # the weights alone before the wait: accepted
        pdl.wait_then_release(PDL)
        return w, tl.load(x_ptr)

    assert _first_statement_waits(_preload_gemm_kernel) is None
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
    fused_ops.qk_norm_rope(
        positions, qkv, hq, hk, norm, norm, cos, sin, fused_ops.CacheWrite(cache, cache, torch.arange(t))
    )
    kv = torch.randn(t, hk, d, **bf)
    triton_ops.store_kv(kv, kv, cache, cache, torch.arange(t))
    q = torch.randn(t, hq, d, **bf)
    tables = torch.zeros(t, 2, dtype=torch.int32)
    lens = torch.full((t,), 5, dtype=torch.int32)
    triton_ops.paged_decode(q, cache, cache, tables, lens, 1.0)
    triton_ops.paged_decode(q, cache, cache, tables, lens, 1.0, num_splits=2)  # + the merge
    triton_ops.paged_prefill(q, cache, cache, torch.tensor([0, t], dtype=torch.int32), lens[:1], tables[:1], 1.0)
    decode_gemm.linear(torch.randn(t, 128, **bf), torch.randn(48, 128, **bf))
    decode_gemm.preload_linear(torch.randn(t, 128, **bf), torch.randn(48, 128, **bf))
    logits = torch.randn(2, 10_000)
    for splits in (1, 4):  # one program per row, and split rows + the merge
        fused_sampler.sample(logits, torch.ones(2), torch.zeros(2, dtype=torch.int64), block=1024, splits=splits)


def _mismatched(calls) -> set[str]:
    """The kernels launched (with PDL on) without both the constexpr and the launch option."""
    return {name for name, kw in calls if (kw.get("PDL"), kw.get("launch_pdl")) != (True, True)}


def test_every_wrapper_launches_with_matching_pdl_arguments(recorded):
    _run_every_wrapper()
    launched = {name for name, _ in recorded}
    assert launched == {
        "_rms_norm_kernel", "_silu_mul_kernel", "_rope_kernel", "_qk_norm_rope_kernel", "_store_kv_kernel",
        "_decode_kernel", "_merge_kernel", "_prefill_kernel", "_sample_kernel", "_sample_merge_kernel",
        "_decode_gemm_kernel", "_preload_gemm_kernel",
    }, launched  # fmt: skip
    assert not _mismatched(recorded)


@pytest.mark.parametrize(
    "module,broken",
    [
        (fused_ops, {"_rms_norm_kernel", "_silu_mul_kernel", "_rope_kernel", "_qk_norm_rope_kernel"}),
        (fused_sampler, {"_sample_kernel", "_sample_merge_kernel"}),
        (decode_gemm, {"_decode_gemm_kernel", "_preload_gemm_kernel"}),
    ],
)
def test_the_wrapper_check_catches_wrappers_that_drop_the_launch_option(recorded, monkeypatch, module, broken):
    """Negative control: one module's wrappers pass the constexpr but not ``launch_pdl`` (what a
    wrapper that built its own arguments would do); the check names exactly those kernels."""
    stub = types.SimpleNamespace(launch_args=lambda x: {"PDL": True})
    monkeypatch.setattr(module, "pdl", stub)
    _run_every_wrapper()
    assert _mismatched(recorded) == broken


def test_the_switch(monkeypatch):
    cuda = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    monkeypatch.delenv("NANOVLLM_PDL", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    assert pdl.enabled(cuda) and pdl.launch_args(cuda) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("NANOVLLM_PDL", "0")
    assert not pdl.enabled(cuda) and pdl.launch_args(cuda) == {"PDL": False}
    monkeypatch.setenv("NANOVLLM_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter cannot run griddepcontrol
    assert not pdl.enabled(cuda)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pdl, "SUPPORTED", False)  # a Triton without launch_pdl
    assert not pdl.enabled(cuda)
    monkeypatch.setattr(pdl, "SUPPORTED", True)
    monkeypatch.setattr(pdl, "_capable", lambda index: False)  # an A100 (sm_80), or ROCm
    assert not pdl.enabled(cuda)
    assert pdl.launch_args(torch.zeros(1)) == {"PDL": False}  # the CPU


@pytest.mark.parametrize(
    "capability,hip,expected",
    [((9, 0), None, True), ((10, 0), None, True), ((8, 9), None, False), ((8, 0), None, False), ((9, 4), "6.2", False)],
)
def test_capable_only_on_cuda_sm90_and_later(monkeypatch, capability, hip, expected):
    """griddepcontrol exists from sm_90 on (an A100 or an L4 would fail in ptxas), and a ROCm GPU
    reporting (9, 4) is not one."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    pdl._capable.cache_clear()
    try:
        assert pdl._capable(0) is expected
    finally:
        pdl._capable.cache_clear()


FLOAT_ARGS = {"eps", "qk_scale", "v_scale"}
INT_POINTERS = METADATA_POINTERS  # the int32 block tables, lengths and query offsets
FLOAT32_POINTERS = {"part_ptr", "lse_ptr"}

# kernel -> its constexprs (the H200's shipped shapes: Qwen3-0.6B, bf16, 256-slot blocks)
# fmt: off
COMPILED = {
    "rms_norm": (fused_ops._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=1024)),
    "decode_gemm": (decode_gemm._decode_gemm_kernel, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256)),
    "decode": (triton_ops._decode_kernel, dict(
        GROUP=2, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=128, BLOCK_SIZE=256, NUM_SPLITS=1,
        DOT_PRECISION="tf32", KV_FP8=False, WIDEN=True, V_ASM=False, TILE_BLOCK=True)),
    "prefill": (triton_ops._prefill_kernel, dict(
        GROUP=2, GROUP_PAD=2, BLOCK_Q=32, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, BLOCK_SIZE=256,
        DOT_PRECISION="tf32", KV_FP8=False, WIDEN=True, SPLIT_MASK=True, TILE_BLOCK=True)),
}
# fmt: on


def _signature(kernel) -> dict[str, str]:
    def kind(param) -> str:
        if param.is_constexpr:
            return "constexpr"
        if param.name.endswith("_ptr"):
            return "*i32" if param.name in INT_POINTERS else "*fp32" if param.name in FLOAT32_POINTERS else "*bf16"
        return "fp32" if param.name in FLOAT_ARGS else "i32"

    return {p.name: kind(p) for p in kernel.params}


@pytest.mark.parametrize("name", sorted(COMPILED))
@pytest.mark.parametrize("on", [True, False])
def test_compiled_for_sm90_the_kernel_waits_before_touching_memory(name, on):
    """Offline compile for an H100/H200 (no GPU): with PDL the PTX's first instruction that reads
    or writes global memory (or copies from it asynchronously) comes after ``griddepcontrol.wait``,
    and the launch carries the attribute; without it there is no ``griddepcontrol`` at all."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, constexprs = COMPILED[name]
    # the run time's divisibility hints: the kernel the engine runs, its pipelined copies included
    source = ASTSource(
        fn=kernel, signature=_signature(kernel), constexprs={**constexprs, "PDL": on}, attrs=runtime_hints(kernel)
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": on})
    ptx = compiled.asm["ptx"]
    first_access = min(i for i in (ptx.find(op) for op in ("ld.global", "st.global", "cp.async")) if i >= 0)
    assert compiled.metadata.launch_pdl is on
    if on:
        wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        assert 0 <= wait < release < first_access, (wait, release, first_access)
    else:
        assert "griddepcontrol" not in ptx


def _compile_sm90(kernel, constexprs: dict, num_warps: int, num_stages: int = 3) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=_signature(kernel), constexprs=constexprs, attrs=runtime_hints(kernel))
    target = GPUTarget("cuda", 90, 32)
    return triton.compile(
        source, target=target, options={"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": True}
    ).asm["ptx"]


def _loads_before_wait(ptx: str) -> tuple[int, int]:
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    return sum("ld.global" in line for line in lines[:wait]), sum("st.global" in line for line in lines[:wait])


@pytest.mark.parametrize("block_n,nk,warps", [(32, 1, 8), (16, 3, 8)])
def test_compiled_for_sm90_the_preload_kernel_loads_only_its_weight_strip_before_the_wait(block_n, nk, warps):
    """The preloading kernel's PTX: before ``griddepcontrol.wait``, exactly the 16-byte loads of its
    weight strip (BLOCK_N x K bf16 over the threads) and no store; x's loads come after. The control:
    the strip kernel, which waits first, has none before the wait (the count is not the same anyway)."""
    constexprs = dict(BLOCK_M=16, BLOCK_N=block_n, BK=1024, NK=nk, PDL=True)
    ptx = _compile_sm90(decode_gemm._preload_gemm_kernel, constexprs, warps, num_stages=1)  # as launched
    loads, stores = _loads_before_wait(ptx)
    strip_loads = block_n * 1024 * nk * 2 // (32 * warps * 16)
    assert (loads, stores) == (strip_loads, 0), (loads, stores, strip_loads)
    lines = ptx.splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    assert any("ld.global" in line for line in lines[wait:])  # x, after the wait
    strip = _compile_sm90(decode_gemm._decode_gemm_kernel, dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=256, PDL=True), 4)
    assert _loads_before_wait(strip) == (0, 0)


def _release_wait_access(ptx: str) -> tuple[int, int, int]:
    wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    first_access = min(i for i in (ptx.find(op) for op in ("ld.global", "st.global")) if i >= 0)
    return release, wait, first_access


@pytest.mark.parametrize("kernel", ["rms_norm", "silu"])
def test_compiled_for_sm90_an_early_release_comes_before_the_wait_and_every_access(kernel):
    """RMSNorm and SiLU-and-mul with EARLY: ``launch_dependents`` first, then the wait, then the first
    global access; without EARLY the usual wait, release, access. Both instructions must be there."""
    fn, constexprs = {
        "rms_norm": (fused_ops._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=1024)),
        "silu": (fused_ops._silu_mul_kernel, dict(BLOCK=1024)),
    }[kernel]
    for early in (True, False):
        release, wait, first_access = _release_wait_access(
            _compile_sm90(fn, {**constexprs, "PDL": True, "EARLY": early}, 4)
        )
        assert release >= 0 and wait >= 0, (release, wait)
        if early:
            assert release < wait < first_access, (release, wait, first_access)
        else:
            assert wait < release < first_access, (release, wait, first_access)


def test_the_order_rule_rejects_a_kernel_that_never_releases():
    """Negative control: PTX without ``launch_dependents`` (release = -1) fails the rule's first check."""
    release, wait, _ = _release_wait_access("griddepcontrol.wait;\nld.global.b32 %r1, [%rd1];")
    assert release == -1 and not (release >= 0 and wait >= 0)
