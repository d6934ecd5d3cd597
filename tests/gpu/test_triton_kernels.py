"""Triton kernels against attention/torch_ref.py on fresh random inputs.

Every run: K/V caches start as NaN except the slots a sequence owns (a stray
read shows up as NaN), outputs start as NaN (an unwritten row fails), block
tables are random permutations (a wrong lookup reads someone else's block).

On a GPU (marker ``gpu``): bfloat16, block sizes 16..256, GQA 1/2/4/8, head_dim
64/128, contexts up to 4096. Under Triton's CPU interpreter
(``NANOVLLM_TRITON_INTERPRET=1`` and ``TRITON_INTERPRET=1``, see
test_triton_interpret.py): the same checks on a small grid in float16/float32
(the interpreter cannot multiply bfloat16).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

INTERPRET = os.environ.get("NANOVLLM_TRITON_INTERPRET") == "1"
pytestmark = [] if INTERPRET else [pytest.mark.gpu]
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPE = torch.float16 if INTERPRET else torch.bfloat16
MAX_REL_ERR = 1e-2

triton_ops = pytest.importorskip("nanovllm.attention.triton_ops", reason="needs triton")
from nanovllm.attention import torch_ref  # noqa: E402
from nanovllm.attention.metadata import AttentionMetadata  # noqa: E402
from nanovllm.attention.triton_backend import TritonBackend  # noqa: E402

# (block_size, group, head_dim): covers every block size, every GQA ratio and both head dims
# without compiling the whole cross product (compiles dominate the GPU run); under the interpreter
# (float16) the 128-slot blocks take the shipped 16-bit default, 128-key tiles with one
# block-table entry per tile, and the 16- and 64-slot blocks the per-key walk
if INTERPRET:
    SHAPES = [(16, 1, 64), (128, 2, 128), (64, 8, 64)]
else:
    SHAPES = [
        (16, 1, 128),
        (16, 2, 64),
        (16, 4, 128),
        (16, 8, 64),
        (32, 2, 128),
        (32, 8, 128),
        (64, 4, 64),
        (64, 1, 128),
        (128, 2, 128),
        (128, 8, 64),
        (256, 2, 128),
        (256, 4, 64),
        (256, 8, 128),
        (256, 1, 64),
    ]
NUM_KV_HEADS = 2


class PagedCase:
    """Random sequences (cached prefix ctx, new tokens q) in a shuffled paged cache."""

    def __init__(
        self,
        specs: list[tuple[int, int]],
        block_size: int,
        group: int,
        head_dim: int,
        seed: int,
        dtype=DTYPE,
        num_kv_heads: int = NUM_KV_HEADS,
    ):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.block_size, self.dtype = block_size, dtype
        seq_lens = [c + n for c, n in specs]
        need = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(need) + 3
        order = list(range(num_blocks))
        rng.shuffle(order)
        self.tables, taken = [], 0
        for n in need:
            self.tables.append(order[taken : taken + n])
            taken += n
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        slots = [
            t[p // block_size] * block_size + p % block_size for t, s in zip(self.tables, seq_lens) for p in range(s)
        ]
        kv = torch.randn(2, len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
        torch_ref.store_kv(kv[0], kv[1], self.k_cache, self.v_cache, torch.tensor(slots))
        total_q = sum(n for _, n in specs)
        self.q = torch.randn(total_q, num_kv_heads * group, head_dim, generator=gen).to(dtype)
        self.scale = head_dim**-0.5
        self.k_cache, self.v_cache, self.q = (t.to(DEVICE) for t in (self.k_cache, self.v_cache, self.q))
        self.meta = _meta(specs, self.tables, block_size, DEVICE)

    def reference(self) -> torch.Tensor:
        return torch_ref.paged_attention(
            self.q.cpu().float(),
            self.k_cache.cpu().float(),
            self.v_cache.cpu().float(),
            _meta_cpu(self.meta),
            self.scale,
        )


def _meta(specs, tables, block_size, device="cpu") -> AttentionMetadata:
    qsl = [0]
    for _, n in specs:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in specs]
    width = max(1, max(len(t) for t in tables))
    padded = [t + [0] * (width - len(t)) for t in tables]
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(n for _, n in specs),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )


def _meta_cpu(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        meta.slot_mapping.cpu(),
        meta.query_start_loc.cpu(),
        meta.seq_lens.cpu(),
        meta.block_tables.cpu(),
        meta.max_query_len,
        meta.max_seq_len,
        meta.block_size,
        meta.query_start_loc_cpu,
        meta.seq_lens_cpu,
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    out = out.cpu().float()
    assert not torch.isnan(out).any(), (
        f"{what}: NaN in output rows {torch.isnan(out).flatten(1).any(1).nonzero().flatten().tolist()[:10]}"
    )
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert err <= MAX_REL_ERR, f"{what}: relative error {err:.3e} > {MAX_REL_ERR}"


def _lengths(block_size: int, rng: random.Random, n: int, max_len: int) -> list[int]:
    """Edge lengths around block boundaries plus random ones, all in [1, max_len]."""
    edges = [1, 2, block_size - 1, block_size, block_size + 1, max_len]
    picks = edges + [rng.randint(1, max_len) for _ in range(max(0, n - len(edges)))]
    return [min(max(1, x), max_len) for x in picks][: max(n, len(edges))]


MAX_CTX = 200 if INTERPRET else 4096


# ----------------------------------------------------------------------- store
@pytest.mark.parametrize("block_size,group,head_dim", SHAPES[:4] if not INTERPRET else SHAPES[:2])
def test_store_kv_skips_minus_one_slots(block_size, group, head_dim):
    gen = torch.Generator().manual_seed(block_size * 7 + head_dim)
    num_blocks, t = 6, 40
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(DTYPE)
    v_cache = torch.randn(shape, generator=gen).to(DTYPE)
    # K as a strided view of a fused qkv row, V contiguous: the layer passes both kinds
    qkv = torch.randn(t, (group + 2) * NUM_KV_HEADS * head_dim, generator=gen).to(DTYPE)
    k = qkv[:, group * NUM_KV_HEADS * head_dim : (group + 1) * NUM_KV_HEADS * head_dim].view(t, NUM_KV_HEADS, head_dim)
    v = qkv[:, (group + 1) * NUM_KV_HEADS * head_dim :].reshape(t, NUM_KV_HEADS, head_dim).contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[::3] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_ref.store_kv(k, v, ref_k, ref_v, slots)
    dev = [x.to(DEVICE) for x in (k, v, k_cache, v_cache, slots)]
    triton_ops.store_kv(*dev)
    assert torch.equal(dev[2].cpu(), ref_k) and torch.equal(dev[3].cpu(), ref_v)


# ---------------------------------------------------------------------- decode
@pytest.mark.parametrize("block_size,group,head_dim", SHAPES)
@pytest.mark.parametrize("splits", [1, 3] if INTERPRET else [1, 3, triton_ops.MAX_SPLITS])
def test_decode_matches_reference(block_size, group, head_dim, splits):
    rng = random.Random(block_size * 1000 + group * 10 + head_dim + splits)
    lens = _lengths(block_size, rng, 5 if INTERPRET else 9, MAX_CTX)
    case = PagedCase([(n - 1, 1) for n in lens], block_size, group, head_dim, seed=rng.randint(0, 1 << 30))
    out = torch.full_like(case.q, float("nan"))
    triton_ops.paged_decode(
        case.q,
        case.k_cache,
        case.v_cache,
        case.meta.block_tables,
        case.meta.seq_lens,
        case.scale,
        num_splits=splits,
        out=out,
    )
    assert_close(out, case.reference(), f"decode bs={block_size} g={group} d={head_dim} splits={splits}")


@pytest.mark.parametrize("splits", [1, 4, triton_ops.MAX_SPLITS])
def test_decode_padding_rows_and_empty_splits_give_zeros(splits):
    """seq_len 0 (graph padding) -> zeros; short contexts leave most splits empty -> no NaN."""
    block_size, group, head_dim = 16, 2, 64
    case = PagedCase([(0, 1), (1, 1), (16, 1)], block_size, group, head_dim, seed=splits)
    q = torch.cat([case.q, torch.randn_like(case.q[:2])])
    seq_lens = torch.cat([case.meta.seq_lens, torch.zeros(2, dtype=torch.int32, device=DEVICE)])
    tables = torch.cat([case.meta.block_tables, torch.zeros_like(case.meta.block_tables[:2])])
    out = torch.full_like(q, float("nan"))
    triton_ops.paged_decode(q, case.k_cache, case.v_cache, tables, seq_lens, case.scale, num_splits=splits, out=out)
    assert_close(out[:3], case.reference(), f"decode splits={splits}")
    assert torch.equal(out[3:].cpu(), torch.zeros_like(out[3:].cpu())), "padding rows must be zeros"


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_tile_block_addressing(splits, monkeypatch):
    """TILE_BLOCK (one block-table entry per key tile; decode_tile_flags sets it wherever the
    blocks hold whole tiles) forced on with 64-key tiles. Control: forced on where a 64-key tile
    straddles 16-slot blocks, the output misses."""
    monkeypatch.setitem(triton_ops.DECODE_FLAG_OVERRIDES, "TILE_BLOCK", True)

    def run(block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = random.Random(block_size * 7 + splits)
        lens = _lengths(block_size, rng, 5 if INTERPRET else 9, MAX_CTX)
        case = PagedCase([(n - 1, 1) for n in lens], block_size, 2, 64, seed=rng.randint(0, 1 << 30))
        pad = torch.full_like(case.k_cache[:4], float("nan"))  # a straddling tile reads past the last block
        k, v = torch.cat([case.k_cache, pad]), torch.cat([case.v_cache, pad])
        out = torch.full_like(case.q, float("nan"))
        cfg = triton_ops.KernelConfig(16, 64, 4, 3)
        tables, lens_t = case.meta.block_tables, case.meta.seq_lens
        triton_ops.paged_decode(case.q, k, v, tables, lens_t, case.scale, num_splits=splits, out=out, config=cfg)
        return out, case.reference()

    out, ref = run(64)
    assert_close(out, ref, f"decode, tile block forced, bs=64 splits={splits}")
    out, ref = run(16)
    with pytest.raises(AssertionError):
        assert_close(out, ref, "control: tiles straddling blocks")


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """The same cache stored head-major (the engine's layout), seen as [blocks, slots, heads, d]."""
    return x.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def _decode_tma(case: PagedCase, splits: int, block_n: int) -> torch.Tensor:
    k, v = _head_major(case.k_cache), _head_major(case.v_cache)
    assert triton_ops.tma_descriptors(k, v, block_n) is not None, "the case must take the TMA path"
    out = torch.full_like(case.q, float("nan"))
    cfg = triton_ops.KernelConfig(16, block_n, 4, 3)
    tables, lens = case.meta.block_tables, case.meta.seq_lens
    triton_ops.paged_decode(case.q, k, v, tables, lens, case.scale, num_splits=splits, out=out, config=cfg)
    return out


TMA_SHAPES = [(128, 2, 64, 64)] if INTERPRET else [(256, 2, 128, 128), (128, 8, 64, 128), (64, 1, 128, 64)]


@pytest.mark.parametrize("block_size,group,head_dim,block_n", TMA_SHAPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_tma_tiles(block_size, group, head_dim, block_n, splits, monkeypatch):
    """TMA forced on (head-major cache, one box of ``block_n`` keys per tile). Unowned slots hold
    NaN, so a box that runs past a sequence's end reads NaN keys and values: the kernel must mask
    both (the lengths include ones that end mid-tile)."""
    monkeypatch.setitem(triton_ops.DECODE_FLAG_OVERRIDES, "TMA", True)
    rng = random.Random(block_size * 3 + splits)
    lens = _lengths(block_size, rng, 5 if INTERPRET else 9, MAX_CTX)
    assert any(n % block_n for n in lens)
    case = PagedCase([(n - 1, 1) for n in lens], block_size, group, head_dim, seed=rng.randint(0, 1 << 30))
    assert_close(_decode_tma(case, splits, block_n), case.reference(), f"decode TMA bs={block_size} splits={splits}")


@pytest.mark.skipif(
    not INTERPRET, reason="the mutant kernel is built from source text, which only the interpreter runs"
)
def test_decode_tma_control_unmasked_values_give_nan(monkeypatch):
    """Negative control of test_decode_tma_tiles: the tile step without its V mask on the partial
    last tile (a source mutant) fails that test's check on NaN."""
    import inspect
    import textwrap

    import triton

    src = textwrap.dedent(inspect.getsource(triton_ops._decode_tile.fn))
    line = "        v = tl.where(n_mask[:, None], v, 0.0)\n"
    assert src.count(line) == 1
    scope = dict(vars(triton_ops))
    exec(src.replace(line, "        pass\n").replace("@triton.jit\n", ""), scope)
    monkeypatch.setattr(triton_ops, "_decode_tile", triton.jit(scope["_decode_tile"]))
    monkeypatch.setitem(triton_ops.DECODE_FLAG_OVERRIDES, "TMA", True)
    case = PagedCase([(40, 1), (99, 1)], 128, 2, 64, seed=5)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(_decode_tma(case, 1, 64), case.reference(), "control: V unmasked")


# ---------------------------------------------------------- decode, stream-K
decode_streamk = pytest.importorskip("nanovllm.attention.decode_streamk", reason="needs triton")
STREAMK_SHAPE = (128, 2, 64) if INTERPRET else (256, 2, 128)


def _streamk_case(seed: int) -> tuple[PagedCase, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A case of edge lengths (whole tiles, one key, a key past a tile) with two padding rows
    (seq_len 0, graph padding) in the middle and at the end: q, tables, lengths with them."""
    block_size, group, head_dim = STREAMK_SHAPE
    rng = random.Random(seed)
    lens = _lengths(block_size, rng, 5 if INTERPRET else 9, MAX_CTX)
    case = PagedCase([(n - 1, 1) for n in lens], block_size, group, head_dim, seed=rng.randint(0, 1 << 30))
    pad = [1, len(lens) + 1]  # row positions of the padding rows after insertion
    q, tables, seq_lens = case.q, case.meta.block_tables, case.meta.seq_lens
    for at in pad:
        q = torch.cat([q[:at], torch.randn_like(q[:1]), q[at:]])
        tables = torch.cat([tables[:at], torch.zeros_like(tables[:1]), tables[at:]])
        seq_lens = torch.cat([seq_lens[:at], torch.zeros_like(seq_lens[:1]), seq_lens[at:]])
    return case, q, tables, seq_lens


def _real_rows(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = [i for i in range(out.shape[0]) if i not in (1, out.shape[0] - 1)]
    return out[keep], out[[1, out.shape[0] - 1]]


@pytest.mark.parametrize("programs", [1, 3, 7, 64])
@pytest.mark.parametrize("tma", [False, True])
def test_decode_streamk_matches_reference(programs, tma, monkeypatch):
    """Stream-K decode (``decode_streamk``): a fixed grid walks all items' key tiles, so programs
    start and end mid-item (3, 7), one walks everything (1), or many get no tile (64 at the
    interpreter's small contexts); each item's partials are merged. Padding rows (seq_len 0) give
    zeros. ``tma``: the tiles copied as boxes from the head-major cache (emulated by the
    interpreter)."""
    case, q, tables, seq_lens = _streamk_case(programs * 2 + tma)
    k, v = case.k_cache, case.v_cache
    config = None
    made = []
    if tma:
        monkeypatch.setitem(triton_ops.DECODE_FLAG_OVERRIDES, "TMA", True)
        k, v = _head_major(k), _head_major(v)
        config = triton_ops.KernelConfig(16, 64, 4, 3) if INTERPRET else None
        real_descriptors = triton_ops.tma_descriptors
        monkeypatch.setattr(triton_ops, "tma_descriptors", lambda *a: made.append(real_descriptors(*a)) or made[-1])
    out = torch.full_like(q, float("nan"))
    decode_streamk.paged_decode_streamk(
        q, k, v, tables, seq_lens, case.scale, programs=programs, out=out, config=config
    )
    assert not tma or (made and all(d is not None for d in made)), "tma: the launch must have used TMA descriptors"
    real, padding = _real_rows(out)
    assert_close(real, case.reference(), f"stream-K decode programs={programs} tma={tma}")
    assert torch.equal(padding.cpu(), torch.zeros_like(padding.cpu())), "padding rows must be zeros"


def test_decode_streamk_all_padding_gives_zeros():
    """A batch of padding rows only (seq_len 0: the CUDA-graph warm-up's batch) has no tile at all:
    zeros, and no division by a share of 0 tiles (numpy warns under the interpreter: an error here)."""
    import warnings

    case = PagedCase([(3, 1), (9, 1)], 16, 2, 64, seed=4)
    seq_lens = torch.zeros_like(case.meta.seq_lens)
    out = torch.full_like(case.q, float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        decode_streamk.paged_decode_streamk(
            case.q, case.k_cache, case.v_cache, case.meta.block_tables, seq_lens, case.scale, programs=5, out=out
        )
    assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))


@pytest.mark.skipif(
    not INTERPRET, reason="the mutant kernels are built from source text, which only the interpreter runs"
)
@pytest.mark.parametrize(
    "old,new",
    [
        # every program writes an item's partial to the item's own slot: items split between
        # programs overwrite each other's partials
        ("row = (item + pid) * GROUP + offs_g", "row = item * GROUP + offs_g"),
        # a program that starts mid-item keeps the query of zeros it started with
        ("first = (j == 0) | (t == t0)", "first = j == 0"),
        # an item whose keys fill its last tile exactly never writes its partial (unless that
        # tile is also its program's last)
        ("if (n0 + BLOCK_N >= seq_len) |", "if (n0 + BLOCK_N > seq_len) |"),
    ],
)
def test_decode_streamk_controls(old, new, monkeypatch):
    """Negative controls of test_decode_streamk_matches_reference: on a case where programs start
    mid-item, the shipped stream-K kernel passes the check and each of two one-line source mutants
    of it fails it."""
    import inspect
    import textwrap

    import triton

    block_size, group, head_dim = STREAMK_SHAPE
    case = PagedCase([(299, 1), (255, 1), (299, 1)], block_size, group, head_dim, seed=6)
    # 2 heads x (3 + 2 + 3) tiles of 128 keys = 16 tiles, items starting at tiles 0, 3, 6, 8, 10
    # and 13; 4 programs take 4 each, so the second and the fourth start mid-item, and the middle
    # sequence's 256 keys fill its last tile exactly: its second item (tiles 8-9) ends inside the
    # third program's share
    assert triton_ops.decode_config(head_dim, case.q.dtype).block_n == 128 and NUM_KV_HEADS == 2

    def run() -> torch.Tensor:
        out = torch.full_like(case.q, float("nan"))
        tables, seq_lens = case.meta.block_tables, case.meta.seq_lens
        decode_streamk.paged_decode_streamk(
            case.q, case.k_cache, case.v_cache, tables, seq_lens, case.scale, programs=4, out=out
        )
        return out

    assert_close(run(), case.reference(), "stream-K decode, programs starting mid-item")
    src = textwrap.dedent(inspect.getsource(decode_streamk._decode_streamk_kernel.fn))
    assert src.count(old) == 1, old
    src = src[src.index("def _decode_streamk_kernel") :]
    scope = dict(vars(decode_streamk))
    exec(src.replace(old, new), scope)
    monkeypatch.setattr(decode_streamk, "_decode_streamk_kernel", triton.jit(scope["_decode_streamk_kernel"]))
    with pytest.raises(AssertionError):
        assert_close(run(), case.reference(), f"control: {new}")


# --------------------------------------------------------------------- prefill
@pytest.mark.parametrize("block_size,group,head_dim", SHAPES)
def test_prefill_with_cached_prefix_and_chunks(block_size, group, head_dim):
    """Fresh prompts, chunks after a cached prefix, single-token rows: one packed batch."""
    rng = random.Random(block_size * 31 + group * 7 + head_dim)
    max_q = 50 if INTERPRET else 600
    specs = [
        (0, 1),
        (0, rng.randint(2, max_q)),
        (block_size, rng.randint(1, max_q)),
        (rng.randint(1, MAX_CTX - max_q), rng.randint(1, max_q)),
        (MAX_CTX - 1, 1),
        (rng.randint(0, MAX_CTX - max_q), max_q),
    ]
    case = PagedCase(specs, block_size, group, head_dim, seed=rng.randint(0, 1 << 30))
    out = torch.full_like(case.q, float("nan"))
    triton_ops.paged_prefill(
        case.q,
        case.k_cache,
        case.v_cache,
        case.meta.query_start_loc,
        case.meta.seq_lens,
        case.meta.block_tables,
        case.scale,
        out=out,
    )
    assert_close(out, case.reference(), f"prefill bs={block_size} g={group} d={head_dim}")


@pytest.mark.parametrize("split_mask,tile_block", [(True, True), (True, False), (False, True), (False, False)])
def test_prefill_tile_flags(split_mask, tile_block, monkeypatch):
    """Each combination of the prefill kernel's key-walk flags (prefill_tile_flags) on chunks after
    cached prefixes of every alignment. Control: TILE_BLOCK forced where 64-key tiles straddle
    16-slot blocks, the output misses."""
    monkeypatch.setitem(triton_ops.PREFILL_FLAG_OVERRIDES, "SPLIT_MASK", split_mask)
    monkeypatch.setitem(triton_ops.PREFILL_FLAG_OVERRIDES, "TILE_BLOCK", tile_block)

    def run(block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = random.Random(block_size * 13 + split_mask * 2 + tile_block)
        max_q = 70 if INTERPRET else 300
        specs = [(0, rng.randint(65, max_q)), (rng.randint(1, 200), rng.randint(1, max_q)), (64, 64), (5, 1)]
        case = PagedCase(specs, block_size, 2, 64, seed=rng.randint(0, 1 << 30))
        pad = torch.full_like(case.k_cache[:4], float("nan"))  # a straddling tile reads past the last block
        k, v = torch.cat([case.k_cache, pad]), torch.cat([case.v_cache, pad])
        out = torch.full_like(case.q, float("nan"))
        meta = case.meta
        cfg = triton_ops.KernelConfig(64, 64, 4, 2)
        triton_ops.paged_prefill(
            case.q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_tables, case.scale, out=out, config=cfg
        )
        return out, case.reference()

    out, ref = run(64)
    assert_close(out, ref, f"prefill split_mask={split_mask} tile_block={tile_block}")
    if tile_block:
        out, ref = run(16)
        with pytest.raises(AssertionError):
            assert_close(out, ref, "control: tiles straddling blocks")


def test_prefill_long_fresh_prompt():
    block_size, group, head_dim = (16, 2, 64) if INTERPRET else (256, 2, 128)
    n = 200 if INTERPRET else 4096
    case = PagedCase([(0, n)], block_size, group, head_dim, seed=5)
    out = torch.full_like(case.q, float("nan"))
    triton_ops.paged_prefill(
        case.q,
        case.k_cache,
        case.v_cache,
        case.meta.query_start_loc,
        case.meta.seq_lens,
        case.meta.block_tables,
        case.scale,
        out=out,
    )
    assert_close(out, case.reference(), "long prefill")


# --------------------------------------------------------------------- backend
@pytest.mark.parametrize("decode", [True, False])
def test_backend_dispatch(decode):
    specs = [(5, 1), (40, 1), (0, 1)] if decode else [(5, 1), (0, 23), (17, 4)]
    case = PagedCase(specs, 16, 4, 64, seed=11)
    backend = TritonBackend()
    out = backend.forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, case.reference(), f"backend decode={decode}")


def _spy_streamk(monkeypatch) -> list[int]:
    """The batch sizes ``paged_decode_streamk`` is called with from now on (it still runs)."""
    calls: list[int] = []
    real = decode_streamk.paged_decode_streamk
    monkeypatch.setattr(
        decode_streamk, "paged_decode_streamk", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw)
    )
    return calls


def test_backend_streamk_switch_reserve_and_growth(monkeypatch):
    """``NANOVLLM_DECODE_STREAMK`` (``triton_backend.DECODE_STREAMK``): "1" sends decode-only steps
    to the stream-K kernel, with the reference's result; "fp8" leaves a 16-bit cache to the shipped
    kernel (the control that the spy sees only what the switch sends). ``reserve`` sizes its
    buffers, and a later step that needs more raises instead of freeing what graphs would read."""
    from nanovllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "STREAMK_BATCHES", (1, 1024))  # every batch of the test

    case = PagedCase([(5, 1), (40, 1), (0, 1), (150, 1)], 16, 4, 64, seed=13)
    calls = _spy_streamk(monkeypatch)
    monkeypatch.setattr(triton_backend, "DECODE_STREAMK", "fp8")
    out = TritonBackend().forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [], "fp8: a 16-bit cache keeps the shipped kernel"
    assert_close(out, case.reference(), "backend, stream-K for FP8 only")

    monkeypatch.setattr(triton_backend, "DECODE_STREAMK", "1")
    backend = TritonBackend()
    heads, kv_heads, d = case.q.shape[1], case.k_cache.shape[2], case.q.shape[2]
    width = case.meta.block_tables.shape[1] * 16
    backend.reserve(4, heads, kv_heads, d, case.q.device, case.k_cache.dtype, max_context=width)
    out = backend.forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [4]
    assert_close(out, case.reference(), "backend, stream-K")
    wider = case.meta.block_tables.repeat(1, 4)  # a table wider than reserve() was told
    with pytest.raises(RuntimeError, match="reserve"):
        backend._decode(case.q, case.k_cache, case.v_cache, wider, case.meta.seq_lens, case.scale, 1.0, 1.0)


def test_backend_streamk_batches_keep_other_batches_on_the_shipped_kernel(monkeypatch):
    """``STREAMK_BATCHES`` (``NANOVLLM_DECODE_STREAMK_BATCHES``, LO:HI): with the switch on, a decode
    of fewer rows than LO or more than HI goes to the shipped kernel, one within the range to
    stream-K, each with the reference's result (controls: at either end the spy sees the call)."""
    from nanovllm.attention import triton_backend

    case = PagedCase([(5, 1), (40, 1), (0, 1), (150, 1)], 16, 4, 64, seed=17)
    calls = _spy_streamk(monkeypatch)
    monkeypatch.setattr(triton_backend, "DECODE_STREAMK", "1")
    for batches, taken in (((1, 3), []), ((5, 8), []), ((1, 4), [4]), ((4, 8), [4])):
        calls.clear()
        monkeypatch.setattr(triton_backend, "STREAMK_BATCHES", batches)
        out = TritonBackend().forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
        assert calls == taken, f"4 rows, stream-K for batches {batches}"
        assert_close(out, case.reference(), f"backend, stream-K batches {batches}")


def test_backend_reserves_streamk_only_for_the_batches_it_takes(monkeypatch):
    """``reserve`` sizes the stream-K buffers for at most HI sequences, for ``max_num_seqs`` of
    exactly LO too (a graph of that batch is captured on them), and for none below LO."""
    from nanovllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "DECODE_STREAMK", "1")
    monkeypatch.setattr(triton_backend, "STREAMK_BATCHES", (4, 6))
    backend = TritonBackend()
    backend.reserve(10, 8, 2, 64, torch.device("cpu"), torch.float32, max_context=256)
    assert backend._streamk is not None and backend._streamk.size[0] == 6
    backend = TritonBackend()
    backend.reserve(4, 8, 2, 64, torch.device("cpu"), torch.float32, max_context=256)
    assert backend._streamk is not None and backend._streamk.size[0] == 4, "max_num_seqs at LO: reserved"
    backend = TritonBackend()
    backend.reserve(3, 8, 2, 64, torch.device("cpu"), torch.float32, max_context=256)
    assert backend._streamk is None


@pytest.mark.parametrize("bad", ["0:8", "9:8", "16", "x:y", "-1:4"])
def test_streamk_batches_setting_is_checked(bad):
    """A bad ``NANOVLLM_DECODE_STREAMK_BATCHES`` is refused at import, naming the variable."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", "import nanovllm.attention.triton_backend"],
        env={**os.environ, "NANOVLLM_DECODE_STREAMK_BATCHES": bad},
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and "NANOVLLM_DECODE_STREAMK_BATCHES" in run.stderr, (bad, run.stderr[-300:])


def _mixed_case():
    """Nine leading decodes (the running sequences of a mixed step), then a fresh prompt, a chunk
    after a cached prefix, a decode between prompts and a last chunk."""
    specs = [(c, 1) for c in (5, 40, 0, 16, 17, 3, 31, 64, 9)] + [(0, 23), (17, 4), (12, 1), (33, 6)]
    return specs, PagedCase(specs, 16, 2, 64, seed=21)


def _assert_rows(out: torch.Tensor, ref: torch.Tensor, specs, what: str) -> None:
    """Per sequence: one wrong sequence fails the check even where the whole output's error would not."""
    row = 0
    for i, (_, n) in enumerate(specs):
        assert_close(out[row : row + n], ref[row : row + n], f"{what}, sequence {i}")
        row += n


def test_backend_mixed_step_gives_leading_decodes_to_the_decode_kernel(monkeypatch):
    from nanovllm.attention import triton_backend

    specs, case = _mixed_case()
    assert case.meta.num_leading_decodes == 9
    monkeypatch.setattr(triton_backend, "MIN_SPLIT_DECODES", 8)  # the default
    calls = []
    real = triton_ops.paged_decode
    monkeypatch.setattr(triton_ops, "paged_decode", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    out = TritonBackend().forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [9], calls
    _assert_rows(out, case.reference(), specs, "mixed step")
    # under the threshold the whole step stays in the prefill kernel, with the same result
    monkeypatch.setattr(triton_backend, "MIN_SPLIT_DECODES", 10)
    calls.clear()
    out = TritonBackend().forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == []
    _assert_rows(out, case.reference(), specs, "mixed step, no split")
    monkeypatch.setattr(triton_backend, "MIN_SPLIT_DECODES", None)  # NANOVLLM_MIXED_DECODE_SPLIT=0
    out = TritonBackend().forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == []
    _assert_rows(out, case.reference(), specs, "mixed step, split off")


def test_backend_mixed_step_with_streamk_writes_the_leading_decodes(monkeypatch):
    """With the stream-K decode on, a mixed step's leading decodes go to it and land in the step's
    output rows (it writes into the slice it is given), the prompts to the prefill kernel."""
    from nanovllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "STREAMK_BATCHES", (1, 1024))  # every batch of the test

    specs, case = _mixed_case()
    monkeypatch.setattr(triton_backend, "MIN_SPLIT_DECODES", 8)
    monkeypatch.setattr(triton_backend, "DECODE_STREAMK", "1")
    calls = _spy_streamk(monkeypatch)
    out = TritonBackend().forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert calls == [9], calls
    _assert_rows(out, case.reference(), specs, "mixed step, stream-K")


def test_mixed_step_check_sees_a_prompt_row_taken_for_a_decode(monkeypatch):
    """Negative control: the first prompt counted among the leading decodes (its first row
    attends to its whole prompt, the others are never written) fails the per-sequence check."""
    from nanovllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "MIN_SPLIT_DECODES", 8)
    specs, case = _mixed_case()
    case.meta.__dict__["num_leading_decodes"] = 10  # the cached count, miscounted on purpose
    out = TritonBackend().forward(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    with pytest.raises(AssertionError):
        _assert_rows(out, case.reference(), specs, "control")


def test_float32_uses_exact_dot():
    """float32 models (the exact-greedy tests) get IEEE float32 products, not TF32."""
    case = PagedCase([(50, 1), (3, 1)], 16, 2, 64, seed=3, dtype=torch.float32)
    out = triton_ops.paged_decode(
        case.q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens, case.scale
    )
    err = ((out.cpu() - case.reference()).norm() / case.reference().norm()).item()
    assert err < 1e-5, f"float32 decode relative error {err:.2e}"


# ------------------------------------------------------- head-major cache storage
def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The engine's cache (``TritonBackend.new_kv_cache``): head-major storage, slot-major view."""
    nb, bs, kvh, d = cache.shape
    out = TritonBackend.new_kv_cache(nb, bs, kvh, d, cache.dtype, cache.device)
    assert out.shape == cache.shape and not out.is_contiguous(), "storage must be head-major"
    out.copy_(cache)
    return out


@pytest.mark.parametrize("splits", [1, 3])
def test_kernels_read_and_write_a_head_major_cache(splits):
    """Store, decode and prefill on the engine's head-major storage give what they give on the
    reference's slot-major cache. Control: the same bytes read as if they were slot-major miss."""
    rng = random.Random(90 + splits)
    block_size, group, head_dim = 16, 2, 64
    lens = _lengths(block_size, rng, 5 if INTERPRET else 9, MAX_CTX)
    case = PagedCase([(n - 1, 1) for n in lens], block_size, group, head_dim, seed=rng.randint(0, 1 << 30))
    k, v = _head_major(case.k_cache), _head_major(case.v_cache)
    tables, lens_t = case.meta.block_tables, case.meta.seq_lens
    out = torch.full_like(case.q, float("nan"))
    triton_ops.paged_decode(case.q, k, v, tables, lens_t, case.scale, num_splits=splits, out=out)
    assert_close(out, case.reference(), f"decode on a head-major cache, splits={splits}")
    slot_major_bytes = k.transpose(1, 2).contiguous().view(k.shape), v.transpose(1, 2).contiguous().view(v.shape)
    wrong = triton_ops.paged_decode(case.q, *slot_major_bytes, tables, lens_t, case.scale, num_splits=splits)
    with pytest.raises(AssertionError):
        assert_close(wrong, case.reference(), "control: head-major bytes read as slot-major")

    chunks = [(c, n) for c, n in [(0, 17), (5, 9), (40, 3)]]
    pre = PagedCase(chunks, block_size, group, head_dim, seed=splits)
    pk, pv = _head_major(pre.k_cache), _head_major(pre.v_cache)
    m = pre.meta
    got = triton_ops.paged_prefill(pre.q, pk, pv, m.query_start_loc, m.seq_lens, m.block_tables, pre.scale)
    assert_close(got, pre.reference(), "prefill on a head-major cache")

    gen = torch.Generator().manual_seed(splits)
    new = torch.randn(2, 7, NUM_KV_HEADS, head_dim, generator=gen).to(DTYPE)
    slots = torch.randperm(k.shape[0] * block_size, generator=gen)[:7]
    ref_k, ref_v = case.k_cache.cpu().clone(), case.v_cache.cpu().clone()
    torch_ref.store_kv(new[0], new[1], ref_k, ref_v, slots)
    triton_ops.store_kv(new[0].to(DEVICE), new[1].to(DEVICE), k, v, slots.to(DEVICE))
    for got_cache, ref_cache in ((k, ref_k), (v, ref_v)):  # unused slots hold NaN in both
        assert torch.allclose(got_cache.cpu(), ref_cache, rtol=0, atol=0, equal_nan=True), "store, head-major cache"
