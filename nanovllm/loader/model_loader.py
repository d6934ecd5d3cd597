"""Find a model, read its config, build it and load its weights (safetensors).

Loading is data-driven: a model declares ``packed_modules_mapping`` (checkpoint
q/k/v and gate/up tensors fill parts of one merged parameter) and every
parameter carries a ``weight_loader`` that knows how to take its shard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def resolve_model_dir(model: str | None) -> str:
    """An HF directory for ``model``: a directory as is, a .gguf converted (cached), None = default."""
    from nanovllm.loader.default_model import default_model_path
    from nanovllm.loader.gguf_loader import gguf_to_hf_dir

    if model is None:
        model = default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_hf_dir(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return gguf_to_hf_dir(ggufs[0])
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
        return str(path)
    if path.exists():
        raise ValueError(f"model {str(path)!r} is neither a model directory nor a .gguf file")
    raise FileNotFoundError(
        f"model path {str(path)!r} does not exist (no model hub access: pass a "
        f"local HF directory or .gguf file; for the default model pass model=None, or no --model)"
    )


def load_hf_config(model_dir: str):
    """The model's config.json as an HFConfig (loader/hf_config.py: AutoConfig's values, without
    importing transformers)."""
    from nanovllm.loader.hf_config import read_hf_config

    return read_hf_config(model_dir)


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {model_dir!r}")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"weight file {str(file)!r} is unreadable or truncated: {e}") from None


def set_weight(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Fill ``param`` with ``loaded`` (same shape, checked by the caller). Where the checkpoint
    tensor already has the parameter's dtype and device and is contiguous, the parameter takes
    it as its data instead of a copy: on a CPU the safetensors file's copy-on-write mapping
    (the page cache; a write to the parameter changes a private copy, never the file), which
    saves allocating and copying the weights (on SmolLM2-135M 0.26 of 0.54 GB, BENCHMARKS.md
    start-up). Otherwise (another dtype or device, a strided shard) the values are copied."""
    if (
        loaded.dtype == param.dtype
        and loaded.device == param.device
        and loaded.is_contiguous()
        and isinstance(param, nn.Parameter)
    ):
        param.data = loaded
    else:
        param.data.copy_(loaded)


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(_SKIPPED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        for ckpt_part, (param_part, shard_id) in mapping.items():
            if ckpt_part in name:
                param_name = name.replace(ckpt_part, param_part)
                if param_name in params:
                    param = params[param_name]
                    param.weight_loader(param, tensor, name, shard_id)  # type: ignore[attr-defined]
                    loaded.add(f"{param_name}:{shard_id}")
                    break
        else:
            param = params.get(name)  # type: ignore[assignment]
            if param is None:
                unexpected.append(name)
                continue
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, name)
            else:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"weight {name}: checkpoint shape {tuple(tensor.shape)} does not "
                        f"match the model's {tuple(param.shape)}"
                    )
                set_weight(param, tensor)
            loaded.add(name)
    if unexpected:
        logger.warning(
            "ignored %d checkpoint tensor(s) the model does not use: %s", len(unexpected), ", ".join(unexpected[:8])
        )
    missing = []
    for pname in params:
        if tied and pname == "lm_head.weight":
            continue
        parts = [(ck, sid) for ck, (pp, sid) in mapping.items() if f".{pp}." in pname]
        if parts:  # a merged parameter: each of its checkpoint tensors must have come
            missing += [pname.replace(mapping[ck][0], ck) for ck, sid in parts if f"{pname}:{sid}" not in loaded]
        elif pname not in loaded:
            missing.append(pname)
    if missing:
        raise ValueError(
            f"checkpoint is missing weight(s): {', '.join(missing[:10])}"
            + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        )


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks (speed does not depend on the values)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.data.uniform_(-0.02, 0.02, generator=gen)
