"""The public API: LLM.generate/chat/stats, LLMEngine add_request/step/abort_request, the trace, the CLI."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest

from conformance.zoo import ZOO, zoo_model
from nanovllm import LLM, EngineConfig, RequestOutput, SamplingParams
from tests.conftest import cached_llm, cli_memory_flags, prompts_for

MODEL = "qwen3-gqa2-hd64-tied"


@pytest.fixture(scope="module")
def llm():
    return cached_llm(zoo_model(MODEL), block_size=16, seed=0)


def test_prompt_forms_are_equivalent(llm):
    tok = llm.get_tokenizer()
    text = "w10 w200 w31 w4 w77"
    ids = tok.encode(text)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b, c = llm.generate([text, ids, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert a.prompt == text and a.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert a.outputs[0].text == tok.decode(a.outputs[0].token_ids, skip_special_tokens=True)
    single = llm.generate(text, params, use_tqdm=False)  # a bare string is one prompt
    assert len(single) == 1 and isinstance(single[0], RequestOutput)


def test_chat_applies_the_template(llm):
    conv = [{"role": "user", "content": "w10 w20"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    two = llm.chat([conv, conv], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [out.outputs[0].token_ids] * 2
    with pytest.raises(ValueError, match="role.*content"):
        llm.chat([{"content": "no role"}])


def test_stats_count_steps_and_tokens(llm):
    before = llm.stats()
    llm.generate(
        prompts_for(ZOO[MODEL].vocab_size, (5, 9)),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        use_tqdm=False,
    )
    after = llm.stats()
    assert after["generation_tokens"] - before["generation_tokens"] == 6
    assert after["steps"] - before["steps"] == 3
    assert after["num_free_kv_blocks"] == after["num_kv_blocks"]
    for key in ("preemptions", "prefix_cache_hit_tokens", "steps"):
        assert key in after


def test_engine_step_api_and_abort():
    llm = LLM(zoo_model(MODEL), block_size=16, seed=0, trace=True)
    engine = llm.llm_engine
    vocab = ZOO[MODEL].vocab_size
    p = prompts_for(vocab, (20, 7, 33), seed=4)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for i, prompt in enumerate(p):
        engine.add_request(f"r{i}", prompt, params)
    with pytest.raises(ValueError, match="request_id 'r1' is already in use"):
        engine.add_request("r1", p[0], params)
    assert engine.has_unfinished_requests()
    engine.step()
    aborted = engine.abort_request("r1")
    assert aborted.outputs[0].finish_reason == "abort" and aborted.finished
    assert engine.abort_request("no-such-request") is None
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:  # step() also reports streaming progress
                done[out.request_id] = out
    assert sorted(done) == ["r0", "r2"]
    assert all(len(o.outputs[0].token_ids) == 5 for o in done.values())
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    kinds = [e.kind for e in engine.tracer.events]
    assert kinds[0] == "prefill" and "decode" in kinds
    assert ("r0", "length") in [f for e in engine.tracer.events for f in e.finished]
    text = engine.tracer.events[0].format()
    assert "r0" in text and "prefill" in text and "blocks=" in text


def _cli(*args, timeout=300):
    if args[:1] == ("generate",):
        args = ("generate", *cli_memory_flags(), *args[1:])
    return subprocess.run(
        [sys.executable, "-m", "nanovllm.entrypoints.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_cli_generate_json_and_trace():
    path = zoo_model(MODEL)
    r = _cli(
        "generate",
        "--model",
        path,
        "w10 w20 w30",
        "w5 w6",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
        "--trace",
        "--no-progress",
        "--max-num-batched-tokens",
        "3",
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]  # JSON Lines: one request per line
    assert [len(o["outputs"][0]["token_ids"]) for o in rows] == [4, 4]
    assert "'steps': " in r.stderr
    assert "step    0 prefill" in r.stderr and "finished:" in r.stderr


def test_cli_bad_flags_are_clear_errors(tmp_path):
    path = zoo_model(MODEL)
    r = _cli("generate", "--model", path, "w10", "--top-p", "1.5", "--no-progress")
    assert r.returncode == 2 and "top_p must be in (0, 1], got 1.5" in r.stderr
    r = _cli("generate", "--model", path, "--no-progress")
    assert r.returncode == 2 and "give at least one prompt" in r.stderr
    r = _cli("generate", "--model", path, "--prompts-file", str(tmp_path / "missing.txt"))
    assert r.returncode == 2 and "missing.txt" in r.stderr
    r = _cli("generate", "--model", path, "w10", "--block-size", "abc")
    assert r.returncode == 2 and "--block-size" in r.stderr
    r = _cli("generate", "--model", str(tmp_path / "nope"), "w10")
    assert r.returncode == 2 and "does not exist" in r.stderr


# ------------------------------------------------------------------ first-hour errors and helpers
def test_engine_from_engine_args_and_the_step_loop():
    from nanovllm import LLMEngine

    engine = LLMEngine.from_engine_args(zoo_model(MODEL), block_size=16, seed=0)
    try:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        engine.add_request("x", "w10 w20", params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]  # CUMULATIVE: one per step
        assert [o.finished for o in outs] == [False, False, True] and outs[-1].request_id == "x"
        llm = cached_llm(zoo_model(MODEL), block_size=16, seed=0)
        assert outs[-1].outputs[0].token_ids == llm.generate("w10 w20", params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        engine.close()


def test_llmengine_constructor_points_to_from_engine_args():
    from nanovllm import LLMEngine

    with pytest.raises(
        TypeError, match=r"takes an EngineConfig and an executor, got str.*LLMEngine.from_engine_args\(model"
    ):
        LLMEngine(zoo_model(MODEL))
    with pytest.raises(TypeError, match=r"got no executor.*from_engine_args"):
        LLMEngine(EngineConfig())
    with pytest.raises(TypeError, match="unknown engine argument.*'blocksize'"):
        LLMEngine.from_engine_args(zoo_model(MODEL), blocksize=16)


def test_use_after_close_is_a_clear_error():
    llm = LLM(zoo_model(MODEL), block_size=16, seed=0)
    llm.close()
    llm.close()  # closing twice is fine
    engine = llm.llm_engine
    for call in (
        lambda: llm.generate("w10", use_tqdm=False),
        lambda: engine.add_request("a", "w10"),
        lambda: engine.step(),
    ):
        with pytest.raises(RuntimeError, match=r"this engine is closed \(close\(\) was called\)"):
            call()


def test_a_dict_where_sampling_params_belong_is_named(llm):
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams, got a dict.*SamplingParams\(\*\*"):
        llm.generate(["w10"], {"temperature": 0}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_reset_prefix_cache():
    """False (nothing changed) while a request holds blocks; True once none does; after it, the
    same prompt finds no cached block (without it, it does)."""
    llm = LLM(zoo_model(MODEL), block_size=4, seed=0)
    engine = llm.llm_engine
    try:
        prompt = prompts_for(ZOO[MODEL].vocab_size, (21,), seed=9)[0]
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        engine.add_request("a", prompt, params)
        engine.step()
        cached = len(engine.block_manager.cached)
        assert cached > 0 and engine.reset_prefix_cache() is False and len(engine.block_manager.cached) == cached
        while engine.has_unfinished_requests():
            engine.step()

        def hits() -> int:
            before = llm.stats()["prefix_cache_hit_tokens"]
            llm.generate([prompt], params, use_tqdm=False)
            return llm.stats()["prefix_cache_hit_tokens"] - before

        assert hits() == 20  # control: 5 full blocks of the 21-token prompt are cached
        assert llm.reset_prefix_cache() is True and len(engine.block_manager.cached) == 0
        assert hits() == 0
        engine.check_invariants()
    finally:
        llm.close()


@pytest.mark.parametrize("device,expected", [("cpu", 128), ("cuda", 256)])
def test_default_block_size_per_device(device, expected, monkeypatch):
    """``block_size=None`` resolves to 128 slots on the CPU (the attention kernel streams each block
    and kv head as one run; BENCHMARKS 2026-12-04) and 256 on CUDA. Both hold whole 128-key decode
    tiles and TMA boxes of the GPU kernel and whole 16-slot chunks of the CPU kernel; an explicit
    value is kept."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolve a CUDA config on any host
    hf = types.SimpleNamespace(max_position_embeddings=4096, vocab_size=1000)
    config = EngineConfig(device=device)
    config.resolve(hf, "unused")
    assert config.block_size == expected
    assert config.block_size % 128 == 0 and config.block_size % 16 == 0  # 128: triton_ops.TMA_BLOCK_N
    explicit = EngineConfig(device=device, block_size=32)
    explicit.resolve(hf, "unused")
    assert explicit.block_size == 32


def test_close_frees_the_weights_without_waiting_for_the_garbage_collector(monkeypatch):
    """``LLM.close()`` on the CPU gives back the weights and their oneDNN-packed copies at once, with
    no garbage collection (one costs ~0.2 s of a CLI command's exit). The modules hold reference
    cycles (a parameter's ``weight_loader`` is its layer's bound method), so dropping the model alone
    leaves them to the next full collection: a process that made and closed engines one after another
    (``nanovllm bench --repeat 3``) grew by ~0.9 GB per SmolLM2 engine."""
    import gc
    import weakref

    from nanovllm.layers import cpu_linear

    llm = LLM(zoo_model(MODEL), block_size=16, seed=0)
    runner = llm.llm_engine.executor.runner
    params = [weakref.ref(p) for p in runner.model.parameters()]
    packed = [
        weakref.ref(m.packed_weight) for m in runner.model.modules() if getattr(m, "packed_weight", None) is not None
    ]
    assert params and bool(packed) == cpu_linear.available(), "oneDNN packs every linear layer where it is available"
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    # the KV caches too, after a decode step (the CPU's fused decode layers remember which caches
    # they were built for: weakly, or closing would leave the caches to the garbage collector)
    caches = [weakref.ref(t) for layer in runner.attn_layers for t in (layer.k_cache, layer.v_cache)]
    del runner
    collections = []
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or 0)
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection between close() and the checks either
    try:
        llm.close()
        kept = [p() for p in params if p() is not None and p().numel() > 0]
        assert not kept, f"{len(kept)} of {len(params)} weights kept their storage after close()"
        assert all(ref() is None for ref in packed), "a packed weight outlived close()"
        assert all(ref() is None for ref in caches), "a KV cache outlived close()"
        assert collections == [], "close() ran a garbage collection on the CPU"
    finally:
        if enabled:
            gc.enable()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream, most", [(io.StringIO, 2), (_Terminal, None)])
def test_progress_bar_redraws_a_pipe_rarely(stream, most):
    """A user trial found the bar's carriage-return redraws filling a log file. Into a stream that is
    not a terminal the bar draws its first and last states (and one every NON_TTY_BAR_INTERVAL_S);
    on a terminal it redraws as tqdm does (the control: the same updates give many redraws)."""
    from nanovllm.llm import progress_bar

    out = stream()
    bar = progress_bar(60, True, file=out)
    for _ in range(60):  # >= 0.6 s: a terminal's bar redraws ~6 times (every 0.1 s), a pipe's not once
        time.sleep(0.01)
        bar.update(1)
    bar.close()
    draws = out.getvalue().count("\r")
    assert "60/60" in out.getvalue()
    if most is None:
        assert draws >= 4, out.getvalue()
    else:
        assert draws <= most, out.getvalue()
