"""`nanovllm serve` with real clients: the official ``openai`` client and ``httpx`` against a server
subprocess on 127.0.0.1 (a tiny zoo model, so it starts in seconds). No mocks.

Greedy streaming text = non-streaming text = offline ``LLM.generate``; 64 concurrent streaming
clients all complete and every KV block comes back (the engine's invariants are checked through
the dev-mode /debug/engine route); a client that disconnects has its request aborted; malformed
JSON, unknown model, wrong types, bad values and oversized prompts get 4xx naming the field, and
the server keeps serving after each.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest

import nanovllm

httpx = pytest.importorskip("httpx", reason="the serve extra (httpx) is not installed")
openai = pytest.importorskip("openai", reason="the serve extra (openai) is not installed")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")

from conformance.zoo import ZOO, zoo_model  # noqa: E402
from nanovllm import SamplingParams  # noqa: E402
from nanovllm.bench.server_process import nanovllm_serve_command, server  # noqa: E402
from tests.conftest import cached_llm, prompts_for, zoo_serve_flags  # noqa: E402

MODEL = "qwen3-gqa2-hd64-tied"
MAX_MODEL_LEN = 256
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def url():
    cmd = nanovllm_serve_command(
        zoo_model(MODEL),
        *zoo_serve_flags(MAX_MODEL_LEN),
        "--api-key",
        KEY,
        "--uvicorn-log-level",
        "warning",
    )
    with server(cmd, env={"NANOVLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"}, ready_timeout=180) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    return cached_llm(zoo_model(MODEL), block_size=16, seed=0, max_model_len=MAX_MODEL_LEN)


def engine_state(url) -> dict:
    r = httpx.get(f"{url}/debug/engine", headers=AUTH, timeout=30)  # runs check_invariants() in the server
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(url, timeout: float = 15.0) -> dict:
    """The engine's state once no request is live (aborts reach the engine between steps)."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(url)
        if not state["requests"] or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def assert_all_blocks_free(url) -> None:
    state = wait_idle(url)
    assert state["requests"] == [], f"requests still live: {state['requests']}"
    s = state["stats"]
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["running"] == s["waiting"] == 0, s


def metric(url, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})? (\S+)$", text, re.M)
    assert m, f"{name} {labels} not in /metrics"
    return float(m.group(2))


def words(vocab: int, n: int, seed: int) -> str:
    return " ".join(f"w{t}" for t in prompts_for(vocab, (n,), seed=seed)[0])


# ------------------------------------------------------------------ equality
def test_greedy_streaming_equals_non_streaming_equals_offline(client, offline):
    vocab = ZOO[MODEL].vocab_size
    text_prompt = words(vocab, 11, seed=1)
    ids_prompt = prompts_for(vocab, (17,), seed=2)[0]
    for prompt in (text_prompt, ids_prompt):
        want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
        full = client.completions.create(model="zoo", prompt=prompt, max_tokens=12, temperature=0)
        chunks = list(client.completions.create(model="zoo", prompt=prompt, max_tokens=12, temperature=0, stream=True))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert want.text and full.choices[0].text == streamed == want.text
        assert full.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == want.finish_reason
        assert full.usage.completion_tokens == len(want.token_ids)
        # a consumer that lags gets the tokens queued up merged into one chunk (by design, as vLLM's
        # outputs merge), so a loaded machine may see a stream in one piece; one that never streams
        # incrementally does so every time
        pieces = [len(chunks)] + [
            len(list(client.completions.create(model="zoo", prompt=prompt, max_tokens=12, temperature=0, stream=True)))
            for _ in range(2)
            if len(chunks) <= 2
        ]
        assert max(pieces) > 2, f"the stream came in one piece each time: {pieces} chunks"

    conv = [{"role": "user", "content": words(vocab, 6, seed=3)}]
    want = offline.chat(conv, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    full = client.chat.completions.create(model="zoo", messages=conv, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="zoo",
            messages=conv,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed == want.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


def test_sampling_fields_reach_the_engine(client, offline):
    """stop, seed, top_k/top_p/min_p, min_tokens, ignore_eos, stop_token_ids, prompt_logprobs:
    each request gives what offline generate gives with the same SamplingParams."""
    vocab = ZOO[MODEL].vocab_size
    prompt = words(vocab, 9, seed=4)
    greedy = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    stop = " " + greedy.text.split(" ")[3]
    cases = [
        (dict(stop=[stop], temperature=0), {}),
        (dict(temperature=1.0, top_p=0.9, seed=1234), {"top_k": 20, "min_p": 0.01}),
        (dict(temperature=0), {"min_tokens": 5, "ignore_eos": True, "stop_token_ids": [greedy.token_ids[2]]}),
    ]
    for fields, extra in cases:
        params = SamplingParams(max_tokens=8, **fields, **extra)
        want = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        for stream in (False, True):
            r = client.completions.create(
                model="zoo", prompt=prompt, max_tokens=8, stream=stream, extra_body=extra, **fields
            )
            text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
            assert text == want.text, (fields, extra, stream)
    r = client.completions.create(model="zoo", prompt=prompt, max_tokens=8, stop=[stop], temperature=0)
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    r = httpx.post(
        f"{client.base_url}completions",
        headers=AUTH,
        timeout=30,
        json={"model": "zoo", "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1},
    )
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 9 and all(len(d) >= 1 for d in plp[1:])


def test_logprobs(client, offline):
    vocab = ZOO[MODEL].vocab_size
    prompt = words(vocab, 7, seed=5)
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[
        0
    ].outputs[0]
    r = client.completions.create(model="zoo", prompt=prompt, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for i, (tok, entry) in enumerate(zip(want.token_ids, want.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entry[tok].logprob, abs=1e-4)
        assert len(lp.top_logprobs[i]) >= 3 and max(lp.top_logprobs[i].values()) == pytest.approx(
            lp.token_logprobs[i], abs=1e-6
        )  # greedy: the sampled token is the most likely
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]

    conv = [{"role": "user", "content": prompt}]
    r = client.chat.completions.create(
        model="zoo", messages=conv, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob) and c.bytes == list(c.token.encode())
    chunks = list(
        client.chat.completions.create(
            model="zoo", messages=conv, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True
        )
    )
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]


def _streamed_logprobs(url, body: dict) -> tuple[str, dict, list]:
    """A streamed completion's text, its logprobs lists joined, and its finish reasons."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    text, joined, reasons = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, []
    for ch in chunks:
        for choice in ch["choices"]:
            text += choice["text"]
            for key, values in (choice["logprobs"] or {}).items():
                joined[key] += values
            reasons.append(choice["finish_reason"])
    return text, joined, reasons


def test_echo_with_logprobs_scores_the_prompt(url, client, offline):
    """echo with logprobs: the prompt's tokens and their logprobs, then the completion's (the
    first prompt token has none); with max_tokens=0 the prompt's alone. What a log-likelihood
    evaluation reads (lm-eval: echo=true, max_tokens 0 or 1, logprobs=1, token-id prompts), equal
    to the offline engine's prompt logprobs, plain and streamed."""
    vocab = ZOO[MODEL].vocab_size
    prompt = words(vocab, 9, seed=11)
    want = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2), use_tqdm=False
    )[0]
    ids, n_prompt = want.prompt_token_ids, len(want.prompt_token_ids)
    r = client.completions.create(model="zoo", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == prompt + want.outputs[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, n_prompt):
        own = want.prompt_logprobs[pos][ids[pos]]
        assert lp.tokens[pos] == own.decoded_token
        assert lp.token_logprobs[pos] == pytest.approx(own.logprob, abs=1e-4)
        assert lp.top_logprobs[pos][own.decoded_token] == lp.token_logprobs[pos]
        assert 2 <= len(lp.top_logprobs[pos]) <= 3  # the 2 most likely and the prompt's own token
    for j, (tok, entry) in enumerate(zip(want.outputs[0].token_ids, want.outputs[0].logprobs)):
        assert lp.token_logprobs[n_prompt + j] == pytest.approx(entry[tok].logprob, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n_prompt + 3)]
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 3
    assert choice.model_extra.get("prompt_logprobs") is None  # not asked for

    # lm-eval's request: token ids, max_tokens=0, logprobs=1
    body = {"model": "zoo", "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=30)
    assert r.status_code == 200, r.text
    only = r.json()["choices"][0]
    assert only["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    assert len(only["logprobs"]["tokens"]) == n_prompt and only["text"] == prompt
    assert only["logprobs"]["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-5)
    tops = only["logprobs"]["top_logprobs"][1:]  # k=1, and the prompt's own token where it is not the top
    assert all(1 <= len(top) <= 2 for top in tops) and any(len(top) == 2 for top in tops)
    # the one token the engine runs is a stop token here: the answer, which generated nothing, still ends by length
    first = offline.generate([ids], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids
    stopped = httpx.post(
        f"{url}/v1/completions", headers=AUTH, json={**body, "stop_token_ids": first}, timeout=30
    ).json()["choices"][0]
    assert stopped["finish_reason"] == "length" and stopped["stop_reason"] is None and stopped["text"] == prompt
    # the same, streamed: one chunk with the prompt, nothing generated
    text, streamed, reasons = _streamed_logprobs(url, body)
    assert text == only["text"] and streamed == only["logprobs"] and reasons[-1] == "length"
    body = {"model": "zoo", "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}
    text, streamed, _ = _streamed_logprobs(url, body)
    assert text == choice.text and streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-6)

    # two prompts, n=2, tokens named by id: each choice echoes its own prompt first
    pair = [words(vocab, 5, seed=21), words(vocab, 7, seed=22)]
    pair_ids = [offline.generate([p], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids for p in pair]
    body = {"model": "zoo", "prompt": pair, "n": 2, "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={**body, "return_tokens_as_token_ids": True}, timeout=30)
    assert [ch["index"] for ch in r.json()["choices"]] == [0, 1, 2, 3]
    for ch in r.json()["choices"]:
        ids_i = pair_ids[ch["index"] // 2]
        assert ch["text"].startswith(pair[ch["index"] // 2]) and len(ch["logprobs"]["tokens"]) == len(ids_i) + 2
        assert ch["logprobs"]["tokens"][: len(ids_i)] == [f"token_id:{t}" for t in ids_i]
        assert ch["logprobs"]["token_logprobs"][0] is None and None not in ch["logprobs"]["token_logprobs"][1:]

    # a prompt whose first blocks the prefix cache holds: its logprobs are still computed, the same
    long = words(vocab, 40, seed=23)
    client.completions.create(model="zoo", prompt=long, max_tokens=1, temperature=0)  # fills the cache
    want_long = offline.generate([long], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    r = client.completions.create(model="zoo", prompt=long, max_tokens=0, temperature=0, logprobs=1, echo=True)
    got = r.choices[0].logprobs.token_logprobs
    assert len(got) == len(want_long.prompt_token_ids) == 40 and got[0] is None
    want_lps = [want_long.prompt_logprobs[i][t].logprob for i, t in enumerate(want_long.prompt_token_ids) if i]
    assert got[1:] == pytest.approx(want_lps, abs=1e-4)

    # echo's k and the request's own prompt_logprobs each keep their own size
    body = {"model": "zoo", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "prompt_logprobs": 4}
    both = httpx.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=30).json()["choices"][0]
    assert max(len(top) for top in both["logprobs"]["top_logprobs"][1:n_prompt]) <= 2
    assert min(len(d) for d in both["prompt_logprobs"][1:]) >= 4
    assert_all_blocks_free(url)


def test_sse_chunk_shapes_and_usage(url):
    body = {
        "model": "zoo",
        "prompt": [[5, 6, 7], [8, 9]],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + ["length"]
    body["stream_options"] = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    assert all(c["choices"] and c.get("usage") is None for c in chunks)


def sse_chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/{path}", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]


def test_stream_chunks_keep_prompt_logprobs_and_continuous_usage(url):
    """What the text-only chunk fast path must not drop: a streamed completion's prompt_logprobs
    (in its first chunk, equal to the non-streamed ones) and, with continuous_usage_stats, the
    running usage on every chunk of completions and chat."""
    prompt = [5, 6, 7, 8]
    body = {"model": "zoo", "prompt": prompt, "max_tokens": 6, "temperature": 0, "prompt_logprobs": 1}
    whole = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30).json()
    chunks = sse_chunks(url, "completions", {**body, "stream": True})
    assert chunks[0]["choices"][0]["prompt_logprobs"] == whole["choices"][0]["prompt_logprobs"]
    assert len(whole["choices"][0]["prompt_logprobs"]) == len(prompt)

    opts = {"include_usage": True, "continuous_usage_stats": True}
    chat = {"model": "zoo", "messages": [{"role": "user", "content": "hi"}]}
    # 32 tokens: a stream reader that falls behind gets what queued up merged into one chunk
    # (AsyncLLM), so a short stream on a loaded machine can arrive as two chunks (it did in CI with
    # 6 tokens); a longer one still has several mid-stream chunks
    for path, extra in (("completions", {"prompt": prompt}), ("chat/completions", chat)):
        body = {"model": "zoo", "max_tokens": 32, "temperature": 0, "ignore_eos": True, "stream": True, **extra}
        chunks = sse_chunks(url, path, {**body, "stream_options": opts})
        with_choices = [c for c in chunks if c["choices"]]
        assert len(with_choices) >= 3, path  # several chunks mid-stream, where the fast path applies
        assert all("usage" in c for c in with_choices), path
        counts = [c["usage"]["completion_tokens"] for c in with_choices]
        assert counts == sorted(counts) and counts[-1] == 32, (path, counts)


# ---------------------------------------------------------------- concurrency
def test_64_concurrent_streaming_clients(url, offline):
    vocab = ZOO[MODEL].vocab_size
    prompts = prompts_for(vocab, [3 + (i * 7) % 40 for i in range(64)], seed=6)
    want = [
        o.outputs[0].text
        for o in offline.generate(
            prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
        )
    ]
    steps_before = engine_state(url)["stats"]["steps"]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model="zoo", prompt=prompt, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with openai.AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key=KEY,
            max_retries=0,
            timeout=60,
            http_client=httpx.AsyncClient(limits=limits, timeout=60),
        ) as aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, p) for p in prompts)), timeout=90)

    results = asyncio.run(main())
    assert [r[0] for r in results] == want
    assert all(r[1] == "length" for r in results)
    steps = engine_state(url)["stats"]["steps"] - steps_before
    assert steps < 64 * 10 / 4, f"{steps} steps for 64 requests of 10 tokens: they were not batched"
    assert_all_blocks_free(url)
    assert metric(url, "nanovllm:kv_cache_usage_perc") == 0.0


def test_client_disconnect_aborts_the_request(url):
    aborted_before = _aborted(url)
    body = {
        "model": "zoo",
        "prompt": [5, 6, 7, 8],
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks, then hang up
    assert sum(line.startswith("data: {") for line in got) >= 3
    assert_all_blocks_free(url)
    assert _aborted(url) == aborted_before + 1
    # not streaming: the client gives up a quarter of the way through the request. On a loaded
    # machine the request's own time varies from one run to the next, and one that happens to run
    # much faster than the timed one can finish before the server reads the hang-up (seen once in
    # the full suite on 2 cores): up to three tries, each freeing every block; a server that never
    # aborts fails all three
    for _ in range(3):
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=30)
        assert r.json()["choices"][0]["finish_reason"] == "length"
        full = time.perf_counter() - start
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=full / 4)
        assert_all_blocks_free(url)
        if _aborted(url) == aborted_before + 2:
            break
    assert _aborted(url) == aborted_before + 2


def _aborted(url) -> float:
    try:
        return metric(url, "nanovllm:request_success_total", 'finished_reason="abort"')
    except AssertionError:  # no abort yet: the labelled series does not exist
        return 0.0


# -------------------------------------------------------------------- errors
TOO_LONG = [7] * (MAX_MODEL_LEN + 4)
BAD_REQUESTS = [
    # (route, body, status, param)
    ("completions", b'{"prompt": "w5", "max_tokens": ', 400, "body"),
    ("completions", b"[1, 2]", 400, "body"),
    ("completions", {"model": "gpt-4", "prompt": "w5"}, 404, "model"),
    ("completions", {"prompt": "w5", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "w5", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"max_tokens": 5}, 400, "prompt"),
    ("completions", {"prompt": "w5", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "w5", "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage"),
    ("completions", {"prompt": "w5", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "w5", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "w5", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "w5", "n": 0}, 400, "n"),
    # beyond 64 bits: the engine core's generator refused it, and the engine served no more requests
    ("completions", {"prompt": "w5", "seed": 2**64}, 400, "seed"),
    ("completions", {"prompt": "w5", "logprobs": -1}, 400, "logprobs"),
    ("completions", {"prompt": "w5", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "w5", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ("completions", {"prompt": "w5", "echo": True, "max_tokens": 0, "min_tokens": 2}, 400, "min_tokens"),
    # echo asks the engine for at least `logprobs` prompt logprobs: a bad value of either is still named
    ("completions", {"prompt": "w5", "echo": True, "logprobs": 1, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("completions", {"prompt": "w5", "echo": True, "logprobs": -1, "prompt_logprobs": 2}, 400, "logprobs"),
    ("completions", {"prompt": "w5", "suffix": "w6"}, 400, "suffix"),
    ("completions", {"prompt": [10**6]}, 400, "prompt"),
    ("completions", {"prompt": TOO_LONG}, 400, "prompt"),
    ("completions", {"prompt": TOO_LONG, "stream": True}, 400, "prompt"),
    ("completions", {"prompt": "w5", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "w5"}], "max_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "w5"}], "max_completion_tokens": MAX_MODEL_LEN},
        400,
        "max_completion_tokens",
    ),
    # constraints the server cannot honour: refused, never answered with free text as if honoured
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "w5"}], "response_format": {"type": "json_object"}},
        400,
        "response_format",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "w5"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "w5"}], "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    ("completions", {"prompt": "w5", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "w5"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "w5"}], "top_logprobs": 3}, 400, "top_logprobs"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": " ".join(["w9"] * MAX_MODEL_LEN)}]},
        400,
        "messages",
    ),
]


def test_a_body_that_is_not_json_by_its_content_type_is_a_415(url):
    """As vLLM: a POST whose Content-Type is not JSON (curl -d sends a form) is a 415 saying what to
    send, not a 400 about a dictionary; JSON with a charset is JSON (the control)."""
    body = b'{"model": "zoo", "prompt": "w5", "max_tokens": 2, "temperature": 0}'
    for kind in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**AUTH, **({"Content-Type": kind} if kind else {})}
        r = httpx.post(f"{url}/v1/completions", content=body, headers=headers, timeout=30)
        assert r.status_code == 415, (kind, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == "Content-Type" and err["type"] == "invalid_request_error", err
        assert err["message"].startswith(f"Content-Type must be application/json, got {kind or 'none'!r}"), err
    headers = {**AUTH, "Content-Type": "application/json; charset=utf-8"}
    assert httpx.post(f"{url}/v1/completions", content=body, headers=headers, timeout=30).status_code == 200
    r = httpx.get(f"{url}/v1/completions", headers=AUTH, timeout=30)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.get(f"{url}/version", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json() == {"version": nanovllm.__version__}, r.text


def test_bad_requests_get_4xx_naming_the_field_and_the_server_keeps_serving(url, client):
    for route, body, status, param in BAD_REQUESTS:
        kwargs = (
            {"content": body, "headers": {**AUTH, "Content-Type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body, "headers": AUTH}
        )
        r = httpx.post(f"{url}/v1/{route}", timeout=30, **kwargs)
        assert r.status_code == status, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (body, err)
        assert err["message"] and "Traceback" not in r.text
        ok = client.completions.create(model="zoo", prompt="w10 w11", max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason in ("length", "stop"), body
    # the control: values that ask for nothing are served
    ok = client.chat.completions.create(
        model="zoo", messages=[{"role": "user", "content": "w5"}], max_tokens=2, temperature=0,
        response_format={"type": "text"}, tool_choice="none", tools=[],
    )  # fmt: skip
    assert ok.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="w10", max_tokens=2)
    assert_all_blocks_free(url)


def _post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json={"model": "zoo", "temperature": 0, **body}, headers=AUTH, timeout=120)


def test_max_tokens_may_fill_the_context_exactly_and_not_one_past(url):
    """A prompt of L tokens with max_tokens = max_model_len - L fits exactly (vLLM refuses only
    prompt + max_tokens > max_model_len): it is served and, under ignore_eos, generates all of them,
    on completions and chat; one token more is a 400 naming max_tokens."""
    prompt = prompts_for(ZOO[MODEL].vocab_size, (MAX_MODEL_LEN - 12,), seed=31)[0]
    conv = [{"role": "user", "content": words(ZOO[MODEL].vocab_size, MAX_MODEL_LEN - 20, seed=32)}]
    for route, head in (("completions", {"prompt": prompt}), ("chat/completions", {"messages": conv})):
        probe = _post(url, route, {**head, "max_tokens": 1})
        assert probe.status_code == 200, probe.text
        room = MAX_MODEL_LEN - probe.json()["usage"]["prompt_tokens"]
        assert 0 < room < 32, (route, room)  # short, so the exact fit costs little
        r = _post(url, route, {**head, "max_tokens": room, "ignore_eos": True})
        assert r.status_code == 200, (route, r.text)
        body = r.json()
        assert body["usage"]["completion_tokens"] == room and body["choices"][0]["finish_reason"] == "length", body
        r = _post(url, route, {**head, "max_tokens": room + 1, "ignore_eos": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", (route, r.text)
    assert_all_blocks_free(url)


def test_a_request_without_max_tokens_gets_16_on_completions_and_the_rest_of_the_context_on_chat(url):
    """As vLLM (and OpenAI's legacy completions API): a completion that leaves max_tokens out
    generates at most 16 tokens; a chat completion may use the rest of the context window. Under
    ignore_eos both run to that limit and finish by length."""
    r = _post(url, "completions", {"prompt": [5, 6, 7], "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length", body
    # a long prompt, so the rest of the context is a few tokens (MAX_MODEL_LEN is small here)
    conv = [{"role": "user", "content": words(ZOO[MODEL].vocab_size, MAX_MODEL_LEN - 30, seed=33)}]
    r = _post(url, "chat/completions", {"messages": conv, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    room = MAX_MODEL_LEN - body["usage"]["prompt_tokens"]
    assert 16 < room < 40, room  # past the completions default: a chat that took 16 would fail below
    assert body["usage"]["completion_tokens"] == room and body["choices"][0]["finish_reason"] == "length", body
    assert_all_blocks_free(url)


def test_api_key(url):
    body = {"prompt": "w10", "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 401
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # open, for load balancers
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200


# --------------------------------------------------------- the other routes
def test_models_tokenize_detokenize(url, client, offline):
    assert [m.id for m in client.models.list().data] == ["zoo"]
    tok = offline.get_tokenizer()
    r = httpx.post(f"{url}/tokenize", json={"prompt": "w10 w20 w30"}, headers=AUTH, timeout=30).json()
    assert r["tokens"] == tok.encode("w10 w20 w30") and r["count"] == 3 and r["max_model_len"] == MAX_MODEL_LEN
    conv = [{"role": "user", "content": "w10 w20"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": conv}, headers=AUTH, timeout=30).json()
    assert r["tokens"] == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
    r = httpx.post(f"{url}/detokenize", json={"tokens": tok.encode("w10 w20")}, headers=AUTH, timeout=30)
    assert r.json() == {"prompt": "w10 w20"}
    r = httpx.post(f"{url}/detokenize", json={"tokens": [5, 10**7]}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"


def test_text_parts_of_a_message_are_joined_with_newlines(url):
    """A message whose content is a list of text parts is the parts joined with "\\n" (vLLM's
    behaviour): /tokenize gives the ids of the string "w10\\nw20", not those of "w10w20" (one unknown
    word to this tokenizer), and a chat completion's prompt is that many tokens."""
    parts = [{"type": "text", "text": "w10"}, {"type": "text", "text": "w20"}]

    def tokens(content) -> list[int]:
        body = {"messages": [{"role": "user", "content": content}]}
        r = httpx.post(f"{url}/tokenize", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    joined, glued = tokens("w10\nw20"), tokens("w10w20")
    assert joined != glued  # the control: the two joins tokenize apart
    assert tokens(parts) == joined
    r = _post(url, "chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(joined), r.text


def test_tokenize_honours_add_special_tokens_with_a_tokenizer_that_adds_bos(tmp_path):
    """/tokenize's ``add_special_tokens`` (default true) reaches the tokenizer: with one that adds
    BOS (the zoo's tokenizer given a post-processor that prepends <bos>; the zoo's own add no
    special tokens, so they cannot tell) false gives ``encode(p, add_special_tokens=False)``, true
    and the default the ids with BOS first. On the app over a stub engine: no model is loaded."""
    from conformance.zoo import BOS_ID
    from nanovllm.entrypoints.openai.api_server import build_app
    from nanovllm.tokenizer import load_tokenizer
    from tests.test_serve_metrics_prefix import stub_engine

    src = zoo_model(MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((Path(src) / name).read_bytes())
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [BOS_ID], "tokens": ["<bos>"]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(str(tmp_path))
    prompt = "w10 w20 w30"
    bare = tok.encode(prompt, add_special_tokens=False)
    assert tok.encode(prompt) == [BOS_ID, *bare] and BOS_ID not in bare  # the tokenizer adds BOS

    async def ask(bodies: list[dict]) -> list[dict]:
        engine = stub_engine()
        engine.tokenizer, engine.model_dir = tok, str(tmp_path)
        app = build_app(engine, ["m"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            out = []
            for body in bodies:
                r = await client.post("/tokenize", json={"prompt": prompt, **body})
                assert r.status_code == 200, (body, r.text)
                out.append(r.json()["tokens"])
            return out

    default, with_bos, without = asyncio.run(ask([{}, {"add_special_tokens": True}, {"add_special_tokens": False}]))
    assert default == with_bos == [BOS_ID, *bare]
    assert without == bare


def test_chat_continues_the_final_message_and_echoes_it(url, offline):
    """An assistant message left open (``continue_final_message``, no generation prompt): the prompt
    ends with its content (the template's ids for it, /tokenize too), the answer goes on from there in
    the assistant's role, and ``echo`` puts the message's content first, in the plain answer and as
    the stream's first content chunk. Echo needs the answer's role: after a user message and a
    generation prompt nothing is echoed. Both prompts' flags at once are a 400 naming the field."""
    tok = offline.get_tokenizer()
    conv = [{"role": "user", "content": "w10 w20"}, {"role": "assistant", "content": "w30 w40"}]
    want_ids = tok.apply_chat_template(
        conv, add_generation_prompt=False, continue_final_message=True, tokenize=True, return_dict=False
    )
    # (the zoo's template ends no turn with a token, so an open and a closed turn tokenize alike here:
    # tests/test_chat_template_flags.py shows the flag reaching a template that does)
    assert tok.decode(want_ids).endswith("w30 w40")
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    r = httpx.post(f"{url}/tokenize", json={"messages": conv, **flags}, headers=AUTH, timeout=30).json()
    assert r["tokens"] == want_ids
    body = {"model": "zoo", "messages": conv, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **flags}

    def post(**extra) -> dict:
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    plain, echo = post(), post(echo=True)
    greedy = offline.generate(
        [{"prompt_token_ids": want_ids}],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": greedy.text}
    assert plain["usage"]["prompt_tokens"] == len(want_ids)
    assert echo["choices"][0]["message"]["content"] == "w30 w40" + greedy.text
    assert echo["usage"] == plain["usage"]  # the echoed text is not generated
    chunks = sse_chunks(url, "chat/completions", {**body, "echo": True, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "w30 w40"}
    assert "".join(d.get("content", "") for d in deltas) == "w30 w40" + greedy.text
    # each of n choices is echoed once, at its start (sampled, seeded: the rest is the choice's own)
    sampled = {"n": 3, "temperature": 1.0, "seed": 7, "echo": True}
    many = post(**sampled)["choices"]
    assert sorted(ch["index"] for ch in many) == [0, 1, 2]
    for ch in many:
        assert ch["message"]["content"].startswith("w30 w40")
        assert not ch["message"]["content"][len("w30 w40") :].startswith("w30 w40")
    chunks = sse_chunks(url, "chat/completions", {**body, **sampled, "stream": True})
    for i in range(3):
        contents = [
            c["choices"][0]["delta"].get("content") for c in chunks if c["choices"] and c["choices"][0]["index"] == i
        ]
        assert contents[:2] == ["", "w30 w40"] and "w30 w40" not in contents[2:], (i, contents)

    asked = [{"role": "user", "content": "w10 w20"}]
    answer = post(messages=asked, add_generation_prompt=True, continue_final_message=False, echo=True)
    assert not answer["choices"][0]["message"]["content"].startswith("w10 w20")
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "add_generation_prompt": True}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_metrics(url, client):
    names = [
        "nanovllm:time_to_first_token_seconds_count",
        "nanovllm:inter_token_latency_seconds_count",
        "nanovllm:e2e_request_latency_seconds_count",
        "nanovllm:request_queue_time_seconds_count",
        "nanovllm:generation_tokens_total",
        "nanovllm:prompt_tokens_total",
    ]
    before = {n: metric(url, n) for n in names}
    client.completions.create(
        model="zoo", prompt=[5, 6, 7, 8, 9], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    after = {n: metric(url, n) for n in names}
    assert after["nanovllm:generation_tokens_total"] - before["nanovllm:generation_tokens_total"] == 6
    assert after["nanovllm:prompt_tokens_total"] - before["nanovllm:prompt_tokens_total"] == 5
    assert (
        after["nanovllm:inter_token_latency_seconds_count"] - before["nanovllm:inter_token_latency_seconds_count"] == 5
    )
    for n in names[:4]:
        assert after[n] - before[n] == (5 if "inter_token" in n else 1), n
    for n in (
        "nanovllm:kv_cache_usage_perc",
        "nanovllm:num_preemptions_total",
        "nanovllm:prefix_cache_hit_rate",
        "nanovllm:prefix_cache_queries_total",
        "nanovllm:num_requests_running",
    ):
        assert metric(url, n) >= 0
    assert metric(url, "nanovllm:prefix_cache_queries_total") > 0
    page = httpx.get(f"{url}/metrics", timeout=30).text
    assert "nanovllm:request_success_total" in page and "_created" not in page  # no creation-time series


# ------------------------------------------------------------- bench serve
def test_bench_serve_client(url):
    """`nanovllm bench serve`'s client against this server: every request completes with the
    tokens asked for, and the latencies are consistent."""
    from nanovllm.bench.serve import percentile, run_requests
    from nanovllm.bench.workloads import Workload

    vocab = ZOO[MODEL].vocab_size
    w = Workload("t", prompts_for(vocab, (4, 9, 30, 12, 7, 3), seed=8), [5, 9, 3, 12, 6, 1], 0.0, 0, 0)
    m = asyncio.run(run_requests(url, "zoo", w, rate=50.0, max_concurrency=3, api_key=KEY))
    assert all(r.ok for r in m.results), [r.error for r in m.results]
    assert [r.output_tokens for r in m.results] == w.max_tokens and m.output_tokens == sum(w.max_tokens)
    for r, n in zip(m.results, w.max_tokens):
        # a chunk holds one token, or several when the server merged them for a client behind
        assert 0 < r.ttft <= r.e2e and len(r.itl) <= n - 1 and all(x >= 0 for x in r.itl)
    s = m.summary()
    assert s["completed"] == 6 and s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"]
    bad = asyncio.run(run_requests(url, "zoo", w, rate=float("inf"), max_concurrency=None, api_key="wrong"))
    assert not any(r.ok for r in bad.results) and "401" in bad.results[0].error  # failures are counted
    import numpy as np

    xs = [0.3, 0.1, 0.7, 0.2, 0.9]
    assert [percentile(xs, p) for p in (50, 90, 99)] == pytest.approx(np.percentile(xs, [50, 90, 99]))


def server_cpu_seconds_past(url, before: float | None, timeout: float = 20.0) -> float | None:
    """The server's ``process_cpu_seconds_total`` once it has moved past ``before``. The kernel
    counts CPU time in clock ticks (10 ms), and a handful of small requests can fit in one tick,
    so the value is read again (each scrape costs the server CPU time) until it moves; a value
    that never moves (a stale or constant series) is returned as it is, and fails the caller."""
    from nanovllm.bench.serve import server_cpu_seconds

    deadline = time.monotonic() + timeout
    while True:
        now = server_cpu_seconds(url, KEY)
        if before is None or now is None or now > before or time.monotonic() > deadline:
            return now


def test_bench_serve_client_processes_split_the_requests_and_keep_their_order(url):
    """`--client-processes 2`: each process sends its share, all start together; the merged
    results are in the workload's order (each request's token count is its own max_tokens), and
    each process's CPU time is reported; the server's CPU time comes from its /metrics."""
    from nanovllm.bench.serve import run_split, server_cpu_seconds
    from nanovllm.bench.workloads import Workload

    vocab = ZOO[MODEL].vocab_size
    max_tokens = [5, 9, 3, 12, 6, 1, 7]
    w = Workload("t", prompts_for(vocab, (4, 9, 30, 12, 7, 3, 5), seed=9), max_tokens, 0.0, 0, 0)
    before = server_cpu_seconds(url, KEY)
    m = run_split(url, "zoo", w, float("inf"), None, 2, api_key=KEY)
    after = server_cpu_seconds_past(url, before)
    assert all(r.ok for r in m.results), [r.error for r in m.results]
    assert [r.output_tokens for r in m.results] == max_tokens
    assert len(m.client_cpu_s) == 2 and all(c > 0 for c in m.client_cpu_s)
    assert all(0 <= r.sent_at <= r.done_at <= m.duration + 1e-6 for r in m.results)
    assert before is not None and after is not None and after > before
    m.server_cpu_s = after - before
    busy = m.summary()["cpu_busy"]
    assert busy["client_processes"] == 2 and 0 < busy["client_busiest"] and 0 < busy["server_process"]
    # every request's chunks counted: at least one per request, at most one per token
    assert len(max_tokens) <= m.output_tokens / busy["tokens_per_chunk"] <= sum(max_tokens)
    assert busy["server_cpu_ms_per_chunk"] > 0
    # a concurrency cap is shared out: 3 over 2 processes
    capped = run_split(url, "zoo", w, float("inf"), 3, 2, api_key=KEY)
    assert [r.output_tokens for r in capped.results] == max_tokens


def test_default_client_processes():
    from nanovllm.bench.serve import default_client_processes

    assert [default_client_processes(c) for c in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
