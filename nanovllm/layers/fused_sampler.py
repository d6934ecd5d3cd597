"""One-pass sampling kernel for the GPU path (Triton): temperature, Gumbel-max draw,
argmax and the non-finite check, reading each row of logits once in its own dtype.

Why: the PyTorch sampler makes ~8 full passes over [batch, vocab] (a float32 copy,
the finite check, division, softmax, exponential noise, clamp, division, argmax);
at batch 256 and a 152k vocabulary that is ~0.8 ms of a ~9 ms decode step.

What it computes, per row r with inverse temperature ``inv_temp[r]``:
- ``inv_temp == 0`` (greedy): the first index of the largest logit (torch.argmax's rule);
- otherwise argmax over tokens of ``logit * inv_temp + G`` with ``G = -log(-log U)``
  standard Gumbel noise: an exact draw from ``softmax(logit * inv_temp)`` (the
  Gumbel-max trick, equivalent to the PyTorch path's exponential race). ``U`` is
  Philox uniform noise keyed by ``(seed[r], token index)`` (token ``4q + j`` takes word ``j``
  of Philox counter ``q``), so a row's draw depends on its seed only, never on its
  batch-mates, its position in the batch or how the row is split over programs.
  ``U == 0`` gives ``G = -inf``: that token is not drawn (probability ~2^-31).
- ``nonfinite[r]``: whether the row holds a NaN or an infinity (the engine ends
  such a request with an error instead of sampling it).

Rows with top-k / top-p / min-p filters, banned tokens (min_tokens, bad words) or other
logits processing (allowed tokens, logit bias, penalties) are not handled here: the
Sampler sends those rows through its PyTorch path.
"""

from __future__ import annotations

import functools
import os

import torch

from nanovllm.layers.triton_switch import nvidia_ptx, triton_path

try:
    import triton
    import triton.language as tl

    from nanovllm.layers import pdl
except ImportError:  # CPU-only installs: the Sampler keeps its PyTorch path
    triton = None


def enabled(x: torch.Tensor) -> bool:
    return triton is not None and triton_path(x, "NANOVLLM_FUSED_SAMPLER")


if triton is not None:

    @triton.jit
    def _log2(x, FAST: tl.constexpr):
        """log2 of float32 ``x``; FAST: the GPU's approximate instruction (one special-function op,
        an *absolute* error up to ~2^-22 for x in [0.5, 2]) instead of libdevice's polynomial (~25
        instructions, ~1 ulp relative). Only for a value whose absolute error is what matters."""
        if FAST:
            return tl.inline_asm_elementwise(
                "lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            return tl.log2(x)

    # the per-row pointers are slices of step buffers whose alignment changes with the batch:
    # one compiled variant, not one per alignment pattern (compiled mid-run otherwise)
    @triton.jit(
        do_not_specialize_on_alignment=["inv_temp_ptr", "seed_ptr", "val_ptr", "idx_ptr", "bad_ptr"],
        do_not_specialize=["chunk", "num_splits"],
    )
    def _sample_kernel(
        logits_ptr,
        stride_row,
        inv_temp_ptr,
        seed_ptr,
        val_ptr,
        idx_ptr,
        bad_ptr,
        chunk,
        num_splits,
        VOCAB: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLIT: tl.constexpr,
        FAST_LOG: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        """Program (row, split) takes the row's tokens [split * chunk, (split + 1) * chunk). Without
        SPLIT (one split) it writes the row's token and flag; with it, the split's best score, its
        token and flag, which _sample_merge_kernel reduces."""
        pdl.wait_then_release(PDL)
        row = tl.program_id(0)
        split = tl.program_id(1)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        inv_temp = tl.load(inv_temp_ptr + row)
        scale = inv_temp * 1.4426950408889634  # log2(e)
        seed = tl.load(seed_ptr + row)
        # a tile is [BLOCK / 4, 4]: token 4q + j takes word j of Philox counter q, so one Philox
        # evaluation serves four tokens (tl.rand runs one per token and keeps one of its four words).
        # The tile is loaded flat and reshaped, so each thread holds whole groups of four tokens
        # (a [BLOCK / 4, 4] load spreads a group over threads, which then all run its Philox).
        offs = tl.arange(0, BLOCK)
        quads = tl.arange(0, BLOCK // 4)
        lanes = tl.arange(0, 4)[None, :]
        best_val = tl.full((), float("-inf"), tl.float32)
        best_idx = tl.full((), 0, tl.int32) + split * chunk
        bad = tl.full((), 0, tl.int32)
        for tile in range(0, chunk // BLOCK):  # chunk: whole tiles, so a tile never crosses splits
            start = (split * (chunk // BLOCK) + tile) * BLOCK  # a multiple of BLOCK, visibly: vector loads
            flat = start + offs
            x = tl.load(row_ptr + flat, mask=flat < VOCAB, other=0.0).to(tl.float32)
            x = tl.reshape(x, [BLOCK // 4, 4])
            cols = tl.reshape(flat, [BLOCK // 4, 4])
            mask = cols < VOCAB
            is_bad = mask & ((x != x) | (tl.abs(x) == float("inf")))
            bad = tl.maximum(bad, tl.max(tl.max(is_bad.to(tl.int32), axis=1), axis=0))
            if inv_temp > 0:
                r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + quads)
                r = tl.where(
                    lanes < 2,
                    tl.where(lanes == 0, r0[:, None], r1[:, None]),
                    tl.where(lanes == 2, r2[:, None], r3[:, None]),
                )
                u = tl.uint_to_uniform_float(r)
                # base 2: x / T / ln 2 - log2(-log2 u) is (x / T + G) / ln 2 plus a constant, same argmax.
                # The inner log exactly (u near 1 gives -log2 u near 0, where an absolute error of
                # 2^-22 would be all of it: such a token drawn at any logit, or never); the outer one
                # fast (its absolute error is the score's)
                score = x * scale - _log2(-tl.log2(u), FAST_LOG)
            else:
                score = x
            score = tl.where(mask, score, float("-inf"))
            tile_val = tl.max(tl.max(score, axis=1), axis=0)
            # the first token holding it (torch.argmax's rule); none for a NaN maximum, never taken
            tile_idx = tl.min(tl.min(tl.where(score == tile_val, cols, VOCAB), axis=1), axis=0)
            take = tile_val > best_val  # strict: ties keep the earlier tile (first index)
            best_idx = tl.where(take, tile_idx, best_idx)
            best_val = tl.where(take, tile_val, best_val)
        if SPLIT:
            slot = row * num_splits + split
            tl.store(val_ptr + slot, best_val)
            tl.store(idx_ptr + slot, best_idx.to(tl.int64))
            tl.store(bad_ptr + slot, bad.to(tl.int64))
        else:
            tl.store(idx_ptr + row, best_idx.to(tl.int64))
            tl.store(bad_ptr + row, bad.to(tl.int64))

    @triton.jit(
        do_not_specialize=["num_splits"],
        do_not_specialize_on_alignment=["val_ptr", "idx_ptr", "bad_ptr", "token_ptr", "nonfinite_ptr"],
    )
    def _sample_merge_kernel(
        val_ptr, idx_ptr, bad_ptr, token_ptr, nonfinite_ptr, num_splits, SPLITS: tl.constexpr, PDL: tl.constexpr = False
    ):
        """A row's token: the best of its splits' (the earliest split on a tie: the first index)."""
        pdl.wait_then_release(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, SPLITS)
        mask = offs < num_splits
        base = row * num_splits
        vals = tl.load(val_ptr + base + offs, mask=mask, other=float("-inf"))
        idxs = tl.load(idx_ptr + base + offs, mask=mask, other=0)
        bads = tl.load(bad_ptr + base + offs, mask=mask, other=0)
        best = tl.max(vals, axis=0)
        # the first split holding the best score (an all -inf row: split 0, as unsplit)
        first = tl.min(tl.where((vals == best) & mask, offs, SPLITS), axis=0)
        token = tl.sum(tl.where(offs == first, idxs, 0), axis=0)
        tl.store(token_ptr + row, token)
        tl.store(nonfinite_ptr + row, tl.max(bads, axis=0))


_MAX_SPLITS = 64


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(n: int, vocab: int, block: int, device: torch.device) -> int:
    """How many programs share a row: enough that the grid covers the GPU about twice (a small
    batch otherwise leaves most SMs idle while each program streams its whole row: ~171 us per
    step at any batch on an H200), never a split under one tile."""
    if device.type == "cuda":
        sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 8  # the interpreter (tests): a few splits
    most = int(os.environ.get("NANOVLLM_SAMPLER_SPLITS", _MAX_SPLITS))  # 1: a whole row per program (A/B)
    return max(1, min(most, _MAX_SPLITS, triton.cdiv(vocab, block), triton.cdiv(2 * sms, max(n, 1))))


def sample(
    logits: torch.Tensor,
    inv_temp: torch.Tensor,
    seeds: torch.Tensor,
    block: int | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, vocab] (any float dtype, rows contiguous), inv_temp float32 [n] (0 = greedy),
    seeds int64 [n] -> (token ids int64 [n], non-finite flags int64 [n]). ``splits``: programs
    per row (default: ``num_splits``); the result does not depend on it."""
    n, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if inv_temp.shape != (n,) or seeds.shape != (n,):
        raise ValueError(f"inv_temp and seeds need shape ({n},), got {tuple(inv_temp.shape)} and {tuple(seeds.shape)}")
    out = torch.empty(2, n, dtype=torch.int64, device=logits.device)
    if not n:
        return out[0], out[1]
    block = block or max(4, min(4096, triton.next_power_of_2(vocab)))
    if block < 4 or block & (block - 1):
        raise ValueError(f"fused sampler block={block}: a power of two >= 4 (tiles of four-token Philox groups)")
    splits = min(splits or num_splits(n, vocab, block, logits.device), _MAX_SPLITS)  # the merge reads <= 64
    chunk = triton.cdiv(triton.cdiv(vocab, splits), block) * block  # whole tiles per split
    splits = triton.cdiv(vocab, chunk)  # none empty
    warps = 8 if block >= 2048 else 4
    # PTX: NVIDIA GPUs, not ROCm, not the interpreter (which cannot run inline assembly)
    fast_log = nvidia_ptx(logits)
    if splits == 1:
        _sample_kernel[(n, 1)](
            logits, logits.stride(0), inv_temp, seeds, out[0], out[0], out[1], chunk, 1,
            VOCAB=vocab, BLOCK=block, SPLIT=False, FAST_LOG=fast_log, num_warps=warps, **pdl.launch_args(logits),
        )  # fmt: skip
        return out[0], out[1]
    vals = torch.empty(n * splits, dtype=torch.float32, device=logits.device)
    part = torch.empty(2, n * splits, dtype=torch.int64, device=logits.device)
    _sample_kernel[(n, splits)](
        logits, logits.stride(0), inv_temp, seeds, vals, part[0], part[1], chunk, splits,
        VOCAB=vocab, BLOCK=block, SPLIT=True, FAST_LOG=fast_log, num_warps=warps, **pdl.launch_args(logits),
    )  # fmt: skip
    _sample_merge_kernel[(n,)](
        vals, part[0], part[1], out[0], out[1], splits, SPLITS=triton.next_power_of_2(_MAX_SPLITS),
        **pdl.launch_args(logits),
    )  # fmt: skip
    return out[0], out[1]
