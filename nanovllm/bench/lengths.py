"""Whether a benchmark's requests fit the engine's ``max_model_len``, asked before the model loads.

A prompt longer than ``max_model_len`` is refused by the engine, but only at ``generate``, after
the weights are loaded (seconds on a CPU, more with a GGUF conversion); a prompt that fits with
fewer positions left than its output length ends early (``finish_reason="length"``), so a
benchmark of fixed output lengths would time fewer tokens than it says. Both are checked here
from the config alone, by EngineConfig's own resolution (the same default ``max_model_len``).
"""

from __future__ import annotations


def max_model_len(model_dir: str, engine_args: dict) -> int:
    """The ``max_model_len`` an engine built from ``engine_args`` on ``model_dir`` will have."""
    from nanovllm.config import EngineConfig
    from nanovllm.loader.model_loader import load_hf_config

    config = EngineConfig.from_kwargs(model_dir, **engine_args)
    config.resolve(load_hf_config(model_dir), model_dir)
    assert config.max_model_len is not None
    return config.max_model_len


def check_fits(limit: int, prompt_len: int, output_len: int, flags: str, whole: bool = True) -> None:
    """Raise ValueError naming ``flags`` when a ``prompt_len``-token prompt cannot be prefilled
    under ``limit`` positions or (``whole``) cannot also generate ``output_len`` tokens there."""
    need = prompt_len + output_len if whole else prompt_len + 1
    if need > limit:
        what = f"{prompt_len} prompt tokens + {output_len} output tokens" if whole else f"a {prompt_len}-token prompt"
        raise ValueError(
            f"{flags}: {what} need {need} positions, more than max_model_len={limit}; "
            f"shorten the request or raise --max-model-len (up to the model's max_position_embeddings)"
        )
