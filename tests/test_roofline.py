"""The workload's physical limit: computed with the rates of the GPU the run is on, never
another's, and not claimed for a GPU whose rates were not measured."""

from __future__ import annotations

import dataclasses

import pytest

from nanovllm.bench import run
from nanovllm.bench.roofline import KNOWN_DEVICES, DeviceLimits, device_limits, roofline
from nanovllm.bench.workloads import SHAPES, gpu_workload

SHAPE = SHAPES["qwen3-0.6b"]


@pytest.mark.parametrize("device", KNOWN_DEVICES, ids=lambda d: d.name)
def test_each_measured_gpu_is_found_by_its_torch_name(device):
    assert device_limits(device.name) is device
    assert device.bf16_flops > 0 and device.hbm_bytes_per_s > 0 and device.measured


@pytest.mark.parametrize(
    "name", ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "cpu"]
)
def test_other_gpus_and_variants_of_a_measured_one_are_not_taken_for_it(name):
    """An H100 PCIe streams HBM2e at ~2 TB/s: the SXM part's limit would overstate it."""
    assert device_limits(name) is None


def test_the_h100_and_h200_limits_differ_where_their_memories_do():
    h100, h200 = (device_limits(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"))
    assert h100 is not None and h200 is not None
    assert h100.hbm_bytes_per_s < 0.8 * h200.hbm_bytes_per_s


def test_the_limit_is_the_prefill_at_the_matmul_rate_plus_the_decode_bytes_at_the_memory_rate():
    w, base = gpu_workload(), KNOWN_DEVICES[0]
    r = roofline(w, SHAPE, base)
    assert r.seconds == pytest.approx(
        r.prefill_flops / base.bf16_flops + (r.decode_weight_bytes + r.decode_kv_bytes) / base.hbm_bytes_per_s
    )
    slower_memory = roofline(w, SHAPE, dataclasses.replace(base, hbm_bytes_per_s=base.hbm_bytes_per_s / 2))
    slower_matmul = roofline(w, SHAPE, dataclasses.replace(base, bf16_flops=base.bf16_flops / 2))
    assert slower_memory.seconds - r.seconds == pytest.approx(r.seconds - r.prefill_flops / base.bf16_flops)
    assert slower_matmul.seconds - r.seconds == pytest.approx(r.prefill_flops / base.bf16_flops)
    assert r.output_tokens_per_s == pytest.approx(w.num_output_tokens / r.seconds)
    fp8 = roofline(w, SHAPE, base, kv_bytes_per_elem=1)
    assert fp8.decode_kv_bytes == pytest.approx(r.decode_kv_bytes / 2)
    assert fp8.decode_weight_bytes == r.decode_weight_bytes
    assert base.name.removeprefix("NVIDIA ") in r.describe()


def _target() -> run.Target:
    w = gpu_workload()
    return run.Target(w, "unused", "qwen3-0.6b shape", "dummy", {}, "cuda", None, SHAPE)  # type: ignore[arg-type]


def test_the_bench_takes_the_limit_of_the_gpu_it_runs_on(monkeypatch):
    other = DeviceLimits("X900", KNOWN_DEVICES[0].bf16_flops, KNOWN_DEVICES[0].hbm_bytes_per_s / 3, "test")
    monkeypatch.setattr(run, "device_limits", lambda name: {"NVIDIA X900": other}.get(name) or device_limits(name))
    monkeypatch.setattr(run, "target_device_name", lambda target: "NVIDIA X900")
    on_other = run.target_roofline(_target(), {})
    monkeypatch.setattr(run, "target_device_name", lambda target: KNOWN_DEVICES[0].name)
    on_known = run.target_roofline(_target(), {})
    assert on_other is not None and on_known is not None
    assert on_other.device is other and on_known.device is KNOWN_DEVICES[0]
    assert on_other.output_tokens_per_s < on_known.output_tokens_per_s / 2  # a third of the bandwidth


def test_a_gpu_not_measured_gets_no_fraction_and_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(run, "target_device_name", lambda target: "NVIDIA A100-SXM4-80GB")
    target = _target()
    limit = run.target_roofline(target, {})
    assert limit is None
    monkeypatch.setattr(run, "write_json", lambda *a: None)
    ours = [run.peers.Measurement("nanovllm", 1000, 1.0, "")]
    run.report(target, ours, [], limit, None)
    out = capsys.readouterr().out
    assert "roofline: not known for 'NVIDIA A100-SXM4-80GB'" in out
    assert "of the physical limit" not in out
