"""loader/hf_config.py reads config.json as transformers' AutoConfig does, field by field, for every
zoo model, the default model's converted directory and hand-written configs that leave fields to
the family defaults; a changed default is caught (negative control)."""

from __future__ import annotations

import json

import pytest

from conformance.zoo import ZOO, zoo_model
from nanovllm.loader import hf_config
from nanovllm.loader.hf_config import read_generation_eos, read_hf_config

# every HF config field nanovllm reads (models, layers, engine, config.resolve)
FIELDS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_scaling",
    "attention_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
)
MISSING = "<missing>"

HAND_WRITTEN = {
    "llama-minimal": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
    },
    "llama-4x-rope-llama3": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "max_position_embeddings": 16384,
        "torch_dtype": "bfloat16",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [1, 2],
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
    },
    "llama-old-type-key": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "dtype": "float16",
    },
    "llama-5x-rope-parameters": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
    },
    "qwen2-minimal": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_attention_heads": 4,
    },
    "qwen2-gqa": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "qwen3-minimal": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "rope_theta": 1000000.0,
        "attention_bias": True,
    },
}


def _value(config, name):
    value = getattr(config, name, MISSING)
    if name in ("dtype", "torch_dtype") and value is not None and value is not MISSING:
        value = str(value).removeprefix("torch.")  # AutoConfig: a torch.dtype; ours: its name
    return value


def differences(model_dir) -> dict:
    """{field: (ours, AutoConfig's)} for every field where read_hf_config and AutoConfig differ."""
    from transformers import AutoConfig

    ours, theirs = read_hf_config(model_dir), AutoConfig.from_pretrained(str(model_dir))
    return {f: (_value(ours, f), _value(theirs, f)) for f in FIELDS if _value(ours, f) != _value(theirs, f)}


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_configs_match_autoconfig(name):
    assert differences(zoo_model(name)) == {}


def test_default_model_config_matches_autoconfig(smollm_path):
    from nanovllm.loader.model_loader import resolve_model_dir

    model_dir = resolve_model_dir(smollm_path)
    assert differences(model_dir) == {}
    assert read_hf_config(model_dir).tie_word_embeddings is True  # not vacuous: a non-default value


@pytest.mark.parametrize("name", list(HAND_WRITTEN))
def test_family_defaults_match_autoconfig(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(HAND_WRITTEN[name]))
    assert differences(tmp_path) == {}


def test_a_wrong_default_is_caught(tmp_path, monkeypatch):
    """Negative control: a Llama default changed in our table shows as a difference."""
    (tmp_path / "config.json").write_text(json.dumps(HAND_WRITTEN["llama-minimal"]))
    monkeypatch.setitem(hf_config.DEFAULTS["llama"], "rms_norm_eps", 1e-5)
    assert differences(tmp_path) == {"rms_norm_eps": (1e-5, 1e-6)}


def test_generation_eos_list(tmp_path):
    assert read_generation_eos(zoo_model("qwen3-eps-rope-linear")) == [1, 294, 403]
    assert read_generation_eos(tmp_path) is None  # no generation_config.json


@pytest.mark.parametrize(
    "text, error, message",
    [
        ("{not json", ValueError, r"config.json.*not valid JSON"),
        ("[1, 2]", ValueError, r"config.json: expected a JSON object, got list"),
        (
            '{"model_type": "gpt2"}',
            ValueError,
            r"model_type 'gpt2' is not supported \(supported: llama, qwen2, qwen3\)",
        ),
    ],
)
def test_bad_config_json_names_file_and_value(tmp_path, text, error, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(error, match=message):
        read_hf_config(tmp_path)
