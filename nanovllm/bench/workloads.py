"""The benchmark workloads, reproduced exactly (random.seed(0); the draws in a fixed order)."""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    temperature: float
    expected_prompt_tokens: int | None = None  # the standard totals (None: a workload of no record)
    expected_output_tokens: int | None = None
    vocab_size: int | None = None  # the ids are below it (warm-up prompts stay below it too)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def check_totals(self) -> None:
        if self.expected_prompt_tokens is None:
            return
        got = (self.num_prompt_tokens, self.num_output_tokens)
        want = (self.expected_prompt_tokens, self.expected_output_tokens)
        if got != want:
            raise RuntimeError(
                f"workload {self.name!r} totals {got} differ from the standard {want}: "
                f"the generator is not reproduced exactly"
            )


def cpu_workload() -> Workload:
    """32 requests, prompts randint(16, 256) ids in [100, 40000], max_tokens randint(16, 128), greedy."""
    random.seed(0)
    prompts = [[random.randint(100, 40000) for _ in range(random.randint(16, 256))] for _ in range(32)]
    max_tokens = [random.randint(16, 128) for _ in range(32)]
    return Workload("cpu", prompts, max_tokens, 0.0, 4537, 2346)


def gpu_workload() -> Workload:
    """nano-vllm's bench.py: 256 requests, prompts randint(100, 1024) ids in [0, 10000],
    max_tokens randint(100, 1024), temperature 0.6, ignore_eos."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    return Workload("gpu", prompts, max_tokens, 0.6, 142827, 133966)


# Model shapes for random-weight benchmarks (speed does not depend on weight values).
SHAPES = {
    "qwen3-0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}


def shape_config_dir(shape: str) -> str:
    """A model directory holding only config.json for a Qwen3 shape (use with load_format='dummy')."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        **SHAPES[shape],
    }
    d = Path(tempfile.mkdtemp(prefix=f"nanovllm-{shape}-"))
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(d)
