"""An HF directory of the tiny zoo (Llama, Qwen2, Qwen3; float32 safetensors) as a float32 GGUF file,
so that engines that load GGUF files only (llama.cpp) can run the zoo's checks.

Written with the ``gguf`` package: the architecture's hyperparameters, every tensor in float32
under llama.cpp's names (Llama's q/k rows permuted to llama.cpp's rotary layout; Qwen2/Qwen3 use
the NeoX layout and keep theirs), and a stand-in vocabulary (the tokenizer's token strings, type
"llama", special tokens marked as control) that is good for token-id input and output only:
engines given such a file should decode text with the directory's own tokenizer. Built once per
model directory into the suite's cache.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

from conformance.cache import build_once, cache_root

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
ARCHS = {"llama", "qwen2", "qwen3"}
EXPORT_VERSION = 2  # bump whenever export() writes something else: cached files are rebuilt


def gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".", 3)
    if parts[:2] == ["model", "layers"] and parts[3] in LAYER_NAMES:
        return f"blk.{int(parts[2])}.{LAYER_NAMES[parts[3]]}.{kind}"
    raise ValueError(f"tensor {hf_name!r} has no GGUF name")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotary halves -> llama.cpp's interleaved pairs (rows of q_proj / k_proj)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_parameters(cfg: dict) -> dict:
    """RoPE theta and scaling from config.json, as transformers 4 (rope_theta, rope_scaling) or 5
    (rope_parameters) writes them: {"rope_theta", "rope_type", ...}."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rp.setdefault("rope_theta", float(cfg.get("rope_theta", 10000.0)))
    rp["rope_type"] = rp.get("rope_type") or rp.get("type") or "default"
    return rp


def llama3_rope_factors(rp: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3 scaling: the divisor of each rotary frequency."""
    factor, low, high = rp["factor"], rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old = rp.get("original_max_position_embeddings", 8192)
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rp["rope_theta"] ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def export(model_dir: Path, dest: Path) -> None:
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg["model_type"]
    if arch not in ARCHS:
        raise ValueError(f"model_type {arch!r} cannot be exported (known: {', '.join(sorted(ARCHS))})")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(dest / "model.gguf"), arch)
    w.add_name(model_dir.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rp = rope_parameters(cfg)
    w.add_rope_freq_base(float(rp["rope_theta"]))
    if rp["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rp["factor"]))
    elif rp["rope_type"] == "llama3" and arch == "llama":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rp, head_dim))
    elif rp["rope_type"] != "default":
        raise ValueError(f"RoPE scaling {rp['rope_type']!r} cannot be exported")
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = {i: t for t, i in tok.get_vocab().items()}
    special = set(tok.all_special_ids)
    w.add_tokenizer_model("llama")
    w.add_token_list([vocab.get(i, f"<unused{i}>") for i in range(cfg["vocab_size"])])
    w.add_token_scores([0.0] * cfg["vocab_size"])
    w.add_token_types(
        [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(cfg["vocab_size"])]
    )
    for key, value in (
        ("bos", cfg.get("bos_token_id")),
        ("eos", cfg.get("eos_token_id")),
        ("pad", cfg.get("pad_token_id")),
    ):
        if isinstance(value, int):
            getattr(w, f"add_{key}_token_id")(value)
    w.add_add_bos_token(False)
    for name, t in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        t = t.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            t = permute_qk(t, heads if "q_proj" in name else kv_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (dest / "source.json").write_text(json.dumps({"hf_dir": str(model_dir)}))


def f32_gguf(model_dir: str) -> str:
    """The float32 GGUF file of the HF directory ``model_dir``, exported on first use (cached)."""
    src = Path(model_dir).resolve()
    stamp = hashlib.sha256(f"export {EXPORT_VERSION}".encode())
    for name in ("config.json", "model.safetensors"):
        st = (src / name).stat()
        stamp.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    dest = cache_root() / "gguf-export" / f"{src.name}-{stamp.hexdigest()[:12]}"
    return str(Path(build_once(dest, "source.json", lambda tmp: export(src, tmp))) / "model.gguf")
