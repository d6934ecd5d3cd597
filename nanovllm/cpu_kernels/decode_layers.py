"""ctypes mirrors of ``decode_layers.c``'s structures, and its binding.

The C side runs a decode step's decoder layers, each kernel called as its Python wrapper calls it;
``nanovllm/models/cpu_decode.py`` decides where that applies and fills these structures."""

from __future__ import annotations

import ctypes


class DecodeLinear(ctypes.Structure):
    _fields_ = [
        ("strips", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int),
        ("k", ctypes.c_int),
        ("seg", ctypes.c_int),
        ("format", ctypes.c_int),  # 0: float32 strips; else rows_quant.c's block format (cpu_kernels.ROWS_FORMATS)
    ]


class DecodeLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", DecodeLinear),
        ("o", DecodeLinear),
        ("gate_up", DecodeLinear),
        ("down", DecodeLinear),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("input_eps", ctypes.c_float),
        ("post_eps", ctypes.c_float),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class DecodeModel(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("intermediate", ctypes.c_int),
        ("num_blocks", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("cos_table", ctypes.c_void_p),
        ("sin_table", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("table_rows", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("norm_lanes", ctypes.c_int),
        ("silu_lanes", ctypes.c_int),
    ]


class DecodeStep(ctypes.Structure):
    _fields_ = [
        ("rows", ctypes.c_int),
        ("table_width", ctypes.c_int),
        ("threads", ctypes.c_int),
        ("silu_pieces", ctypes.c_int),
        ("positions", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("embedded", ctypes.c_void_p),
        ("normed", ctypes.c_void_p),
        ("qkv", ctypes.c_void_p),
        ("attn", ctypes.c_void_p),
        ("proj", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("act", ctypes.c_void_p),
        ("residual", ctypes.c_void_p * 2),
    ]


# decode_layers.c's FAILED_* codes: which kernel stopped the step (the four products by their weight)
KERNELS = {
    1: "rms_norm",
    2: "q/k/v projection",
    3: "rotary_neox",
    4: "store_kv",
    5: "paged_attention",
    6: "o projection",
    7: "gate/up projection",
    8: "silu_and_mul",
    9: "down projection",
}
PROJECTIONS = {2: "qkv", 6: "o", 7: "gate_up", 9: "down"}  # the DecodeLayer field of each product


def bind(library: ctypes.CDLL):
    fn = library.decode_layers_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.POINTER(DecodeModel),
        ctypes.POINTER(DecodeLayer),
        ctypes.POINTER(DecodeStep),
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int),
    ]
    return fn
