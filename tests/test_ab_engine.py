"""scripts/ab_engine.py's switches (the GPU A/B runner): each one applies on a CPU-only machine, and
the tile overrides take every argument ``paged_decode`` passes to ``decode_config`` (a 3-argument
override crashed every ``tile=`` run after ``decode_config`` grew its ``tma`` argument)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import pathlib
import sys

import pytest
import torch

triton_ops = pytest.importorskip(
    "nanovllm.attention.triton_ops", reason="the switches patch the Triton kernels' module"
)

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "ab_engine.py"


@pytest.fixture
def ab_engine(monkeypatch):
    spec = importlib.util.spec_from_file_location("ab_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(triton_ops, "decode_config", triton_ops.decode_config)  # restored after the test
    monkeypatch.setattr(triton_ops, "DECODE_TMA", triton_ops.DECODE_TMA)
    monkeypatch.setattr(triton_ops, "DECODE_FLAG_OVERRIDES", {})
    for name in ("NANOVLLM_DECODE_TMA", "NANOVLLM_PDL", "NANOVLLM_DECODE_GEMM"):
        monkeypatch.setenv(name, "")  # recorded, so what the switches write into os.environ is undone
        monkeypatch.delenv(name)
    return module


def _call_like_paged_decode(dtype, fp8, tma):
    """The call in ``paged_decode`` (four positional arguments) of whatever ``decode_config`` is now."""
    line = next(x for x in inspect.getsource(triton_ops.paged_decode).splitlines() if "decode_config(" in x)
    assert line.count(",") == 3, line  # (head_dim, dtype, kv_fp8, tma): update this helper with it
    return triton_ops.decode_config(128, dtype, fp8, tma)


@pytest.mark.parametrize("tma", [False, True])
def test_tile_overrides_take_paged_decodes_arguments(ab_engine, tma):
    apply, valid = ab_engine.SETTINGS["tile"]
    assert valid("64x4x2")
    apply("64x4x2")
    call = _call_like_paged_decode
    assert call(torch.bfloat16, False, tma) == triton_ops.KernelConfig(16, 64, 4, 2)
    assert call(torch.bfloat16, True, tma).block_n == (128 if tma else 64)  # FP8 keeps its own
    assert call(torch.float32, False, tma).block_n == 32  # float32 models keep theirs
    ab_engine.SETTINGS["fp8tile"][0]("64x4x3")
    assert call(torch.bfloat16, True, tma) == triton_ops.KernelConfig(16, 64, 4, 3)
    assert call(torch.bfloat16, False, tma) == triton_ops.KernelConfig(16, 64, 4, 2)


def test_a_tile_override_may_cap_the_registers(ab_engine):
    apply, valid = ab_engine.SETTINGS["fp8tile"]
    assert valid("128x4x5x128") and not valid("128x4") and not valid("128x4x5x128x1") and not valid("128x4x5x0")
    apply("128x4x5x128")
    assert _call_like_paged_decode(torch.bfloat16, True, True) == triton_ops.KernelConfig(16, 128, 4, 5, 128)
    assert _call_like_paged_decode(torch.bfloat16, False, True).maxnreg is None  # 16-bit caches keep theirs


@pytest.mark.parametrize("value,expected", [("0", "0"), ("1", "1"), ("fp8", "fp8")])
def test_the_tma_switch(ab_engine, value, expected):
    apply, valid = ab_engine.SETTINGS["tma"]
    assert valid(value) and not valid("yes")
    apply(value)
    assert triton_ops.DECODE_TMA == expected


def test_the_tile_block_switch(ab_engine):
    ab_engine.SETTINGS["tb"][0]("0")
    assert triton_ops.DECODE_FLAG_OVERRIDES == {"TILE_BLOCK": False}


def test_the_decode_gemm_options(ab_engine, monkeypatch):
    """``gemm=``, ``gemmrows=`` and ``gemmcfg=`` reach ``layers/decode_gemm.py``; malformed values are
    refused before anything runs."""
    decode_gemm = pytest.importorskip("nanovllm.layers.decode_gemm")
    monkeypatch.setattr(decode_gemm, "default_config", decode_gemm.default_config)
    monkeypatch.setattr(decode_gemm, "MAX_ROWS", decode_gemm.MAX_ROWS)
    apply, valid = ab_engine.SETTINGS["gemm"]
    assert valid("1") and not valid("on")
    apply("1")
    assert os.environ["NANOVLLM_DECODE_GEMM"] == "1"
    ab_engine.SETTINGS["gemmrows"][0]("128")
    assert decode_gemm.MAX_ROWS == 128
    apply, valid = ab_engine.SETTINGS["gemmcfg"]
    assert valid("64/16x128x8x4") and not valid("64x128x8x4") and not valid("64/16x128x8") and not valid("x")
    assert not valid("64/0x128x8x4") and not valid("64/8x128x8x4") and not valid("48/16x128x8x4")  # tl.dot tiles
    apply("64/16x128x8x4")
    assert decode_gemm.default_config(6144, 1024) == decode_gemm.GemmConfig(64, 128, 8, 4)
    assert decode_gemm.default_config(1024, 3072) == decode_gemm.GemmConfig(16, 128, 8, 4)


def test_decode_gemm_config_specs_parse_or_say_what_is_wrong():
    decode_gemm = pytest.importorskip("nanovllm.layers.decode_gemm")
    cfg = decode_gemm.parse_config("32/16x256x4x3")
    assert cfg(6144, 1024) == decode_gemm.GemmConfig(32, 256, 4, 3) == decode_gemm.default_config(6144, 1024)
    assert cfg(1024, 3072) == decode_gemm.GemmConfig(16, 256, 4, 3) == decode_gemm.default_config(1024, 3072)
    with pytest.raises(ValueError, match="'32x256' is not BIG/SMALLxBKxWxS"):
        decode_gemm.parse_config("32x256")
    with pytest.raises(ValueError, match="'32/12x256x4x3': strips and the K step must be powers of two >= 16"):
        decode_gemm.parse_config("32/12x256x4x3")


def test_a_k_step_the_weights_do_not_divide_falls_back_to_cublas(ab_engine, monkeypatch):
    """``gemmcfg`` with a 256-wide K step: a 384-column layer is left to cuBLAS (``applies`` reads the
    config), not an error in the middle of a run."""
    decode_gemm = pytest.importorskip("nanovllm.layers.decode_gemm")
    monkeypatch.setattr(decode_gemm, "default_config", decode_gemm.default_config)
    x = torch.zeros(2, 384, dtype=torch.bfloat16)
    assert decode_gemm.applies(x, torch.zeros(64, 384, dtype=torch.bfloat16), None)  # shipped: 128-wide steps
    ab_engine.SETTINGS["gemmcfg"][0]("32/16x256x4x3")
    assert not decode_gemm.applies(x, torch.zeros(64, 384, dtype=torch.bfloat16), None)
    assert decode_gemm.applies(
        torch.zeros(2, 512, dtype=torch.bfloat16), torch.zeros(64, 512, dtype=torch.bfloat16), None
    )


def test_the_sampler_option_loads_another_module_in_place_of_the_shipped_one(ab_engine, tmp_path, monkeypatch):
    """``sampler=PATH`` (session 15's A/B against the sampler of an older commit): the engine's lazy
    import of ``nanovllm.layers.fused_sampler`` then gets PATH's module; a missing file is refused."""
    name = "nanovllm.layers.fused_sampler"
    stand_in = tmp_path / "fused_sampler_other.py"
    stand_in.write_text("WHICH = 'the other sampler'\n")
    apply, valid = ab_engine.SETTINGS["sampler"]
    assert valid(str(stand_in)) and not valid(str(tmp_path / "missing.py"))
    monkeypatch.setitem(sys.modules, name, None)  # the shipped module (or none) is restored after the test
    apply(str(stand_in))
    assert importlib.import_module(name).WHICH == "the other sampler"


def test_the_split_wave_switches_set_one_cache_type_each(ab_engine, monkeypatch):
    monkeypatch.setattr(triton_ops, "DECODE_SPLIT_WAVES", triton_ops.DECODE_SPLIT_WAVES)
    monkeypatch.setattr(triton_ops, "FP8_DECODE_SPLIT_WAVES", triton_ops.FP8_DECODE_SPLIT_WAVES)
    ab_engine.SETTINGS["fp8waves"][0]("16")
    ab_engine.SETTINGS["waves"][0]("1")
    assert triton_ops.num_decode_splits(23, 8, 132, kv_fp8=True) == 16  # 2112 / 184 -> 11.5 -> 16
    assert triton_ops.num_decode_splits(23, 8, 132) == 1  # 132 / 184 -> 1
    assert not ab_engine.SETTINGS["fp8waves"][1]("0")


def test_the_row_warm_up_switch(ab_engine, monkeypatch):
    from nanovllm.worker import sampling_warmup

    monkeypatch.setenv("NANOVLLM_ROW_WARMUP", "")  # recorded, so what the switch writes is undone
    monkeypatch.delenv("NANOVLLM_ROW_WARMUP")
    assert sampling_warmup.enabled()  # the default
    ab_engine.SETTINGS["rowwarm"][0]("0")
    assert not sampling_warmup.enabled()
    ab_engine.SETTINGS["rowwarm"][0]("1")
    assert sampling_warmup.enabled()
    assert not ab_engine.SETTINGS["rowwarm"][1]("2")


def test_the_streamk_switch(ab_engine, monkeypatch):
    from nanovllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "DECODE_STREAMK", "0")  # recorded: the option's write is undone
    apply, valid = ab_engine.SETTINGS["streamk"]
    assert valid("fp8") and valid("1") and valid("0") and not valid("2") and not valid("yes")
    apply("fp8")
    assert triton_backend.DECODE_STREAMK == "fp8"
    assert triton_backend.TritonBackend._streamk_on(True) and not triton_backend.TritonBackend._streamk_on(False)


def test_the_streamk_batch_range(ab_engine, monkeypatch):
    from nanovllm.attention import triton_backend

    monkeypatch.setattr(triton_backend, "STREAMK_BATCHES", (16, 128))
    apply, valid = ab_engine.SETTINGS["skbatches"]
    assert valid("1:256") and valid("8:8")
    assert not valid("0:8") and not valid("9:8") and not valid("8") and not valid("a:b")
    apply("32:96")
    assert triton_backend.STREAMK_BATCHES == (32, 96)
