"""Fused elementwise kernels for the GPU path (Triton): RMSNorm (+ residual add), SiLU*mul, RoPE,
and Qwen3's per-head q/k RMSNorm with RoPE in one pass over the qkv projection.

Why: in eager PyTorch each of these is 4-12 small kernels per layer; in a decode
step of a 28-layer model that is ~1,000 launches of a few microseconds each,
the same order as the attention itself. One kernel each instead.

Numerics follow the PyTorch layers they replace (HF's): RMSNorm normalizes in
float32, rounds to the model dtype, then multiplies by the weight; the residual
sum is rounded to the model dtype before it is normalized. RoPE and SiLU compute
in float32 and round once (PyTorch rounds after each op: differences are within
one bf16 ulp). The layers call these only for CUDA tensors (``enabled(x)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.layers.triton_switch import triton_path

try:
    import triton
    import triton.language as tl

    from nanovllm.attention.triton_ops import METADATA_PTRS, check_cache, fp8_saturate, slot_offset
    from nanovllm.layers import pdl
except ImportError:  # CPU-only installs: the layers keep their PyTorch code
    triton = None

QK_HEADS_PER_PROGRAM = 8  # heads per program of qk_norm_rope, a power of two (8 measured best: KERNEL_NOTES)
# RMSNorm and SiLU-and-mul let their successor launch before they wait (``pdl.release_then_wait``), so
# a preloading linear layer after them (``decode_gemm``) streams its weights during the kernel before
# them as well. Off until measured (session 16 A/B).
EARLY_RELEASE = False


def enabled(x: torch.Tensor) -> bool:
    return triton is not None and triton_path(x, "NANOVLLM_FUSED_OPS")


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        n_cols,
        eps,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,
        EARLY: tl.constexpr = False,
    ):
        pdl.enter(PDL, EARLY)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)  # rounded to the model dtype
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        y = (xf * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(
            out_ptr + row * stride_o + cols,
            (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
            mask=mask,
        )

    @triton.jit
    def _silu_mul_kernel(
        x_ptr,
        out_ptr,
        n_cols,
        stride_x,
        stride_o,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,
        EARLY: tl.constexpr = False,
    ):
        pdl.enter(PDL, EARLY)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(
        q_ptr,
        k_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_cos,
        NUM_Q_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """In place: x = x * cos + rotate_half(x) * sin, one (token, head) per program."""
        pdl.wait_then_release(PDL)
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        if head < NUM_Q_HEADS:
            base = q_ptr + tok * stride_qt + head * stride_qh
        else:
            base = k_ptr + tok * stride_kt + (head - NUM_Q_HEADS) * stride_kh
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=mask, other=0.0)
        tl.store(base + offs, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(base + HALF + offs, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize_on_alignment=METADATA_PTRS)  # slot_ptr: a slice of the step buffer
    def _qk_norm_rope_kernel(
        qkv_ptr,
        q_out_ptr,
        k_out_ptr,
        q_w_ptr,
        k_w_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        stride_t,
        stride_qo,
        stride_ko,
        stride_cos,
        q_eps,
        k_eps,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        k_scale,
        v_scale,
        stride_cb,
        stride_cs,
        stride_ch,
        NUM_Q_HEADS: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_H: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr = 0,
        BLOCK_SIZE: tl.constexpr = 1,
        STORE: tl.constexpr = False,
        KV_FP8: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        """Program (token, run of BLOCK_H heads) over heads 0..NUM_HEADS-1: q's heads, then k's
        (k's follow q's in a qkv row). Each head: RMSNorm (float32, rounded to the model dtype,
        times the weight, rounded again), then RoPE (float32, rounded once) into the contiguous
        output. A tile of heads per program, not one head: 196,608 programs of 128 elements each made
        an 8,192-token prefill step's call 141-160 us on the H200; 8 heads per program, 33 us.

        STORE: k's heads go into the paged cache at the token's slot instead of k_out, and the
        heads NUM_HEADS.. (v's, NUM_KV_HEADS of them, after k's in the qkv row) are copied there
        unchanged, as ``triton_ops.store_kv`` would (slot -1 writes nothing; an FP8 cache holds
        clamp(x / scale, +-448)): one launch per layer fewer."""
        pdl.wait_then_release(PDL)
        tok = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs = tl.arange(0, BLOCK)
        is_q = heads < NUM_Q_HEADS
        mask = (heads < NUM_HEADS + NUM_KV_HEADS)[:, None] & (offs < HALF)[None, :]  # NUM_KV_HEADS: 0 unless STORE
        src = qkv_ptr + tok * stride_t + heads[:, None] * HEAD_DIM + offs[None, :]
        dtype = q_out_ptr.dtype.element_ty
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        eps = tl.where(is_q, q_eps, k_eps)
        inv_rms = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        w_mask = offs < HALF
        qw1 = tl.load(q_w_ptr + offs, mask=w_mask, other=0.0).to(tl.float32)
        qw2 = tl.load(q_w_ptr + HALF + offs, mask=w_mask, other=0.0).to(tl.float32)
        kw1 = tl.load(k_w_ptr + offs, mask=w_mask, other=0.0).to(tl.float32)
        kw2 = tl.load(k_w_ptr + HALF + offs, mask=w_mask, other=0.0).to(tl.float32)
        w1 = tl.where(is_q[:, None], qw1[None, :], kw1[None, :])
        w2 = tl.where(is_q[:, None], qw2[None, :], kw2[None, :])
        n1 = (x1 * inv_rms[:, None]).to(dtype).to(tl.float32)
        n2 = (x2 * inv_rms[:, None]).to(dtype).to(tl.float32)
        y1 = (w1 * n1).to(dtype).to(tl.float32)
        y2 = (w2 * n2).to(dtype).to(tl.float32)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=w_mask, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=w_mask, other=0.0)[None, :]
        out1 = (y1 * cos - y2 * sin).to(dtype)
        out2 = (y2 * cos + y1 * sin).to(dtype)
        q_dst = q_out_ptr + tok * stride_qo + heads[:, None] * HEAD_DIM + offs[None, :]
        q_mask = mask & is_q[:, None]
        tl.store(q_dst, out1, mask=q_mask)
        tl.store(q_dst + HALF, out2, mask=q_mask)
        if STORE:
            is_v = heads >= NUM_HEADS
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            kv_head = tl.where(is_v, heads - NUM_HEADS, heads - NUM_Q_HEADS)
            dst = (
                slot_offset(tl.maximum(slot, 0), BLOCK_SIZE, stride_cb, stride_cs)
                + kv_head[:, None] * stride_ch
                + offs[None, :]
            )
            in_cache = mask & (slot >= 0)
            k_mask = in_cache & ~is_q[:, None] & ~is_v[:, None]
            v_mask = in_cache & is_v[:, None]
            k1, k2, v1, v2 = out1, out2, x1, x2
            if KV_FP8:
                k1, k2 = fp8_saturate(k1, k_scale), fp8_saturate(k2, k_scale)
                v1, v2 = fp8_saturate(v1, v_scale), fp8_saturate(v2, v_scale)
            cache_dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + dst, k1.to(cache_dtype), mask=k_mask)
            tl.store(k_cache_ptr + dst + HALF, k2.to(cache_dtype), mask=k_mask)
            tl.store(v_cache_ptr + dst, v1.to(cache_dtype), mask=v_mask)
            tl.store(v_cache_ptr + dst + HALF, v2.to(cache_dtype), mask=v_mask)
        else:
            k_dst = k_out_ptr + tok * stride_ko + (heads - NUM_Q_HEADS)[:, None] * HEAD_DIM + offs[None, :]
            k_mask = mask & (heads >= NUM_Q_HEADS)[:, None]
            tl.store(k_dst, out1, mask=k_mask)
            tl.store(k_dst + HALF, out2, mask=k_mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _early(launch: dict) -> dict:
    return {**launch, "EARLY": True} if EARLY_RELEASE and launch["PDL"] else launch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """rms_norm(x) or, with residual, (rms_norm(x + residual), x + residual)."""
    shape = x.shape
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty_like(out)
    else:
        r2, res_out = x2, out
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x2,
            r2,
            weight,
            out,
            res_out,
            n_cols,
            eps,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n_cols),
            num_warps=4 if n_cols <= 2048 else 8,
            **_early(pdl.launch_args(x2)),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    n_rows, n = x2.shape[0], x2.shape[1] // 2
    out = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if n_rows:
        _silu_mul_kernel[(n_rows, triton.cdiv(n, block))](
            x2, out, n, x2.stride(0), out.stride(0), BLOCK=block, **_early(pdl.launch_args(x2))
        )
    return out.view(*x.shape[:-1], n)


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, d] and k [T, Hk, d] in place; cos/sin [max_pos, d] float32 (two equal halves)."""
    n_tokens, n_q, d = q.shape
    n_k = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_ needs the head dimension contiguous")
    if n_tokens:
        _rope_kernel[(n_tokens, n_q + n_k)](
            q,
            k,
            cos,
            sin,
            positions,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            NUM_Q_HEADS=n_q,
            HALF=d // 2,
            BLOCK=triton.next_power_of_2(d // 2),
            **pdl.launch_args(q),
        )


@dataclass(frozen=True)
class CacheWrite:
    """Where ``qk_norm_rope`` puts this step's k and v: one layer's paged caches as the Triton
    kernels address them (the view ``[blocks, block_size, kv_heads, d]``, any storage order, last
    dim contiguous), the tokens' slots (-1: nothing written), and an FP8 cache's scales."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    def check(self, n_tokens: int, num_kv_heads: int, d: int) -> None:
        k, v = self.k_cache, self.v_cache
        if k.dim() != 4 or tuple(k.shape[2:]) != (num_kv_heads, d) or v.shape != k.shape:
            raise ValueError(
                f"qk_norm_rope: k_cache {tuple(k.shape)} and v_cache {tuple(v.shape)} are not "
                f"[blocks, slots, {num_kv_heads}, {d}]"
            )
        check_cache(k, v)  # the attention kernels' rule: equal strides and dtype, last dim contiguous
        if self.slot_mapping.numel() < n_tokens:
            raise ValueError(f"qk_norm_rope: slot_mapping has {self.slot_mapping.numel()} slots for {n_tokens} tokens")


def qk_norm_rope(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm: tuple[torch.Tensor, float],
    k_norm: tuple[torch.Tensor, float],
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: CacheWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Qwen3's q/k path in one kernel: qkv [T, (Hq + 2 Hk) d] -> (q [T, Hq, d], k [T, Hk, d]), each
    head RMSNorm-ed with its (weight, eps) and rotated; v is left in qkv. Replaces two strided
    copies, two RMSNorm kernels and the RoPE kernel of the unfused path.

    With ``cache``, k and v go straight into the paged cache (the K/V store's launch saved) and
    the second result is None."""
    n_tokens = qkv.shape[0]
    d = q_norm[0].shape[0]
    if qkv.stride(-1) != 1 or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * d:
        raise ValueError(
            f"qk_norm_rope needs qkv [T, {(num_q_heads + 2 * num_kv_heads) * d}] rows, got {tuple(qkv.shape)}"
        )
    q = torch.empty((n_tokens, num_q_heads, d), dtype=qkv.dtype, device=qkv.device)
    k = None if cache else torch.empty((n_tokens, num_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
    if cache:
        cache.check(n_tokens, num_kv_heads, d)
        kc = cache.k_cache
        store = dict(
            NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=kc.shape[1], STORE=True, KV_FP8=kc.dtype == torch.float8_e4m3fn
        )
        cache_args = (kc, cache.v_cache, cache.slot_mapping, cache.k_scale, cache.v_scale, *kc.stride()[:3])
    else:
        store = {}
        cache_args = (q, q, positions, 1.0, 1.0, 0, 0, 0)  # not read: STORE is off
    if n_tokens:
        num_heads = num_q_heads + num_kv_heads
        block_h = min(QK_HEADS_PER_PROGRAM, triton.next_power_of_2(num_heads))
        heads = num_heads + (num_kv_heads if cache else 0)
        _qk_norm_rope_kernel[(n_tokens, triton.cdiv(heads, block_h))](
            qkv,
            q,
            q if k is None else k,
            q_norm[0],
            k_norm[0],
            cos,
            sin,
            positions,
            qkv.stride(0),
            q.stride(0),
            0 if k is None else k.stride(0),
            cos.stride(0),
            q_norm[1],
            k_norm[1],
            *cache_args,
            NUM_Q_HEADS=num_q_heads,
            NUM_HEADS=num_heads,
            HEAD_DIM=d,
            HALF=d // 2,
            BLOCK=triton.next_power_of_2(d // 2),
            BLOCK_H=block_h,
            **store,
            **pdl.launch_args(qkv),
        )
    return q, k
