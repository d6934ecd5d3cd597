"""Injected bugs in how nanovllm reads a model: configuration fields (norm eps, RoPE scaling, biases,
EOS ids, context length), the GGUF converter and its cache, and the head-to-rank arithmetic of tensor
parallelism. Each function returns a context manager that monkeypatches nanovllm in this process
and restores it on exit; ``MUTANTS`` maps each name to it and to the checks expected to catch it
(the runner, ``tests/mutants/runner.py``, builds its registry entries from there).

Each one sits where the suite did not look before (issue 10, class 6 and 8): test models that all
had one EOS id, no ``rope_scaling``, ``rms_norm_eps=1e-6`` and no bias but Qwen2's, a GGUF
conversion cached by file hash and never re-run, and tensor parallelism only at TP=2.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

from tests.mutants.core import _patched


def _module(name: str):
    return importlib.import_module(name)


# ----------------------------------------------------------- configuration
def rms_norm_eps_ignored() -> ContextManager:
    """Every RMSNorm is built with the default eps (1e-6), whatever the config's rms_norm_eps."""
    layernorm = _module("nanovllm.layers.layernorm")
    orig = layernorm.RMSNorm.__init__

    def __init__(self, hidden_size, eps=1e-6):
        orig(self, hidden_size)

    return _patched((layernorm.RMSNorm, "__init__", __init__))


def qk_norm_eps_ignored() -> ContextManager:
    """Qwen3's per-head q/k norms use the default eps; the layer norms still read the config."""
    llama = _module("nanovllm.models.llama")
    orig = llama.LlamaAttention.__init__

    def __init__(self, config, *args, **kwargs):
        orig(self, config, *args, **kwargs)
        if self.qk_norm:
            self.q_norm.eps = self.k_norm.eps = 1e-6

    return _patched((llama.LlamaAttention, "__init__", __init__))


def rope_linear_factor_ignored() -> ContextManager:
    """rope_scaling type "linear" is read but its factor is not applied."""
    rope = _module("nanovllm.layers.rotary_embedding")
    orig = rope._inv_freq

    def _inv_freq(head_dim, base, rope_scaling):
        if (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type")) == "linear":
            rope_scaling = None
        return orig(head_dim, base, rope_scaling)

    return _patched((rope, "_inv_freq", _inv_freq))


def rope_llama3_smoothing_swapped() -> ContextManager:
    """llama3 RoPE: the medium band's interpolation weights are swapped (smooth <-> 1 - smooth)."""
    import math

    import torch

    rope = _module("nanovllm.layers.rotary_embedding")
    orig = rope._inv_freq

    def _inv_freq(head_dim, base, rope_scaling):
        if (rope_scaling or {}).get("rope_type") != "llama3":
            return orig(head_dim, base, rope_scaling)
        inv_freq = orig(head_dim, base, None)
        factor = rope_scaling["factor"]
        low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
        old_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = smooth * scaled / factor + (1 - smooth) * scaled  # the bug
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)

    return _patched((rope, "_inv_freq", _inv_freq))


def rope_scaling_checked_late() -> ContextManager:
    """Unsupported RoPE scaling is found only when a worker builds the model, not at load (under
    tensor parallelism the ValueError becomes a worker's RuntimeError)."""
    llama = _module("nanovllm.models.llama")
    return _patched((llama.LlamaForCausalLM, "check_config", classmethod(lambda cls, config: None)))


def o_proj_bias_dropped() -> ContextManager:
    """attention_bias gives q/k/v a bias but not o_proj (transformers' Llama and Qwen3 bias all four):
    the checkpoint's o_proj.bias is ignored."""
    import dataclasses

    llama, qwen3 = _module("nanovllm.models.llama"), _module("nanovllm.models.qwen3")
    patches = []
    for cls in (llama.LlamaForCausalLM, qwen3.Qwen3ForCausalLM):
        orig = cls.__dict__["biases"].__func__

        def biases(klass, config, _orig=orig):
            return dataclasses.replace(_orig(klass, config), o=False)

        patches.append((cls, "biases", classmethod(biases)))
    return _patched(*patches)


def mlp_bias_ignored() -> ContextManager:
    """Llama's mlp_bias is not read: the MLP's gate/up/down biases are ignored."""
    import dataclasses

    llama = _module("nanovllm.models.llama")
    orig = llama.LlamaForCausalLM.__dict__["biases"].__func__

    def biases(klass, config):
        return dataclasses.replace(orig(klass, config), mlp=False)

    return _patched((llama.LlamaForCausalLM, "biases", classmethod(biases)))


def only_first_eos_id() -> ContextManager:
    """Only the first EOS id of generation_config.json stops a request (a list is cut to its head)."""
    engine = _module("nanovllm.engine.engine")
    orig = engine.eos_token_ids

    def eos_token_ids(model_dir, hf_config, tokenizer):
        return orig(model_dir, hf_config, tokenizer)[:1]

    return _patched((engine, "eos_token_ids", eos_token_ids))


def max_model_len_ignores_model_limit() -> ContextManager:
    """The default max_model_len is 8192 whatever the model's max_position_embeddings: a prompt
    longer than the model's context is accepted (and RoPE runs past it)."""
    config = _module("nanovllm.config")
    orig = config.EngineConfig.resolve

    def resolve(self, hf_config, model_dir):
        default = self.max_model_len is None
        orig(self, hf_config, model_dir)
        if default:
            self.max_model_len = 8192

    return _patched((config.EngineConfig, "resolve", resolve))


# ----------------------------------------------------------------- GGUF
def gguf_eps_key_wrong() -> ContextManager:
    """The converter reads rms_norm_eps under a key the GGUF does not have (...layer_norm_epsilon), so
    the converted config gets the 1e-6 default instead of the file's value."""
    gguf_loader = _module("nanovllm.loader.gguf_loader")
    orig = gguf_loader.read_config

    def read_config(reader):
        config = orig(reader)
        arch = gguf_loader._field(reader, "general.architecture")
        config["rms_norm_eps"] = float(gguf_loader._field(reader, f"{arch}.attention.layer_norm_epsilon", 1e-6))
        return config

    return _patched((gguf_loader, "read_config", read_config))


def gguf_qk_unpermute_skipped() -> ContextManager:
    """The converter keeps llama.cpp's interleaved q/k row order (no unpermute)."""
    gguf_loader = _module("nanovllm.loader.gguf_loader")
    return _patched((gguf_loader, "_unpermute_qk", lambda w, n_head: w))


def gguf_cache_key_file_only() -> ContextManager:
    """The conversion cache is keyed by the GGUF file alone: a converter change reuses the old result."""
    gguf_loader = _module("nanovllm.loader.gguf_loader")
    return _patched((gguf_loader, "converter_version", lambda: "0"))


# ------------------------------------------------------- tensor parallel
def tp_replicated_kv_head_wrong_rank() -> ContextManager:
    """With fewer KV heads than ranks, rank r loads KV head r % num_kv_heads instead of
    r // (tp / num_kv_heads): right whenever one KV head is replicated or the heads split, wrong when
    2 KV heads are replicated over 4 ranks (a rank's query heads then read another group's K/V)."""
    linear = _module("nanovllm.layers.linear")
    orig = linear.QKVParallelLinear.weight_loader

    def weight_loader(self, param, loaded, name="", shard_id="q"):
        tp, rank = linear.tp_size(), linear.tp_rank()
        if shard_id == "q" or self.total_num_kv_heads >= tp:
            return orig(self, param, loaded, name, shard_id)
        hd = self.head_dim
        offset = self.num_heads * hd + (0 if shard_id == "k" else self.num_kv_heads * hd)
        size = self.num_kv_heads * hd
        start = (rank % self.total_num_kv_heads) * size  # the bug
        linear._copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, start, size), name)

    return _patched((linear.QKVParallelLinear, "weight_loader", weight_loader))


REF = "conformance/test_reference.py"
MODEL_CFG = "conformance/test_model_config.py"
GGUF = "tests/test_gguf_converter.py"

# name -> (mutant, the checks that should catch it)
MUTANTS: dict[str, tuple[Callable[[], ContextManager], list[str]]] = {
    "rms_norm_eps_ignored": (
        rms_norm_eps_ignored,
        [
            f"{REF}::test_greedy_matches_reference[qwen3-eps-rope-linear]",
            f"{REF}::test_prompt_logprobs_match_reference[qwen3-eps-rope-linear]",
        ],
    ),
    "qk_norm_eps_ignored": (
        qk_norm_eps_ignored,
        [
            f"{REF}::test_greedy_matches_reference[qwen3-eps-rope-linear]",
            f"{REF}::test_prompt_logprobs_match_reference[qwen3-eps-rope-linear]",
        ],
    ),
    "rope_linear_factor_ignored": (
        rope_linear_factor_ignored,
        [f"{REF}::test_greedy_matches_reference[qwen3-eps-rope-linear]"],
    ),
    "rope_llama3_smoothing_swapped": (
        rope_llama3_smoothing_swapped,
        [
            f"{REF}::test_greedy_matches_reference[llama-rope3-bias]",
            f"{REF}::test_prompt_logprobs_match_reference[llama-rope3-bias]",
        ],
    ),
    "rope_scaling_checked_late": (
        rope_scaling_checked_late,
        ["tests/test_loader_and_layers.py::test_unsupported_rope_scaling_refused_at_load"],
    ),
    "o_proj_bias_dropped": (o_proj_bias_dropped, [f"{REF}::test_greedy_matches_reference[llama-rope3-bias]"]),
    "mlp_bias_ignored": (mlp_bias_ignored, [f"{REF}::test_greedy_matches_reference[llama-rope3-bias]"]),
    "only_first_eos_id": (only_first_eos_id, [f"{MODEL_CFG}::test_every_eos_id_stops"]),
    "max_model_len_ignores_model_limit": (
        max_model_len_ignores_model_limit,
        [f"{MODEL_CFG}::test_prompt_longer_than_the_model_context"],
    ),
    "gguf_eps_key_wrong": (gguf_eps_key_wrong, [GGUF]),
    "gguf_qk_unpermute_skipped": (gguf_qk_unpermute_skipped, [GGUF]),
    "gguf_cache_key_file_only": (gguf_cache_key_file_only, [GGUF]),
    "tp_replicated_kv_head_wrong_rank": (
        tp_replicated_kv_head_wrong_rank,
        ["conformance/test_tensor_parallel.py::test_tp4_replicated_kv_heads_gloo_cpu"],
    ),
}
