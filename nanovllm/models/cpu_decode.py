"""A CPU decode step's decoder layers in one C call (``cpu_kernels/decode_layers.c``).

On the CPU each decoder layer is ten kernel calls (RMSNorm, q/k/v, RoPE, the cache write, attention,
o, RMSNorm, gate/up, SiLU, down), and between two of them runs Python: the module calls, the
wrappers' checks, new output tensors. On the 2-core development machine that Python cost ~40 us a
kernel in decode steps, three times what it costs with the caches warm: each kernel streams
weights or K/V through the caches, and the interpreter fetches its own code and data again after it.
That was ~1.5 s of the ~11 s CPU benchmark workload. Here the layers' kernels run back to back in C,
each given what its Python wrapper gives it, so the step's logits are the same bitwise (the tests
compare the two paths); Python runs once per step.

It applies where every kernel of the Python path is the compiled one: float32 weights packed for the
rows kernel, the C RMSNorm and SiLU (their lane counts found), the CPU attention backend with a
float32 cache, one rank (no tensor parallelism), no q/k norm (Qwen3 keeps the layers), decode-only
steps of at most ``2 * cpu_linear.MLP_ROW_TILE`` rows. ``NANOVLLM_CPU_FUSED_DECODE=0`` keeps the
Python layers (A/B runs, tests).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import weakref

import torch

from nanovllm import cpu_kernels
from nanovllm.attention.backends import TorchBackend
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.cpu_kernels import decode_layers as c
from nanovllm.layers import cpu_linear, triton_switch
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.parallel import tp_size

logger = logging.getLogger(__name__)
SWITCH = "NANOVLLM_CPU_FUSED_DECODE"

# Where any function the Python layers call has been replaced (a profiler's or a test's wrapper, an
# injected bug of the mutant table), the step runs the Python layers, so that the replacement sees every
# call, as torch's own fast paths step aside for hooks. "Replaced" is told by the function itself, not
# by what was there at import, so the order of imports and patches does not matter.
_KERNEL_NAMES = (
    "rows_linear",
    "paged_attention",
    "store_kv",
    "rotary_neox_",
    "rms_norm",
    "silu_and_mul",
    "applies",
    "elementwise_applies",
    "rms_norm_applies",
    "silu_applies",
    "_rms_norm_call",
    "_silu_call",
)


@functools.cache  # functions are hashable and few: asked every decode step
def _own(f) -> bool:
    """A function defined in nanovllm's own source files: not a wrapper (``functools.wraps`` or a
    closure), nor a copy compiled elsewhere into a nanovllm module's globals."""
    f = getattr(f, "__func__", f)
    module, name = getattr(f, "__module__", None) or "", getattr(f, "__qualname__", "<")
    if not module.startswith("nanovllm.") or "<" in name or hasattr(f, "__wrapped__"):
        return False
    code, source = getattr(f, "__code__", None), getattr(sys.modules.get(module), "__file__", None)
    return code is not None and code.co_filename == source


def python_path_replaced(modules, classes) -> bool:
    """Whether a kernel wrapper, a forward of the layers' modules (``modules``: every module of every
    layer, ``classes``: their classes; the class's forward and any set on the module itself), the CPU
    attention backend or the linear dispatch is not nanovllm's own, or a forward hook is set (on a
    module or globally): then the Python layers run the step."""
    from nanovllm.layers import linear

    functions = [getattr(cpu_kernels, name) for name in _KERNEL_NAMES]
    functions += [cls.forward for cls in classes]
    functions += [TorchBackend.store_kv, TorchBackend.forward, linear.linear, cpu_linear.linear]
    if not all(_own(f) for f in functions):
        return True
    for m in modules:
        d = m.__dict__
        if d["_forward_hooks"] or d["_forward_pre_hooks"] or "forward" in d:
            return True
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def _float32_cpu(t: torch.Tensor | None) -> bool:
    """None (no bias), or a contiguous float32 CPU tensor the C side can read by its address."""
    return t is None or (cpu_kernels._float32_cpu(t) and t.is_contiguous())


def _linear(module) -> c.DecodeLinear | None:
    packed = module.packed_weight
    if not isinstance(packed, cpu_linear.RowsWeight) or not _float32_cpu(module.bias):
        return None
    bias = None if module.bias is None else module.bias.data_ptr()
    form = 0 if packed.format == "f32" else cpu_kernels.ROWS_FORMATS[packed.format][0]
    return c.DecodeLinear(packed.strips.data_ptr(), bias, packed.n, packed.k, packed.segment, form)


class FusedDecode:
    """The C structures of one model's layers (weights, caches, tables), built once; ``run`` per step."""

    def __init__(
        self,
        model,
        kernels: cpu_kernels.Kernels,
        layers: list[c.DecodeLayer],
        sizes: tuple[int, int],
        lanes: tuple[int, int],
    ):
        self.modules = [m for layer in model.layers for m in layer.modules()]
        self.classes = {type(m) for m in self.modules}
        first = model.layers[0]
        attn = first.self_attn
        rope = attn.rotary_emb
        self.kernels = kernels
        self.layers = (c.DecodeLayer * len(layers))(*layers)
        self.hidden, self.intermediate = sizes
        k_cache = attn.attn.k_cache
        self.model = c.DecodeModel(
            len(layers),
            self.hidden,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            self.intermediate,
            k_cache.shape[0],
            k_cache.shape[2],
            rope.cos.data_ptr(),
            rope.sin.data_ptr(),
            rope.cos.stride(0),
            rope.cos.shape[0],
            attn.attn.scale,
            *lanes,
        )
        self.widths = dict(
            normed=self.hidden,
            qkv=(attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim,
            attn=attn.num_heads * attn.head_dim,
            proj=self.hidden,
            gate_up=2 * self.intermediate,
            act=self.intermediate,
            residual0=self.hidden,
            residual1=self.hidden,
        )

    @staticmethod
    def applies(hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        return (
            meta.is_decode_only
            and hidden.dim() == 2
            and hidden.dtype == torch.float32
            and hidden.device.type == "cpu"
            and hidden.shape[0] == meta.num_seqs
            and cpu_linear.mlp_row_tile(hidden) is None
        )

    def run(
        self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the embedded tokens [rows, hidden] -> (the last layer's output, its residual), as the
        layers' forward gives them."""
        rows = hidden.shape[0]
        if hidden.shape[1] != self.hidden:
            raise ValueError(f"decode layers: hidden states of width {hidden.shape[1]}, the layers take {self.hidden}")
        hidden = hidden.contiguous()
        views = {name: torch.empty(rows, width, dtype=torch.float32) for name, width in self.widths.items()}
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        lens = meta.seq_lens.to(torch.int32).contiguous()
        step = c.DecodeStep(
            rows,
            tables.shape[1],
            torch.get_num_threads(),
            cpu_kernels._torch_pieces(rows * self.intermediate),
            positions.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            hidden.data_ptr(),
            *(views[name].data_ptr() for name in ("normed", "qkv", "attn", "proj", "gate_up", "act")),
            (ctypes.c_void_p * 2)(views["residual0"].data_ptr(), views["residual1"].data_ptr()),
        )
        final, failed = ctypes.c_int(-1), (ctypes.c_int * 2)(-1, -1)
        status = self.kernels.decode_layers(
            ctypes.byref(self.model), self.layers, ctypes.byref(step), ctypes.byref(final), failed
        )
        if status != 0:
            self._raise(status, failed[0], failed[1], positions, slots, lens, tables)
        return views["proj"], views[f"residual{final.value}"]

    def _raise(self, status, layer, code, positions, slots, lens, tables):
        """The error the Python layers' wrapper of the failed kernel raises, naming the layer too."""
        kernel, m = c.KERNELS.get(code, f"kernel {code}"), self.model
        where = f"decode layers: layer {layer}'s {kernel}"
        if code in c.PROJECTIONS:
            w = getattr(self.layers[layer], c.PROJECTIONS[code])
            if status == -2:  # rows_quant.c: no memory for a thread's dequantized strips
                raise MemoryError(f"{where}: no memory for a thread's dequantized strips (K={w.k})")
            raise ValueError(f"{where}: the rows kernel refused N={w.n}, K={w.k}, segment={w.seg} (status {status})")
        if kernel == "rotary_neox":
            raise cpu_kernels.position_error(where, positions, m.table_rows)
        if kernel == "store_kv":
            raise cpu_kernels.slot_error(where, slots, m.num_blocks * m.block_size)
        if kernel == "paged_attention":
            raise cpu_kernels.attention_error(where, status, lens, tables, m.block_size, m.num_blocks)
        lanes = m.norm_lanes if kernel == "rms_norm" else m.silu_lanes
        raise ValueError(f"{where}: refused {lanes} lanes (status {status})")


def _shapes_fit(first, attn, k_cache, linears, rope, sizes: tuple[int, int]) -> bool:
    """Whether a layer has the first layer's heads, sizes and cache, its products the shapes the C side
    assumes ([q | k | v] from hidden, o back to it, [gate | up] and down through one intermediate size),
    and the RoPE tables half a head per row at least: what the Python wrappers check on each call."""
    d, heads, kv_heads = first.head_dim, first.num_heads, first.num_kv_heads
    if (attn.head_dim, attn.num_heads, attn.num_kv_heads) != (d, heads, kv_heads) or heads % kv_heads or d % 2:
        return False
    if k_cache.shape[1] != kv_heads or k_cache.shape[3] != d or rope.cos.shape[-1] < d // 2:
        return False
    qkv, o, gate_up, down = linears
    hidden, inter = sizes  # the first layer's
    return (qkv.n, qkv.k, o.n, o.k, gate_up.n, gate_up.k, down.n, down.k) == (
        (heads + 2 * kv_heads) * d,
        hidden,
        hidden,
        heads * d,
        2 * inter,
        hidden,
        hidden,
        inter,
    )


def build(model) -> FusedDecode | None:
    """The structures for ``model`` (a LlamaModel) where every layer runs the compiled kernels, else None."""
    if tp_size() != 1 or triton_switch.INTERPRET:  # under the interpreter CPU tensors take Triton kernels
        return None
    kernels = cpu_kernels.load()
    if kernels is None or kernels.rows_linear is None:
        return None
    norm_lanes, silu_lanes = cpu_kernels.rms_norm_lanes(), cpu_kernels.silu_lanes()
    if norm_lanes is None or silu_lanes is None:
        return None
    first = model.layers[0].self_attn
    rope, scale = first.rotary_emb, first.attn.scale
    if not (_float32_cpu(rope.cos) and _float32_cpu(rope.sin) and rope.cos.shape == rope.sin.shape):
        return None
    layers, sizes = [], None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        a = attn.attn
        if attn.qk_norm or attn.rotary_emb is not rope or a.scale != scale or not isinstance(mlp.act_fn, SiluAndMul):
            return None
        if type(a.backend) is not TorchBackend or vars(a.backend) or a.k_cache.dim() != 4:
            return None  # the CPU backend as it is (no attribute of its own set on the instance)
        if not (_float32_cpu(a.k_cache) and _float32_cpu(a.v_cache) and a.k_cache.shape == first.attn.k_cache.shape):
            return None
        if a.v_cache.shape != a.k_cache.shape or (a.k_scale, a.v_scale) != (1.0, 1.0):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not all(_float32_cpu(n.weight) for n in norms):
            return None
        found = [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        linears = [x for x in found if x is not None]
        if len(linears) != len(found):
            return None
        sizes = sizes or (linears[0].k, linears[3].k)  # hidden and intermediate, from the first layer
        if not _shapes_fit(first, attn, a.k_cache, linears, rope, sizes):
            return None  # the C side takes every layer's sizes from the first layer's
        layers.append(
            c.DecodeLayer(
                *linears,
                norms[0].weight.data_ptr(),
                norms[1].weight.data_ptr(),
                norms[0].eps,
                norms[1].eps,
                a.k_cache.data_ptr(),
                a.v_cache.data_ptr(),
            )
        )
    assert sizes is not None  # every model has a layer
    return FusedDecode(model, kernels, layers, sizes, (norm_lanes, silu_lanes))


def for_model(model, hidden: torch.Tensor, meta: AttentionMetadata) -> FusedDecode | None:
    """The fused layers for this step, or None where the Python layers run it. The structures are
    built once per set of caches (the runner attaches them after sizing and frees them at close) and
    per build of the kernels; whether something replaced a function of the Python layers is asked
    every step."""
    if not FusedDecode.applies(hidden, meta) or os.environ.get(SWITCH, "1") == "0":
        return None
    built = model.__dict__.get("_fused_decode")
    if built is None or not built.current(model):
        built = _Built(model, build(model))
        model.__dict__["_fused_decode"] = built
        logger.debug("CPU decode steps: %s", "one C call for the layers" if built.fused else "the Python layers")
    fused = built.fused
    if fused is None or python_path_replaced(fused.modules, fused.classes):
        return None
    return fused


class _Built:
    """build()'s answer for a model, and what it was asked about: the caches, held weakly so that
    closing the engine frees them (the runner replaces them at close and after sizing), and the
    loaded kernels. The structures also point at the packed weights, norms and RoPE tables: the
    engine makes those once, at load, and never replaces them while the model lives."""

    def __init__(self, model, fused: FusedDecode | None):
        self.fused = fused
        self.kernels = cpu_kernels.load()
        self.attns = [layer.self_attn.attn for layer in model.layers]
        self.caches = [(weakref.ref(a.k_cache), weakref.ref(a.v_cache)) for a in self.attns]

    def current(self, model) -> bool:
        return (
            cpu_kernels.load() is self.kernels
            and len(model.layers) == len(self.attns)
            and all(a.k_cache is k() and a.v_cache is v() for a, (k, v) in zip(self.attns, self.caches))
        )
