"""Bad input: one table-driven battery (``BATTERY``, one parametrized test). Each case raises a
specific ValueError / TypeError / FileNotFoundError (the CLI: exit status 2) whose message names
the field or file and the value; after every case the same engine still generates exactly what
it generated before, holds no request and passes its invariants. No ``assert`` validates input
in nanovllm (``python -O`` would drop it): the errors are explicit raises."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, LLMEngine, SamplingParams
from tests.conftest import cached_llm, prompts_for

MODEL = "qwen2-gqa2-hd64"
VOCAB = ZOO[MODEL].vocab_size


@dataclass
class Ctx:
    llm: LLM
    tmp_path: Path
    monkeypatch: pytest.MonkeyPatch
    capsys: pytest.CaptureFixture


@dataclass
class Case:
    id: str
    trigger: Callable[[Ctx], object]
    exc: type | None  # None: a CLI case (exit status 2, message on stderr)
    match: str


def _sampling(**kw):
    return lambda ctx: SamplingParams(**kw)


def _engine(**kw):
    def trigger(ctx):
        import torch

        if kw.get("device") == "cuda" and torch.cuda.is_available():
            pytest.skip("a GPU is present: device='cuda' is valid here")
        LLM(zoo_model(MODEL), **kw)

    return trigger


def _prompt(prompt, **params):
    return lambda ctx: ctx.llm.generate(
        prompt, SamplingParams(**params) if params else SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )


def _cli(*argv):
    def trigger(ctx):
        from nanovllm.entrypoints.cli import main

        return main(["generate", "--no-progress", *[a.format(model=zoo_model(MODEL), tmp=ctx.tmp_path) for a in argv]])

    return trigger


def _closed(ctx):
    llm = LLM(zoo_model(MODEL), block_size=16, num_kvcache_blocks=6, max_model_len=128)
    llm.close()
    return llm.generate(GOOD, GOOD_PARAMS, use_tqdm=False)


def _file(build):
    return lambda ctx: LLM(str(build(ctx)))


SAMPLING_CASES = [
    Case("sampling-temperature-negative", _sampling(temperature=-0.5), ValueError, "temperature.*-0.5"),
    Case("sampling-temperature-str", _sampling(temperature="hot"), TypeError, "temperature.*'hot'"),
    Case("sampling-temperature-nan", _sampling(temperature=float("nan")), ValueError, "temperature.*nan"),
    Case("sampling-top_p-0", _sampling(top_p=0.0), ValueError, r"top_p.*\(0, 1\].*0.0"),
    Case("sampling-top_p-1.5", _sampling(top_p=1.5), ValueError, "top_p.*1.5"),
    Case("sampling-top_k--2", _sampling(top_k=-2), ValueError, "top_k.*-2"),
    Case("sampling-top_k-float", _sampling(top_k=2.5), TypeError, "top_k.*2.5"),
    Case("sampling-min_p-negative", _sampling(min_p=-0.1), ValueError, "min_p.*-0.1"),
    Case("sampling-min_p-1.1", _sampling(min_p=1.1), ValueError, "min_p.*1.1"),
    Case("sampling-max_tokens-0", _sampling(max_tokens=0), ValueError, "max_tokens must be >= 1, got 0"),
    Case("sampling-max_tokens-negative", _sampling(max_tokens=-3), ValueError, "max_tokens.*-3"),
    Case("sampling-max_tokens-str", _sampling(max_tokens="10"), TypeError, "max_tokens.*'10'"),
    Case("sampling-min_tokens-negative", _sampling(min_tokens=-1), ValueError, "min_tokens.*-1"),
    Case(
        "sampling-min_tokens-over-max", _sampling(min_tokens=5, max_tokens=2), ValueError, "min_tokens.*5.*max_tokens=2"
    ),
    Case("sampling-stop-empty-string", _sampling(stop=[""]), ValueError, "stop.*''"),
    Case("sampling-stop-int", _sampling(stop=[3]), TypeError, r"stop\[0\] must be a string, got 3 \(int\)"),
    Case("sampling-stop_token_ids-negative", _sampling(stop_token_ids=[-1]), ValueError, "stop_token_ids.*-1"),
    Case("sampling-logprobs-negative", _sampling(logprobs=-1), ValueError, "logprobs.*-1"),
    Case("sampling-prompt_logprobs-negative", _sampling(prompt_logprobs=-2), ValueError, "prompt_logprobs.*-2"),
    Case("sampling-seed-float", _sampling(seed=1.5), TypeError, "seed.*1.5"),
    Case("sampling-n-0", _sampling(n=0), ValueError, r"n must be in \[1, 4096\], got 0"),
    Case("sampling-n-float", _sampling(n=2.0), TypeError, "n must be an int, got 2.0"),
    Case(
        "sampling-n-greedy",
        _sampling(n=2, temperature=0),
        ValueError,
        r"n must be 1 when using greedy sampling \(temperature 0\), got 2",
    ),
    Case(
        "sampling-presence_penalty-2.5",
        _sampling(presence_penalty=2.5),
        ValueError,
        r"presence_penalty must be in \[-2, 2\], got 2.5",
    ),
    Case(
        "sampling-frequency_penalty--3",
        _sampling(frequency_penalty=-3),
        ValueError,
        r"frequency_penalty must be in \[-2, 2\], got -3",
    ),
    Case(
        "sampling-frequency_penalty-str",
        _sampling(frequency_penalty="high"),
        TypeError,
        "frequency_penalty must be a number, got 'high'",
    ),
    Case(
        "sampling-presence_penalty-nan",
        _sampling(presence_penalty=float("nan")),
        ValueError,
        "presence_penalty must not be NaN",
    ),
    Case(
        "sampling-repetition_penalty-0",
        _sampling(repetition_penalty=0),
        ValueError,
        "repetition_penalty must be a finite number > 0, got 0",
    ),
    Case(
        "sampling-repetition_penalty-inf",
        _sampling(repetition_penalty=float("inf")),
        ValueError,
        "repetition_penalty must be a finite number > 0, got inf",
    ),
    Case(
        "sampling-logit_bias-list",
        _sampling(logit_bias=[1, 2]),
        TypeError,
        r"logit_bias must be a dict of token id -> bias, got \[1, 2\]",
    ),
    Case(
        "sampling-logit_bias-str-key",
        _sampling(logit_bias={"5": 1.0}),
        TypeError,
        "logit_bias key must be an int, got '5'",
    ),
    Case(
        "sampling-logit_bias-negative-key",
        _sampling(logit_bias={-5: 1.0}),
        ValueError,
        "logit_bias keys must be token ids >= 0, got -5",
    ),
    Case(
        "sampling-logit_bias-nan",
        _sampling(logit_bias={5: float("nan")}),
        ValueError,
        r"logit_bias\[5\] must not be NaN",
    ),
    Case(
        "sampling-logit_bias-inf",
        _sampling(logit_bias={5: float("-inf")}),
        ValueError,
        r"logit_bias\[5\] must be finite, got -inf",
    ),
    Case(
        "sampling-allowed_token_ids-empty",
        _sampling(allowed_token_ids=[]),
        ValueError,
        r"allowed_token_ids must not be empty .* got \[\]",
    ),
    Case(
        "sampling-allowed_token_ids-negative",
        _sampling(allowed_token_ids=[3, -1]),
        ValueError,
        "allowed_token_ids must hold token ids >= 0, got -1",
    ),
    Case(
        "sampling-allowed_token_ids-str",
        _sampling(allowed_token_ids="5,6"),
        TypeError,
        "allowed_token_ids must be a list of token ids, got '5,6'",
    ),
    Case(
        "sampling-allowed_token_ids-float",
        _sampling(allowed_token_ids=[5, 6.0]),
        TypeError,
        r"allowed_token_ids\[1\] must be an int, got 6.0",
    ),
    Case(
        "sampling-bad_words-str",
        _sampling(bad_words="hello"),
        TypeError,
        "bad_words must be a list of strings, got the string 'hello'",
    ),
    Case(
        "sampling-bad_words-empty-word",
        _sampling(bad_words=["ok", " "]),
        ValueError,
        "bad_words must hold non-empty strings, got ' '",
    ),
    Case(
        "sampling-bad_words-int",
        _sampling(bad_words=["x", 7]),
        TypeError,
        r"bad_words\[1\] must be a string, got 7 \(int\)",
    ),
]

ENGINE_CASES = [
    Case("engine-block_size-0", _engine(block_size=0), ValueError, "block_size.*0"),
    Case("engine-block_size-str", _engine(block_size="16"), TypeError, "block_size.*'16'"),
    Case("engine-max_num_seqs-0", _engine(max_num_seqs=0), ValueError, "max_num_seqs.*0"),
    Case("engine-max_num_batched_tokens-0", _engine(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens.*0"),
    Case("engine-num_kvcache_blocks-negative", _engine(num_kvcache_blocks=-4), ValueError, "num_kvcache_blocks.*-4"),
    Case("engine-max_model_len-1", _engine(max_model_len=1), ValueError, "max_model_len.*1"),
    Case(
        "engine-max_model_len-huge",
        _engine(max_model_len=10**7),
        ValueError,
        "max_model_len=10000000.*max_position_embeddings",
    ),
    Case("engine-dtype-float64", _engine(dtype="float64"), ValueError, "dtype.*'float64'"),
    Case("engine-device-tpu", _engine(device="tpu"), ValueError, "device.*'tpu'"),
    Case("engine-device-cuda-without-gpu", _engine(device="cuda"), ValueError, "device='cuda'"),
    Case(
        "engine-gpu_memory_utilization-1.5",
        _engine(gpu_memory_utilization=1.5),
        ValueError,
        "gpu_memory_utilization.*1.5",
    ),
    Case("engine-tensor_parallel_size-0", _engine(tensor_parallel_size=0), ValueError, "tensor_parallel_size.*0"),
    Case(
        "engine-enable_prefix_caching-str",
        _engine(enable_prefix_caching="yes"),
        TypeError,
        "enable_prefix_caching.*'yes'",
    ),
    Case("engine-async_scheduling-str", _engine(async_scheduling="on"), TypeError, "async_scheduling.*'on'"),
    Case("engine-seed-negative", _engine(seed=-1), ValueError, "seed.*-1"),
    Case("engine-unknown-argument", _engine(no_such_arg=1), TypeError, "unknown engine argument.*'no_such_arg'"),
    Case("engine-kv_cache_memory_gib-0", _engine(kv_cache_memory_gib=0), ValueError, "kv_cache_memory_gib.*0"),
    Case(
        "engine-attention_backend-flash", _engine(attention_backend="flash"), ValueError, "attention_backend.*'flash'"
    ),
    Case("engine-model-int", lambda ctx: LLM(123), TypeError, "model must be a path string or None, got 123"),
    Case(
        "engine-model-empty",
        lambda ctx: LLM(""),
        ValueError,
        "model must be a model directory, a .gguf file or None, got ''",
    ),
    Case(
        "engine-llmengine-from-a-path",
        lambda ctx: LLMEngine(zoo_model(MODEL)),
        TypeError,
        r"takes an EngineConfig and an executor, got str; to load a model use LLMEngine.from_engine_args",
    ),
    Case(
        "engine-from_engine_args-unknown-argument",
        lambda ctx: LLMEngine.from_engine_args(zoo_model(MODEL), blocks=4),
        TypeError,
        "unknown engine argument.*'blocks'",
    ),
    Case(
        "engine-bad_words-without-tokenizer",
        lambda ctx: LLM(zoo_model(MODEL), skip_tokenizer_init=True, num_kvcache_blocks=6, max_model_len=128).generate(
            GOOD, SamplingParams(bad_words=["w5"]), use_tqdm=False
        ),
        ValueError,
        r"bad_words=\['w5'\] needs a tokenizer, and this model has none",
    ),
    Case("engine-used-after-close", _closed, RuntimeError, r"this engine is closed \(close\(\) was called\)"),
]

PROMPT_CASES = [
    Case("prompt-empty-string", _prompt(""), ValueError, "prompt must not be empty"),
    Case("prompt-empty-ids", _prompt([[]]), ValueError, "prompt must not be empty"),
    Case("prompt-empty-dict", _prompt({"prompt_token_ids": []}), ValueError, "prompt must not be empty"),
    Case(
        "prompt-id-vocab", _prompt([5, VOCAB]), ValueError, rf"prompt_token_ids\[1\]={VOCAB} is outside the vocabulary"
    ),
    Case("prompt-id-negative", _prompt([5, -1]), ValueError, r"prompt_token_ids\[1\]=-1"),
    Case("prompt-id-str", _prompt([[5, "a"]]), TypeError, r"prompt_token_ids\[1\] must be an int, got 'a'"),
    Case("prompt-id-float", _prompt([[5, 2.0]]), TypeError, r"prompt_token_ids\[1\] must be an int"),
    Case("prompt-id-bool", _prompt([[5, 6, True]]), TypeError, r"prompt_token_ids\[2\] must be an int, got True"),
    Case("prompt-at-max_model_len", _prompt(list(range(5, 5 + 128))), ValueError, "128 tokens.*max_model_len=128"),
    Case("prompt-over-max_model_len", _prompt(list(range(5, 5 + 300))), ValueError, "300 tokens.*max_model_len=128"),
    Case("prompt-int", _prompt(123), TypeError, "prompts must be"),
    Case("prompt-dict-without-prompt", _prompt({"text": "w5"}), ValueError, "'prompt' or 'prompt_token_ids'"),
    Case(
        "prompt-more-blocks-than-the-cache",
        _prompt(prompts_for(VOCAB, (40,))[0], max_tokens=60),
        ValueError,
        "needs up to 7 KV blocks.*num_kvcache_blocks=6",
    ),  # 6 x 16 slots; 40 + 60 - 1 needs 7 blocks
    Case(
        "prompt-params-list-length",
        lambda ctx: ctx.llm.generate(prompts_for(VOCAB, (3, 4)), [SamplingParams()], use_tqdm=False),
        ValueError,
        "sampling_params has 1 entries but there are 2 prompts",
    ),
    Case(
        "prompt-sampling_params-dict",
        lambda ctx: ctx.llm.generate(GOOD, {"temperature": 0}, use_tqdm=False),
        TypeError,
        r"sampling_params must be a SamplingParams, got a dict .*write SamplingParams\(\*\*",
    ),
    Case(
        "prompt-logit_bias-over-vocab",
        _prompt(prompts_for(VOCAB, (3,)), logit_bias={VOCAB: 1.0}),
        ValueError,
        rf"logit_bias holds token id\(s\) \[{VOCAB}\] outside the vocabulary \[0, {VOCAB}\)",
    ),
    Case(
        "prompt-allowed_token_ids-over-vocab",
        _prompt(prompts_for(VOCAB, (3,)), allowed_token_ids=[5, VOCAB + 3]),
        ValueError,
        rf"allowed_token_ids holds token id\(s\) \[{VOCAB + 3}\] outside the vocabulary",
    ),
    Case(
        "prompt-stop_token_ids-over-vocab",
        _prompt(prompts_for(VOCAB, (3,)), stop_token_ids=[2, VOCAB]),
        ValueError,
        rf"stop_token_ids holds token id\(s\) \[{VOCAB}\] outside the vocabulary \[0, {VOCAB}\)",
    ),
    Case(
        "prompt-n-over-the-cache",
        _prompt(prompts_for(VOCAB, (40,))[0], max_tokens=60, n=3),
        ValueError,
        "needs up to 7 KV blocks.*num_kvcache_blocks=6",
    ),
    Case(
        "prompt-logprobs-over-vocab",
        _prompt(prompts_for(VOCAB, (3,)), logprobs=VOCAB + 1),
        ValueError,
        f"logprobs={VOCAB + 1} exceeds the vocabulary size {VOCAB}",
    ),
]

CLI_CASES = [
    Case(
        "cli-top-p-1.5",
        _cli("--model", "{model}", "w10", "--top-p", "1.5"),
        None,
        r"top_p must be in \(0, 1\], got 1.5",
    ),
    Case("cli-no-prompt", _cli("--model", "{model}"), None, "give at least one prompt"),
    Case(
        "cli-missing-prompts-file",
        _cli("--model", "{model}", "--prompts-file", "{tmp}/missing.txt"),
        None,
        "missing.txt",
    ),
    Case(
        "cli-block-size-not-int", _cli("--model", "{model}", "w10", "--block-size", "abc"), None, "--block-size.*'abc'"
    ),
    Case("cli-missing-model", _cli("--model", "{tmp}/nope", "w10"), None, "nope.*does not exist"),
    Case(
        "cli-max-tokens-0",
        _cli("--model", "{model}", "w10", "--max-tokens", "0"),
        None,
        "max_tokens must be >= 1, got 0",
    ),
    Case(
        "cli-log-level-unknown",
        _cli("--model", "{model}", "w10", "--log-level", "loud"),
        None,
        "argument --log-level: invalid log level 'loud'",
    ),
    Case(
        "cli-logit-bias-not-json",
        _cli("--model", "{model}", "w10", "--logit-bias", "5:1"),
        None,
        "argument --logit-bias: expected a JSON object of int -> float.*got '5:1'",
    ),
    Case(
        "cli-allowed-token-ids-not-int",
        _cli("--model", "{model}", "w10", "--allowed-token-ids", "5,x"),
        None,
        "argument --allowed-token-ids: expected comma-separated integers, got '5,x'",
    ),
    Case("cli-n-0", _cli("--model", "{model}", "w10", "--n", "0"), None, r"n must be in \[1, 4096\], got 0"),
    Case(
        "cli-n-greedy",
        _cli("--model", "{model}", "w10", "--n", "2", "--temperature", "0"),
        None,
        "n must be 1 when using greedy sampling",
    ),
    Case(
        "cli-repetition-penalty-0",
        _cli("--model", "{model}", "w10", "--repetition-penalty", "0"),
        None,
        "repetition_penalty must be a finite number > 0, got 0.0",
    ),
    Case(
        "cli-presence-penalty-3",
        _cli("--model", "{model}", "w10", "--presence-penalty", "3"),
        None,
        r"presence_penalty must be in \[-2, 2\], got 3.0",
    ),
    Case(
        "cli-bad-words-empty",
        _cli("--model", "{model}", "w10", "--bad-words", ""),
        None,
        "bad_words must hold non-empty strings, got ''",
    ),
]


def _copy_model(tmp_path: Path) -> Path:
    dest = tmp_path / "model"
    shutil.copytree(zoo_model(MODEL), dest)
    return dest


def _edit_config(ctx, **changes) -> Path:
    d = _copy_model(ctx.tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _rewrite_weights(d: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return d


def _no_config(ctx):
    d = _copy_model(ctx.tmp_path)
    (d / "config.json").unlink()
    return d


def _no_weights(ctx):
    d = _copy_model(ctx.tmp_path)
    (d / "model.safetensors").unlink()
    return d


def _truncated(ctx):
    d = _copy_model(ctx.tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return d


def _shrink_down_proj(t):
    t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][:, :-1].clone()


def _gguf(ctx, arch: str, bad_tensor: bool) -> Path:
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    ctx.monkeypatch.setenv("NANOVLLM_CACHE", str(ctx.tmp_path / "cache"))
    path = ctx.tmp_path / f"{arch}.gguf"
    w = GGUFWriter(str(path), arch)
    if bad_tensor:
        for key, value in (
            ("block_count", 1),
            ("context_length", 128),
            ("embedding_length", 64),
            ("feed_forward_length", 128),
            ("attention.head_count", 2),
            ("vocab_size", 64),
        ):
            w.add_uint32(f"{arch}.{key}", value)
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
        w.add_tensor(
            "token_embd.weight", np.zeros((64, 64 // block * size), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_1
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _two_ggufs(ctx) -> Path:
    """A directory with no config.json and two GGUF files: which one is meant is ambiguous."""
    ctx.monkeypatch.setenv("NANOVLLM_CACHE", str(ctx.tmp_path / "cache"))
    d = ctx.tmp_path / "two-ggufs"
    d.mkdir()
    for name in ("model-Q4_K_M.gguf", "model-Q8_0.gguf"):
        (d / name).write_bytes(b"GGUF not really")
    return d


FILE_CASES = [
    Case("file-missing-model-path", _file(lambda ctx: ctx.tmp_path / "nope"), FileNotFoundError, "does not exist"),
    Case("file-missing-config-json", _file(_no_config), FileNotFoundError, "has no config.json"),
    Case("file-dir-with-two-ggufs", _file(_two_ggufs), FileNotFoundError, "has no config.json"),
    Case(
        "file-unsupported-architecture",
        _file(lambda ctx: _edit_config(ctx, architectures=["GPT2LMHeadModel"])),
        ValueError,
        r"unsupported architecture.*GPT2LMHeadModel.*supported: .*LlamaForCausalLM",
    ),
    Case(
        "file-config-without-vocab_size",
        _file(lambda ctx: _edit_config(ctx, vocab_size=0)),
        ValueError,
        "vocab_size.*0",
    ),
    Case(
        "file-missing-weight-tensor",
        _file(
            lambda ctx: _rewrite_weights(
                _copy_model(ctx.tmp_path), lambda t: t.pop("model.layers.1.self_attn.k_proj.weight")
            )
        ),
        ValueError,
        r"missing weight\(s\): model.layers.1.self_attn.k_proj.weight",
    ),
    Case(
        "file-misshapen-weight-tensor",
        _file(lambda ctx: _rewrite_weights(_copy_model(ctx.tmp_path), _shrink_down_proj)),
        ValueError,
        r"model.layers.0.mlp.down_proj.weight.*shape \(256, 511\)",
    ),
    Case("file-truncated-safetensors", _file(_truncated), ValueError, "model.safetensors.*unreadable or truncated"),
    Case("file-no-weight-files", _file(_no_weights), FileNotFoundError, r"no \*.safetensors weight files"),
    Case(
        "file-gguf-unsupported-tensor-type",
        _file(lambda ctx: _gguf(ctx, "llama", bad_tensor=True)),
        ValueError,
        "GGUF tensor 'token_embd.weight' has type Q8_1, which cannot be dequantized",
    ),
    Case(
        "file-gguf-unsupported-architecture",
        _file(lambda ctx: _gguf(ctx, "mamba", bad_tensor=False)),
        ValueError,
        "GGUF architecture 'mamba' is not supported",
    ),
]

BATTERY = SAMPLING_CASES + ENGINE_CASES + PROMPT_CASES + CLI_CASES + FILE_CASES


@pytest.fixture(scope="module")
def llm():
    return cached_llm(zoo_model(MODEL), block_size=16, seed=0, max_model_len=128, num_kvcache_blocks=6)


GOOD = prompts_for(VOCAB, (9,), seed=1)
GOOD_PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def good_tokens(llm):
    return llm.generate(GOOD, GOOD_PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def test_battery_is_large_and_covers_every_kind():
    kinds = {c.id.split("-")[0] for c in BATTERY}
    assert len(BATTERY) >= 40 and kinds == {"sampling", "engine", "prompt", "cli", "file"}, (len(BATTERY), kinds)
    assert len({c.id for c in BATTERY}) == len(BATTERY), "duplicate case ids"


@pytest.mark.parametrize("case", BATTERY, ids=[c.id for c in BATTERY])
def test_bad_input(case, llm, good_tokens, tmp_path, monkeypatch, capsys):
    ctx = Ctx(llm, tmp_path, monkeypatch, capsys)
    if case.exc is None:  # the CLI: exit status 2, the message on stderr, no traceback
        capsys.readouterr()
        try:
            status = case.trigger(ctx)
        except SystemExit as e:  # argparse's own errors
            status = e.code
        err = capsys.readouterr().err
        assert status == 2, f"exit status {status}, stderr: {err[-500:]}"
        assert "Traceback" not in err
        import re

        assert re.search(case.match, err), f"{case.match!r} not in stderr: {err[-500:]}"
    else:
        with pytest.raises(case.exc, match=case.match):
            case.trigger(ctx)
    # the same engine keeps serving, unchanged
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    engine.check_invariants()
    assert llm.generate(GOOD, GOOD_PARAMS, use_tqdm=False)[0].outputs[0].token_ids == good_tokens


def test_one_impossible_request_in_a_batch_blocks_nothing(llm):
    """The batch with one impossible request is refused whole (nothing queued); without it, it completes."""
    batch = prompts_for(VOCAB, (5, 40, 7), seed=2)
    params = [
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(max_tokens=60),
        SamplingParams(temperature=0, max_tokens=4),
    ]
    with pytest.raises(ValueError, match="prompt 1: .*needs up to 7 KV blocks"):
        llm.generate(batch, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    outs = llm.generate([batch[0], batch[2]], [params[0], params[2]], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


# Every integer a request carries, at the edges of 64 bits and beyond: refused by SamplingParams or
# by the engine's request checks, naming the field, or served. Never an error from inside a step,
# which in a server's engine core fails every later request (a user trial: seed=2**64 did that).
EXTREME_INTS = [-(2**64), -(2**63) - 1, -(2**63), -1, 0, 1, 2**31, 2**63 - 1, 2**63, 2**64]
INT_FIELDS = {
    "seed": lambda v: {"seed": v},
    "max_tokens": lambda v: {"max_tokens": v},
    "min_tokens": lambda v: {"min_tokens": v},
    "top_k": lambda v: {"top_k": v},
    "logprobs": lambda v: {"logprobs": v},
    "prompt_logprobs": lambda v: {"prompt_logprobs": v},
    "n": lambda v: {"n": v},
    "stop_token_ids": lambda v: {"stop_token_ids": [v]},
    "allowed_token_ids": lambda v: {"allowed_token_ids": [v]},
    "logit_bias": lambda v: {"logit_bias": {v: 1.0}},
}


def _served_or_refused_by_name(llm, field: str, value: int) -> str:
    try:
        params = SamplingParams(**{"temperature": 1.0, "max_tokens": 3, **INT_FIELDS[field](value)})
        llm.generate(GOOD, params, use_tqdm=False)
    except (TypeError, ValueError) as e:
        assert field in str(e), f"{field}={value}: {type(e).__name__}: {e} (does not name {field})"
        return "refused"
    return "served"


@pytest.mark.parametrize("field", list(INT_FIELDS))
def test_extreme_integers_are_refused_by_name_or_served(field, llm, good_tokens):
    outcomes = {value: _served_or_refused_by_name(llm, field, value) for value in EXTREME_INTS}
    assert set(outcomes.values()) == {"refused", "served"}, outcomes  # both outcomes happen for every field
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    engine.check_invariants()
    assert llm.generate(GOOD, GOOD_PARAMS, use_tqdm=False)[0].outputs[0].token_ids == good_tokens


def test_the_extreme_integers_rule_sees_an_error_from_inside_a_step(llm, monkeypatch):
    """Negative control: a seed check that lets 2**64 through (as before) fails the rule, with the
    generator's own error, which names no field."""
    import nanovllm.sampling_params as sp

    monkeypatch.setattr(sp, "SEED_MAX", 2**64)
    with pytest.raises(AssertionError, match="does not name seed"):
        _served_or_refused_by_name(llm, "seed", 2**64)


@pytest.mark.parametrize("count", [0, 1, 2, 3])
def test_a_model_directory_resolves_to_its_only_gguf(count, tmp_path, monkeypatch):
    """A directory without config.json is its GGUF file where it holds exactly one; with none or
    several it is refused (FileNotFoundError naming the directory) before anything is converted:
    serving the alphabetically first of several quantizations would be a silent guess. Guards
    against the class "ambiguous input resolved without a test of the ambiguous case"; the one-file
    case is the negative control (a stand-in converter shows which file was taken)."""
    from nanovllm.loader import gguf_loader
    from nanovllm.loader.model_loader import resolve_model_dir

    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    converted = []

    def convert(path, dest):
        converted.append(Path(path).name)
        (dest / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(gguf_loader, "convert", convert)
    d = tmp_path / "model"
    d.mkdir()
    names = [f"m-{q}.gguf" for q in ("Q8_0", "Q4_K_M", "F16")[:count]]
    for i, name in enumerate(names):
        (d / name).write_bytes(f"GGUF {i}".encode())
    if count == 1:
        assert Path(resolve_model_dir(str(d))).parent == tmp_path / "cache" / "gguf"
        assert converted == names
    else:
        with pytest.raises(FileNotFoundError, match=f"{d.name}.*has no config.json"):
            resolve_model_dir(str(d))
        assert converted == [] and not (tmp_path / "cache" / "gguf").exists()
