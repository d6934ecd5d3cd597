"""config.json -> an HFConfig, without transformers (its import costs about a second of start-up).

The engine reads a few fields of an HF model config: the shapes, ``rms_norm_eps``, the RoPE
parameters, the biases, ``tie_word_embeddings``, the token ids and the dtype. ``read_hf_config``
gives them the values transformers' ``AutoConfig`` gives for the three supported families
(Llama, Qwen2, Qwen3): config.json's value where it has one, else the family's default; RoPE as
transformers 5 normalizes it (``rope_parameters`` = ``rope_scaling`` = the scaling dict with
``rope_type`` and ``rope_theta``; no ``rope_theta`` attribute). Every other config.json key is an
attribute as written. ``dtype`` (and its old name ``torch_dtype``) is the dtype's name, e.g.
"bfloat16", not a torch.dtype. tests/test_hf_config.py checks each field against AutoConfig.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

# transformers' defaults (LlamaConfig(), Qwen2Config(), Qwen3Config()) for the fields we read
_COMMON = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "pad_token_id": None,
    "rope_theta": 10000.0,
}
DEFAULTS: dict[str, dict] = {
    "llama": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
    },
    "qwen3": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "head_dim": 128,
        "bos_token_id": None,
        "eos_token_id": None,
    },
}
# Llama derives num_key_value_heads (= num_attention_heads) and head_dim (hidden_size //
# num_attention_heads) when config.json has none; Qwen2 and Qwen3 have fixed defaults
_DERIVED = ("llama",)


class HFConfig(SimpleNamespace):
    """An HF model config's fields as attributes (see the module docstring)."""

    @property
    def rope_scaling(self) -> dict:
        return self.rope_parameters

    @property
    def torch_dtype(self) -> str | None:
        return self.dtype

    def to_dict(self) -> dict:
        return dict(vars(self))


def _rope_parameters(raw: dict, default_theta: float) -> dict:
    """transformers 5's normalized RoPE dict from a 4.x (rope_theta, rope_scaling) or 5.x
    (rope_parameters) config.json."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:  # the old key name (kept, as transformers does)
        params["rope_type"] = params["type"]
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", raw.get("rope_theta", default_theta))
    return params


def hf_config_from_dict(raw: dict, source: str = "config.json") -> HFConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in DEFAULTS:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(sorted(DEFAULTS))})"
        )
    defaults = DEFAULTS[model_type]
    fields = {k: v for k, v in defaults.items() if k != "rope_theta"}
    fields.update({k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")})
    fields["rope_parameters"] = _rope_parameters(raw, defaults["rope_theta"])
    if model_type in _DERIVED:
        if fields.get("num_key_value_heads") is None:
            fields["num_key_value_heads"] = fields["num_attention_heads"]
        if fields.get("head_dim") is None:
            fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    fields["dtype"] = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    return HFConfig(**fields)


def read_hf_config(model_dir: str | os.PathLike) -> HFConfig:
    """The HFConfig of ``model_dir/config.json``; ValueError naming the file for a bad one."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise FileNotFoundError(f"cannot read {str(path)!r}: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {str(path)!r}: not valid JSON ({e})") from None
    return hf_config_from_dict(raw, str(path))


def read_generation_eos(model_dir: str | os.PathLike):
    """``eos_token_id`` of generation_config.json (an int, a list, or None when absent or unreadable)."""
    try:
        raw = json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return raw.get("eos_token_id") if isinstance(raw, dict) else None
