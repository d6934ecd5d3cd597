"""The suite's zoo -> float32 GGUF export (for engines that load GGUF only) read back by nanovllm's
own GGUF loader (an independent reader that undoes llama.cpp's q/k layout) gives every tensor
bit for bit, and the config; a skipped q/k permutation is caught."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from conformance import gguf_export
from conformance.zoo import ZOO, zoo_model
from nanovllm.layers import rotary_embedding
from nanovllm.loader import gguf_loader
from nanovllm.loader.gguf_loader import llama3_from_rope_freqs, read_config, read_tensors


def read_back(path: str):
    reader = gguf.GGUFReader(path)
    cfg = read_config(reader)
    return cfg, read_tensors(reader, cfg)


def _tensors_that_differ_after_export(name: str, dest) -> set[str]:
    """Export a zoo model (with whatever the test patched into the exporter) and read it back."""
    model = Path(zoo_model(name))
    gguf_export.export(model, dest)
    _, tensors = read_back(str(dest / "model.gguf"))
    want = load_file(str(model / "model.safetensors"))
    return {k for k in want if not np.array_equal(want[k], tensors[k])}


def _inv_freq(spec_or_cfg: dict) -> torch.Tensor:
    scaling = spec_or_cfg.get("rope_scaling")
    return rotary_embedding._inv_freq(spec_or_cfg["head_dim"], spec_or_cfg["rope_theta"], scaling)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_export_round_trips(name):
    """Every zoo model, so every feature the zoo has (Llama q/k biases, RoPE scaling linear and
    Llama 3, norms' epsilon, tied and untied heads) is written and read back: tensors bit for bit,
    the config's shape, and the rotary frequencies the engine computes from what was read."""
    model = zoo_model(name)
    cfg, tensors = read_back(gguf_export.f32_gguf(model))
    want = load_file(f"{model}/model.safetensors")
    assert set(tensors) == set(want)
    differ = [k for k in want if not np.array_equal(want[k], tensors[k])]
    assert not differ, differ
    spec = ZOO[name]
    assert (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["vocab_size"],
        cfg["tie_word_embeddings"],
        cfg["rope_theta"],
        cfg["rms_norm_eps"],
    ) == (
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.vocab_size,
        spec.tie_word_embeddings,
        float(np.float32(spec.rope_theta)),  # GGUF stores them as float32 (transformers reads the same)
        float(np.float32(spec.rms_norm_eps)),
    )
    source = dict(head_dim=spec.head_dim, rope_theta=spec.rope_theta, rope_scaling=spec.rope_scaling)
    assert ("rope_scaling" in cfg) == (spec.rope_scaling is not None)
    torch.testing.assert_close(_inv_freq(cfg), _inv_freq(source), rtol=1e-6, atol=0)


def test_llama3_parameters_are_recovered_or_refused():
    """The Llama 3 divisors of a real Llama 3.1 config (factor 8, low 1, high 4, context 8192,
    theta 500000, head_dim 128) give back parameters with the same frequencies; divisors no
    Llama 3 parameters produce are refused, never read as no scaling."""
    rp = {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rp["original_max_position_embeddings"] = 8192
    divisors = gguf_export.llama3_rope_factors(rp, 128).astype(np.float64)
    got = llama3_from_rope_freqs(divisors, 500000.0, 128)
    want = rotary_embedding._inv_freq(128, 500000.0, dict(rp, rope_type="llama3"))
    torch.testing.assert_close(rotary_embedding._inv_freq(128, 500000.0, got), want, rtol=1e-6, atol=0)
    assert llama3_from_rope_freqs(np.ones(64), 500000.0, 128) is None  # all ones: no scaling
    bent = divisors.copy()
    bent[np.argmax((bent > 1.01) & (bent < 7.9))] *= 1.05  # one in-between divisor off the curve
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_from_rope_freqs(bent, 500000.0, 128)


def test_export_without_the_qk_bias_permutation_is_caught(tmp_path, monkeypatch):
    """Negative control of the bias half: an export that permutes Llama's q/k weights but not their
    biases reads back the biases changed (the loader undoes a permutation that was not done)."""
    real = gguf_export.permute_qk
    monkeypatch.setattr(gguf_export, "permute_qk", lambda w, n_head: real(w, n_head) if w.ndim == 2 else w)
    differ = _tensors_that_differ_after_export("llama-rope3-bias", tmp_path)
    assert differ and all(k.endswith(("q_proj.bias", "k_proj.bias")) for k in differ), differ


def test_export_without_the_qk_permutation_is_caught(tmp_path, monkeypatch):
    """Negative control: a Llama export that keeps HF's q/k layout reads back different tensors."""
    monkeypatch.setattr(gguf_export, "permute_qk", lambda w, n_head: w)

    differ = _tensors_that_differ_after_export("llama-mha-hd64", tmp_path)
    assert differ and all(k.endswith(("q_proj.weight", "k_proj.weight")) for k in differ), differ


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"rope.scaling.type": "linear"}, "rope.scaling.factor is missing"),
        ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "'yarn' is not supported"),
    ],
)
def test_a_rope_scaling_the_reader_cannot_express_is_refused(fields, message):
    """Served without its scaling, a model is wrong at every long position with no error: a GGUF
    scaling the reader cannot turn into a config is refused, naming the key. Control: linear with
    its factor reads back."""
    g = lambda key, default=None: fields.get(key, default)  # noqa: E731
    with pytest.raises(ValueError, match=message):
        gguf_loader._rope_scaling(None, g, 10000.0, 64)
    linear = {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}
    assert gguf_loader._rope_scaling(None, lambda k, d=None: linear.get(k, d), 10000.0, 64) == {
        "rope_type": "linear",
        "factor": 4.0,
    }
