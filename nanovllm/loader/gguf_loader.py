"""GGUF files -> an HF model directory, converted once and cached.

Tensors are read and dequantized with the ``gguf`` package; the tokenizer is
rebuilt from the GGUF metadata by transformers. The result (config.json,
generation_config.json, model.safetensors in float32, tokenizer files) is
written to ``$NANOVLLM_CACHE/gguf/<name>-<file sha256>-<converter version>/`` so a
second load only reads safetensors. The converter version hashes this module's
source and the gguf and transformers versions: a change to the converter
converts again instead of reusing what an older converter wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from nanovllm.loader.cache import build_once, cache_root, remembered_sha256

logger = logging.getLogger(__name__)

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = {"rope_freqs.weight"}  # derived from the config


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its HF name; ValueError for one we do not know."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF counterpart")


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves the two rotary halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES[arch],
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "unk_token_id": _field(reader, "tokenizer.ggml.unknown_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    scaling = _rope_scaling(reader, g, config["rope_theta"], config["head_dim"])
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(reader, g, theta: float, head_dim: int) -> dict | None:
    """The config's RoPE scaling from the GGUF file: ``rope.scaling.type`` / ``.factor`` (linear), or
    llama.cpp's per-frequency divisors ``rope_freqs.weight`` (Llama 3), read back into transformers'
    ``llama3`` parameters. A scaling this cannot express is refused: served without it, every
    position past the short ones would be wrong with no error."""
    kind = g("rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported (supported: none, linear, llama3 rope_freqs)")
    if kind == "linear":
        factor = g("rope.scaling.factor")
        if factor is None:
            raise ValueError("GGUF rope.scaling.type is 'linear' but rope.scaling.factor is missing")
        return {"rope_type": "linear", "factor": float(factor)}
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    return llama3_from_rope_freqs(np.asarray(freqs.data, dtype=np.float64).ravel(), theta, head_dim)


def llama3_from_rope_freqs(divisors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """transformers' ``llama3`` RoPE parameters that give llama.cpp's ``rope_freqs`` divisors.

    Llama 3 divides each rotary frequency by 1 (short wavelengths), by ``factor`` (long ones), or in
    between by ``1 / ((1 - s) / factor + s)`` with ``s = (L / wavelen - low) / (high - low)``, L the
    original context. Only the ratios of L, low and high matter, so low is taken as 1 and L and high
    are solved from the in-between divisors (two or more needed); the result must reproduce every
    divisor, or the file is refused."""
    if divisors.shape != (head_dim // 2,):
        raise ValueError(f"GGUF rope_freqs.weight has {divisors.size} values, expected head_dim / 2 = {head_dim // 2}")
    factor = float(divisors.max())
    if np.allclose(divisors, 1.0, rtol=0, atol=1e-6):
        return None
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    band = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    refused = ValueError(
        "GGUF rope_freqs.weight (Llama 3 RoPE scaling) cannot be read back into llama3 parameters "
        f"exactly (divisors {np.round(divisors, 4).tolist()}); convert from the HF checkpoint instead"
    )
    if band.sum() < 2:
        raise refused
    s = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
    (old_len, high), *_ = np.linalg.lstsq(np.stack([1 / wavelen[band], -s], 1), 1 - s, rcond=None)
    if not old_len >= 1 or not high > 1:
        raise refused
    # transformers wants an integer context: scale all three to it (the divisors stay the same),
    # then the shortest decimals that still give every divisor
    scale = round(old_len) / old_len
    for digits in range(3, 12):
        params = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": round(scale, digits),
            "high_freq_factor": round(high * scale, digits),
            "original_max_position_embeddings": round(old_len),
        }
        if np.allclose(_llama3_divisors(params, wavelen), divisors, rtol=1e-6, atol=0):
            return params
    raise refused


def _llama3_divisors(p: dict, wavelen: np.ndarray) -> np.ndarray:
    old, low, high, factor = (
        p["original_max_position_embeddings"],
        p["low_freq_factor"],
        p["high_freq_factor"],
        p["factor"],
    )
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def read_tensors(reader, config: dict) -> dict[str, np.ndarray]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    out = {}
    for t in reader.tensors:
        if t.name in _IGNORED:
            continue
        name = hf_name(t.name)
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(
                f"GGUF tensor {t.name!r} has type {GGMLQuantizationType(t.tensor_type).name}, "
                f"which cannot be dequantized: {e}"
            ) from None
        w = np.array(w.reshape(tuple(reversed([int(d) for d in t.shape]))), dtype=np.float32)  # owned, writable
        # llama.cpp permutes Llama's q and k rows into its rotary layout, and the biases of those rows
        # with them (convert_hf_to_gguf's LlamaModel); v and o are stored as they are
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            n = config["num_attention_heads"] if "attn_q" in t.name else config["num_key_value_heads"]
            w = _unpermute_qk(w, n)
        out[name] = w
    return out


def convert(gguf_path: Path, dest: Path) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reader = gguf.GGUFReader(str(gguf_path))
    config = read_config(reader)
    tensors = read_tensors(reader, config)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: torch.from_numpy(v) for k, v in tensors.items()},
        str(dest / "model.safetensors"),
        metadata={"format": "pt", "source": gguf_path.name},
    )
    model_type = config.pop("model_type")
    AutoConfig.for_model(model_type, **config).save_pretrained(dest)
    GenerationConfig(bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"]).save_pretrained(dest)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(dest)
    (dest / "nanovllm_source.json").write_text(
        json.dumps({"gguf": str(gguf_path), "converter_version": converter_version()})
    )


def _converter_source() -> bytes:
    return Path(__file__).read_bytes()


def converter_version() -> str:
    """What decides a conversion's result besides the file: this module's code and the versions of
    the libraries it calls (gguf dequantizes, transformers rebuilds the tokenizer and writes the
    config). Part of the cache key."""
    h = hashlib.sha256(_converter_source())
    for package in ("gguf", "transformers"):
        try:
            h.update(f"{package}=={version(package)};".encode())
        except PackageNotFoundError:
            h.update(f"{package} missing;".encode())
    return h.hexdigest()[:12]


def gguf_to_hf_dir(gguf_path: str | os.PathLike) -> str:
    """The cached HF directory for a GGUF file, converting it on first use (and again whenever
    the converter changes: see converter_version)."""
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    dest = cache_root() / "gguf" / f"{path.stem}-{remembered_sha256(path)[:16]}-{converter_version()}"

    def build(tmp: Path) -> None:
        logger.info("converting %s to %s (once)", path, dest)
        if sys.stderr.isatty() and not logger.isEnabledFor(logging.INFO):
            # a terminal at the default log level would see 10-100 s of nothing (a user trial's
            # first run); pipes and files (tests, CI) get the log record only
            print(f"nanovllm: converting {path.name} into the model cache (once)", file=sys.stderr, flush=True)
        convert(path, tmp)

    return build_once(dest, "model.safetensors", build)
