"""Bad input: each case raises a specific error naming the field or file and the value,
and afterwards the same engine still generates correctly."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, SamplingParams
from tests.conftest import cached_llm, prompts_for

MODEL = "qwen2-gqa2-hd64"
VOCAB = ZOO[MODEL].vocab_size

SAMPLING_CASES = [
    (dict(temperature=-0.5), ValueError, "temperature.*-0.5"),
    (dict(temperature="hot"), TypeError, "temperature.*'hot'"),
    (dict(temperature=float("nan")), ValueError, "temperature.*nan"),
    (dict(top_p=0.0), ValueError, r"top_p.*\(0, 1\].*0.0"),
    (dict(top_p=1.5), ValueError, "top_p.*1.5"),
    (dict(top_k=-2), ValueError, "top_k.*-2"),
    (dict(top_k=2.5), TypeError, "top_k.*2.5"),
    (dict(min_p=-0.1), ValueError, "min_p.*-0.1"),
    (dict(min_p=1.1), ValueError, "min_p.*1.1"),
    (dict(max_tokens=0), ValueError, "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=-3), ValueError, "max_tokens.*-3"),
    (dict(max_tokens="10"), TypeError, "max_tokens.*'10'"),
    (dict(min_tokens=-1), ValueError, "min_tokens.*-1"),
    (dict(min_tokens=5, max_tokens=2), ValueError, "min_tokens.*5.*max_tokens=2"),
    (dict(stop=[""]), ValueError, "stop.*''"),
    (dict(stop=[3]), ValueError, "stop.*3"),
    (dict(stop_token_ids=[-1]), ValueError, "stop_token_ids.*-1"),
    (dict(logprobs=-1), ValueError, "logprobs.*-1"),
    (dict(prompt_logprobs=-2), ValueError, "prompt_logprobs.*-2"),
    (dict(seed=1.5), TypeError, "seed.*1.5"),
    (dict(n=2), ValueError, "n must be 1.*2"),
]


@pytest.mark.parametrize("kwargs,exc,match", SAMPLING_CASES, ids=[str(c[0]) for c in SAMPLING_CASES])
def test_sampling_params_rejects(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


ENGINE_CASES = [
    (dict(block_size=0), ValueError, "block_size.*0"),
    (dict(block_size="16"), TypeError, "block_size.*'16'"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs.*0"),
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens.*0"),
    (dict(num_kvcache_blocks=-4), ValueError, "num_kvcache_blocks.*-4"),
    (dict(max_model_len=1), ValueError, "max_model_len.*1"),
    (dict(max_model_len=10**7), ValueError, "max_model_len=10000000.*max_position_embeddings"),
    (dict(dtype="float64"), ValueError, "dtype.*'float64'"),
    (dict(device="tpu"), ValueError, "device.*'tpu'"),
    (dict(device="cuda"), ValueError, "device='cuda'"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization.*1.5"),
    (dict(tensor_parallel_size=0), ValueError, "tensor_parallel_size.*0"),
    (dict(enable_prefix_caching="yes"), TypeError, "enable_prefix_caching.*'yes'"),
    (dict(seed=-1), ValueError, "seed.*-1"),
    (dict(no_such_arg=1), TypeError, "unknown engine argument.*'no_such_arg'"),
    (dict(kv_cache_memory_gib=0), ValueError, "kv_cache_memory_gib.*0"),
    (dict(attention_backend="flash"), ValueError, "attention_backend.*'flash'"),
]


@pytest.mark.parametrize("kwargs,exc,match", ENGINE_CASES, ids=[str(c[0]) for c in ENGINE_CASES])
def test_engine_args_rejected(kwargs, exc, match):
    import torch

    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("a GPU is present: device='cuda' is valid here")
    with pytest.raises(exc, match=match):
        LLM(zoo_model(MODEL), **kwargs)


@pytest.fixture(scope="module")
def llm():
    return cached_llm(zoo_model(MODEL), block_size=16, seed=0, max_model_len=128, num_kvcache_blocks=6)


PROMPT_CASES = [
    ("", ValueError, "prompt must not be empty"),
    ([[]], ValueError, "prompt must not be empty"),
    ({"prompt_token_ids": []}, ValueError, "prompt must not be empty"),
    ([5, VOCAB], ValueError, rf"prompt_token_ids\[1\]={VOCAB} is outside the vocabulary"),
    ([5, -1], ValueError, r"prompt_token_ids\[1\]=-1"),
    ([[5, "a"]], TypeError, r"prompt_token_ids\[1\] must be an int, got 'a'"),
    ([[5, 2.0]], TypeError, r"prompt_token_ids\[1\] must be an int"),
    (list(range(5, 5 + 128)), ValueError, "128 tokens.*max_model_len=128"),
    (list(range(5, 5 + 300)), ValueError, "300 tokens.*max_model_len=128"),
    (123, TypeError, "prompts must be"),
    ({"text": "w5"}, ValueError, "'prompt' or 'prompt_token_ids'"),
]


@pytest.mark.parametrize("prompt,exc,match", PROMPT_CASES, ids=[repr(c[0])[:30] for c in PROMPT_CASES])
def test_bad_prompts_leave_engine_usable(llm, prompt, exc, match):
    good = prompts_for(VOCAB, (9,), seed=1)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(exc, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    llm.llm_engine.check_invariants()
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_request_needing_more_blocks_than_the_cache(llm):
    # 6 blocks of 16 = 96 slots; prompt 40 + max_tokens 60 needs ceil(99 / 16) = 7 blocks
    with pytest.raises(ValueError, match="needs up to 7 KV blocks.*num_kvcache_blocks=6"):
        llm.generate(prompts_for(VOCAB, (40,))[0], SamplingParams(max_tokens=60))
    # one impossible request in a batch: nothing is queued, and the batch without it completes
    batch = prompts_for(VOCAB, (5, 40, 7), seed=2)
    params = [SamplingParams(temperature=0, max_tokens=4), SamplingParams(max_tokens=60),
              SamplingParams(temperature=0, max_tokens=4)]
    with pytest.raises(ValueError, match="prompt 1: .*needs up to 7 KV blocks"):
        llm.generate(batch, params, use_tqdm=False)
    outs = llm.generate([batch[0], batch[2]], [params[0], params[2]], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_sampling_params_list_length_mismatch(llm):
    with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2 prompts"):
        llm.generate(prompts_for(VOCAB, (3, 4)), [SamplingParams()], use_tqdm=False)


def test_logprobs_larger_than_vocab(llm):
    with pytest.raises(ValueError, match=f"logprobs={VOCAB + 1} exceeds the vocabulary size {VOCAB}"):
        llm.generate(prompts_for(VOCAB, (3,)), SamplingParams(logprobs=VOCAB + 1), use_tqdm=False)


# ------------------------------------------------------------------ model files
def _copy_model(tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(zoo_model(MODEL), dest)
    return dest


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_missing_config_json(tmp_path):
    d = _copy_model(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(d))


def test_unsupported_architecture(tmp_path):
    d = _copy_model(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        LLM(str(d))


def _rewrite_weights(d: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def test_missing_weight_tensor_is_named(tmp_path):
    d = _copy_model(tmp_path)
    _rewrite_weights(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weight\(s\): model.layers.1.self_attn.k_proj.weight"):
        LLM(str(d))


def test_misshapen_weight_tensor_is_named(tmp_path):
    d = _copy_model(tmp_path)

    def edit(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :-1].clone()
    _rewrite_weights(d, edit)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight.*shape \(256, 511\)"):
        LLM(str(d))


def test_truncated_safetensors_is_named(tmp_path):
    d = _copy_model(tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors.*unreadable or truncated"):
        LLM(str(d))


def test_no_weight_files(tmp_path):
    d = _copy_model(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weight files"):
        LLM(str(d))


def test_gguf_with_unsupported_tensor_type(tmp_path, monkeypatch):
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "bad.gguf"
    w = GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 128), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", 2), ("vocab_size", 64)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
    w.add_tensor("token_embd.weight", np.zeros((64, 64 // block * size), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF tensor 'token_embd.weight' has type Q8_1, which cannot be dequantized"):
        LLM(str(path))


def test_gguf_with_unsupported_architecture(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported"):
        LLM(str(path))


@pytest.mark.parametrize("model,exc,match", [
    (123, TypeError, "model must be a path string or None, got 123"),
    ("", ValueError, "model must be a model directory, a .gguf file or None, got ''"),
])
def test_bad_model_argument(model, exc, match):
    with pytest.raises(exc, match=match):
        LLM(model)
