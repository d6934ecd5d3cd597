"""Model classes keyed by the ``architectures`` entry of config.json."""

from __future__ import annotations

from nanovllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from nanovllm.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {  # every model derives from it
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(hf_config) -> type[LlamaForCausalLM]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture(s) {archs or '(none given in config.json)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
