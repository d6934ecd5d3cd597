"""Sliding-window attention (Qwen2's and Qwen3's ``use_sliding_window``) is refused, not ignored.

Every layer here attends to the whole context; transformers limits the sliding layers to the last
``sliding_window`` keys. A config with sliding layers served as full attention gives other tokens
once a sequence is longer than the window (a 30-token prompt with a window of 4 on the zoo's Qwen2
model: transformers' argmax 435, the engine's 644), with no error. Which layers slide is compared
with transformers' own config class (its ``layer_types`` and ``sliding_window``).
"""

from __future__ import annotations

import json
import shutil

import pytest

from nanovllm.loader.hf_config import hf_config_from_dict
from nanovllm.models.registry import get_model_class

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}
CASES = [
    {},  # the defaults: no sliding window
    {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 28},  # beyond the layers
    {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"] * 2},
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    {"use_sliding_window": True, "max_window_layers": 1},  # transformers' default window
]


def _transformers_sliding(model_type: str, fields: dict) -> list[int]:
    from transformers import Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    cfg = cls(**BASE, **fields)
    if cfg.sliding_window is None:
        return []
    return [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize("fields", CASES)
def test_sliding_layers_are_transformers_and_are_refused(model_type, fields):
    from nanovllm.models.llama import sliding_window_layers

    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    cfg = hf_config_from_dict({"model_type": model_type, "architectures": [arch], **BASE, **fields})
    want = _transformers_sliding(model_type, fields)
    assert sliding_window_layers(cfg) == want
    if want:
        with pytest.raises(ValueError, match="sliding-window attention"):
            get_model_class(cfg).check_config(cfg)
    else:
        get_model_class(cfg).check_config(cfg)


def test_the_engine_refuses_a_sliding_window_model(tmp_path):
    from conformance.zoo import zoo_model
    from nanovllm import LLM

    path = tmp_path / "qwen2-sliding"
    shutil.copytree(zoo_model("qwen2-gqa2-hd64"), path)
    cfg = json.loads((path / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg.update(
        use_sliding_window=True, sliding_window=4, max_window_layers=0, layer_types=["sliding_attention"] * layers
    )
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sliding-window attention"):
        LLM(str(path), device="cpu", block_size=16, seed=0)


def test_a_llama_config_with_the_qwen_field_is_not_refused():
    """transformers' Llama ignores ``use_sliding_window`` (its LlamaConfig has no such field and
    every layer attends to everything), so a Llama config carrying it is run, not refused; the
    same fields on Qwen2 are refused (the control)."""
    fields = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}
    llama = hf_config_from_dict({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **BASE, **fields})
    get_model_class(llama).check_config(llama)
    qwen2 = hf_config_from_dict({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **BASE, **fields})
    with pytest.raises(ValueError, match="sliding-window attention"):
        get_model_class(qwen2).check_config(qwen2)
