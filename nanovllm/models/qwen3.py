"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE."""

from nanovllm.models.llama import Biases, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    reads_sliding_window = True

    @classmethod
    def biases(cls, config) -> Biases:
        attention = bool(getattr(config, "attention_bias", False))  # q, k, v and o; the MLP has none
        return Biases(qkv=attention, o=attention)
