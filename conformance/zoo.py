"""The tiny-model zoo: Qwen3, Qwen2 and Llama models with seeded random weights.

Built by our own code (config dicts, numpy ``Generator`` weights: not
transformers' init, which changes between versions) and saved as ordinary HF
directories: config.json, generation_config.json, model.safetensors and a
word-level tokenizer ("w17 w4 ..."), so text prompts, stop strings and chat
templates work too.

Weights are scaled so that logits are peaked (greedy comparisons mean
something) and attention is sharp (outputs depend on the context).

    from conformance.zoo import zoo_model
    path = zoo_model("qwen3-gqa4-hd128")   # built once, cached
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from conformance.cache import build_once, cache_root

ZOO_VERSION = 2  # bump whenever make_weights or the tokenizer changes what an existing model gets
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<|user|>", "<|assistant|>"]
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2
BIAS_STD = 0.5  # large enough that a dropped bias changes greedy tokens
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)


@dataclass(frozen=True)
class ZooSpec:
    arch: str  # "llama" | "qwen2" | "qwen3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    seed: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    # configuration axes (see AXES): at their defaults they change nothing, not even spec_key
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None  # config.json's rope_scaling (transformers: rope_parameters)
    attention_bias: bool = False  # llama / qwen3: bias on q, k, v and o
    mlp_bias: bool = False  # llama: bias on gate, up and down
    extra_eos_ids: tuple[int, ...] = ()  # generation_config.json EOS ids after EOS_ID (special tokens)

    def __post_init__(self):
        if self.attention_bias and self.arch not in ("llama", "qwen3"):
            raise ValueError(f"attention_bias is a llama / qwen3 option, not {self.arch!r}'s")
        if self.mlp_bias and self.arch != "llama":
            raise ValueError(f"mlp_bias is a llama option, not {self.arch!r}'s")
        if any(not len(SPECIAL_TOKENS) <= i < self.vocab_size for i in self.extra_eos_ids):
            raise ValueError(
                f"extra_eos_ids {self.extra_eos_ids} must be word ids ({len(SPECIAL_TOKENS)}..{self.vocab_size - 1})"
            )


# Fields added after zoo version 2, whose defaults keep the older models as they were: a field at its
# default is left out of spec_key, so adding an axis renames no existing model (nor its golden file).
AXES = {
    f.name: f.default
    for f in fields(ZooSpec)
    if f.name in ("rms_norm_eps", "rope_scaling", "attention_bias", "mlp_bias", "extra_eos_ids")
}


ZOO: dict[str, ZooSpec] = {
    # GQA ratio 1, head_dim 64, untied
    "llama-mha-hd64": ZooSpec("llama", 256, 3, 4, 4, 64, 512, 1024, False, seed=1),
    # GQA ratio 2, head_dim 64, tied, odd vocabulary, q/k/v bias
    "qwen2-gqa2-hd64": ZooSpec("qwen2", 256, 3, 4, 2, 64, 512, 997, True, seed=2),
    # GQA ratio 4, head_dim 128, untied, q/k norm
    "qwen3-gqa4-hd128": ZooSpec("qwen3", 256, 3, 8, 2, 128, 512, 1024, False, seed=3),
    # one KV head (replicated under TP), head_dim 128, tied, odd vocabulary
    "llama-1kv-hd128": ZooSpec("llama", 256, 2, 4, 1, 128, 512, 1001, True, seed=4),
    # Qwen3 with head_dim 64 and tied embeddings, odd vocabulary
    "qwen3-gqa2-hd64-tied": ZooSpec("qwen3", 192, 2, 4, 2, 64, 384, 1031, True, seed=5),
    # llama3 RoPE scaling with all three frequency bands well populated (theta 500, original length
    # 128: 5 high, 11 medium, 16 low of 32), bias on q/k/v/o and on the MLP, max_position_embeddings
    # = the longest golden sequence (160 + 64)
    "llama-rope3-bias": ZooSpec(
        "llama",
        128,
        2,
        4,
        2,
        64,
        256,
        512,
        False,
        seed=6,
        max_position_embeddings=224,
        rope_theta=500.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 128,
        },
        attention_bias=True,
        mlp_bias=True,
    ),
    # linear RoPE scaling; rms_norm_eps 0.5, large enough that a norm built without it (layer norms or
    # q/k norms) changes greedy tokens; three EOS ids in generation_config.json (config.json and the
    # tokenizer name only the first), the other two chosen among tokens greedy output often reaches
    "qwen3-eps-rope-linear": ZooSpec(
        "qwen3",
        128,
        2,
        4,
        2,
        64,
        256,
        512,
        False,
        seed=7,
        rms_norm_eps=0.5,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        extra_eos_ids=(294, 403),
    ),
    # a down projection summing K = 1,536 (past the 512- and 1,024-element reductions where a CPU GEMM
    # may sum one row alone otherwise than a batch's rows: oneDNN did, found at 2026-12-05); no golden
    # file: only the self-consistency rules use it
    "llama-wide-mlp": ZooSpec("llama", 128, 2, 4, 2, 32, 1536, 512, False, seed=11),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config_dict(spec: ZooSpec) -> dict:
    cfg = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": spec.attention_bias,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,  # generation_config.json lists the extra EOS ids, as Qwen2.5 / Llama 3 do
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "use_sliding_window": False,
    }
    if spec.mlp_bias:
        cfg["mlp_bias"] = True
    if spec.rope_scaling is not None:
        cfg["rope_scaling"] = dict(spec.rope_scaling)
    return cfg


def eos_token_ids(spec: ZooSpec) -> list[int]:
    """The EOS ids of the model's generation_config.json."""
    return [EOS_ID, *spec.extra_eos_ids]


def make_weights(spec: ZooSpec) -> dict[str, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    H, hd, I, V = spec.hidden_size, spec.head_dim, spec.intermediate_size, spec.vocab_size  # noqa: E741
    q_out, kv_out = spec.num_heads * hd, spec.num_kv_heads * hd

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def linear(out_f, in_f, gain=1.0):
        return normal((out_f, in_f), gain / np.sqrt(in_f))

    def norm_weight(n):
        return (1.0 + normal((n,), 0.1)).astype(np.float32)

    # With tied embeddings a large input embedding makes the model repeat its input
    # token (the logit of h . e_in dominates); larger sublayer outputs avoid that.
    out_gain = 4.0 if spec.tie_word_embeddings else 1.0
    w = {"model.embed_tokens.weight": normal((V, H), 1.0)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(H)
        w[p + "post_attention_layernorm.weight"] = norm_weight(H)
        w[p + "self_attn.q_proj.weight"] = linear(q_out, H, gain=2.0)  # sharp attention
        w[p + "self_attn.k_proj.weight"] = linear(kv_out, H, gain=2.0)
        w[p + "self_attn.v_proj.weight"] = linear(kv_out, H)
        w[p + "self_attn.o_proj.weight"] = linear(H, q_out, gain=out_gain)
        if spec.arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal((q_out,), 0.1)
            w[p + "self_attn.k_proj.bias"] = normal((kv_out,), 0.1)
            w[p + "self_attn.v_proj.bias"] = normal((kv_out,), 0.1)
        if spec.arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm_weight(hd) * 2.0
            w[p + "self_attn.k_norm.weight"] = norm_weight(hd) * 2.0
        w[p + "mlp.gate_proj.weight"] = linear(I, H)
        w[p + "mlp.up_proj.weight"] = linear(I, H)
        w[p + "mlp.down_proj.weight"] = linear(H, I, gain=out_gain)
        # the axes draw after everything above, so models without them keep their weights
        if spec.attention_bias:
            for proj, n in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out), ("o_proj", H)):
                w[p + f"self_attn.{proj}.bias"] = normal((n,), BIAS_STD)
        if spec.mlp_bias:
            for proj, n in (("gate_proj", I), ("up_proj", I), ("down_proj", H)):
                w[p + f"mlp.{proj}.bias"] = normal((n,), BIAS_STD)
    w["model.norm.weight"] = norm_weight(H)
    if spec.tie_word_embeddings:
        # the tied matrix is the embedding too: peak the logits through the final norm instead
        w["model.norm.weight"] = (w["model.norm.weight"] * 4.0 / np.sqrt(H)).astype(np.float32)
    else:
        w["lm_head.weight"] = normal((V, H), 4.0 / np.sqrt(H))
    return w


def eos_token_name(token_id: int) -> str:
    """The special token an extra EOS id stands for (like Llama 3's <|eot_id|>)."""
    return f"<|end{token_id}|>"


def save_tokenizer(spec: ZooSpec, dest: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(len(SPECIAL_TOKENS), spec.vocab_size):
        vocab[eos_token_name(i) if i in spec.extra_eos_ids else f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    extra = SPECIAL_TOKENS[3:] + [eos_token_name(i) for i in spec.extra_eos_ids]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", additional_special_tokens=extra
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(dest))


def build(spec: ZooSpec, dest: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    dest.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_dict(spec)
    model_type = cfg.pop("model_type")
    AutoConfig.for_model(model_type, **cfg).save_pretrained(str(dest))
    eos = eos_token_ids(spec)
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=eos if len(eos) > 1 else EOS_ID, pad_token_id=PAD_ID
    ).save_pretrained(str(dest))
    save_file(
        {k: torch.from_numpy(v) for k, v in make_weights(spec).items()},
        str(dest / "model.safetensors"),
        metadata={"format": "pt"},
    )
    save_tokenizer(spec, dest)
    (dest / "zoo_spec.json").write_text(json.dumps({"zoo_version": ZOO_VERSION, **spec_fields(spec)}, indent=1))


def spec_fields(spec: ZooSpec) -> dict:
    """The spec's fields, without the axes left at their defaults."""
    return {k: v for k, v in asdict(spec).items() if not (k in AXES and v == AXES[k])}


def spec_key(spec: ZooSpec) -> str:
    blob = json.dumps({"v": ZOO_VERSION, **spec_fields(spec)}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def zoo_model(name: str) -> str:
    """Path of the zoo model ``name``, built on first use (safe under pytest-xdist)."""
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}")
    spec = ZOO[name]
    dest = cache_root() / "zoo" / f"{name}-{spec_key(spec)}"
    return build_once(dest, "zoo_spec.json", lambda tmp: build(spec, tmp))


def main(argv: list[str] | None = None) -> int:
    """``python -m conformance.zoo``: the zoo's models; ``python -m conformance.zoo NAME...``: build
    each (once; cached) and print its folder, which ``--model`` / ``LLM(model=...)`` take."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m conformance.zoo", description=main.__doc__)
    parser.add_argument("names", nargs="*", metavar="NAME", help="zoo models to build (default: list them all)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in ZOO]
    if unknown:
        parser.error(f"unknown zoo model(s) {', '.join(map(repr, unknown))}; known: {', '.join(ZOO)}")
    if not args.names:
        for name, spec in ZOO.items():
            print(
                f"{name:<24} {spec.arch:<6} hidden {spec.hidden_size}, {spec.num_layers} layers, "
                f"{spec.num_heads} heads / {spec.num_kv_heads} KV, vocabulary {spec.vocab_size}"
            )
        return 0
    for name in args.names:
        print(zoo_model(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
