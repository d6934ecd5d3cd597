"""The suite's zoo -> float32 GGUF export (for engines that load GGUF only) read back by nanovllm's
own GGUF loader (an independent reader that undoes llama.cpp's q/k layout) gives every tensor
bit for bit, and the config; a skipped q/k permutation is caught."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from conformance import gguf_export
from conformance.zoo import ZOO, zoo_model
from nanovllm.loader.gguf_loader import read_config, read_tensors


def read_back(path: str):
    reader = gguf.GGUFReader(path)
    cfg = read_config(reader)
    return cfg, read_tensors(reader, cfg)


@pytest.mark.parametrize("name", ["llama-mha-hd64", "qwen2-gqa2-hd64", "qwen3-gqa2-hd64-tied"])
def test_export_round_trips(name):
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
    ) == (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size, spec.tie_word_embeddings)


def test_export_without_the_qk_permutation_is_caught(tmp_path, monkeypatch):
    """Negative control: a Llama export that keeps HF's q/k layout reads back different tensors."""
    monkeypatch.setattr(gguf_export, "permute_qk", lambda w, n_head: w)
    from pathlib import Path

    model = Path(zoo_model("llama-mha-hd64"))
    gguf_export.export(model, tmp_path)
    _, tensors = read_back(str(tmp_path / "model.gguf"))
    want = load_file(str(model / "model.safetensors"))
    differ = {k for k in want if not np.array_equal(want[k], tensors[k])}
    assert differ and all(k.endswith(("q_proj.weight", "k_proj.weight")) for k in differ), differ
