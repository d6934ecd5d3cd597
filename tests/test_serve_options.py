"""`nanovllm serve` takes the sampling options the engine has offline: ``n`` (choice ``i * n + j``
= prompt i, completion j, streamed too), ``best_of`` (= n only), ``logit_bias`` (OpenAI's string
keys, clamped into [-100, 100]), presence / frequency / repetition penalties, ``bad_words``,
``allowed_token_ids`` and ``return_tokens_as_token_ids``. Each request, through the official
``openai`` client against a server subprocess (a tiny zoo model), gives what offline
``LLM.generate`` gives with the same SamplingParams, token for token; /metrics counts every
choice; bad values get a 400 naming the field and the server keeps serving.
"""

from __future__ import annotations

import json
import logging
import re

import pytest

httpx = pytest.importorskip("httpx", reason="the serve extra (httpx) is not installed")
openai = pytest.importorskip("openai", reason="the serve extra (openai) is not installed")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")

from conformance.zoo import EOS_ID, ZOO, zoo_model  # noqa: E402
from nanovllm import SamplingParams  # noqa: E402
from nanovllm.bench.server_process import nanovllm_serve_command, server  # noqa: E402
from tests.conftest import cached_llm, prompts_for, zoo_serve_flags  # noqa: E402

MODEL = "qwen3-gqa2-hd64-tied"
MAX_MODEL_LEN = 256
VOCAB = ZOO[MODEL].vocab_size
IDS = {"logprobs": 0, "return_tokens_as_token_ids": True}  # the output's token ids come back as token_id:N


@pytest.fixture(scope="module")
def url():
    cmd = nanovllm_serve_command(
        zoo_model(MODEL),
        *zoo_serve_flags(MAX_MODEL_LEN),
        "--uvicorn-log-level",
        "warning",
    )
    with server(cmd, env={"OMP_NUM_THREADS": "1"}, ready_timeout=180) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline():
    return cached_llm(zoo_model(MODEL), block_size=16, seed=0, max_model_len=MAX_MODEL_LEN)


def ids_of(choice) -> list[int]:
    """A completion choice's token ids (asked with return_tokens_as_token_ids)."""
    return [int(re.fullmatch(r"token_id:(\d+)", t).group(1)) for t in choice.logprobs.tokens]


def streamed_ids(chunks, num_choices: int) -> list[list[int]]:
    ids = [[] for _ in range(num_choices)]
    for c in chunks:
        for ch in c.choices:
            if ch.logprobs is not None:
                ids[ch.index] += [int(t.split(":")[1]) for t in ch.logprobs.tokens]
    return ids


def metrics(url) -> dict[str, float]:
    """Prometheus counters summed over their labels."""
    out: dict[str, float] = {}
    for name, value in re.findall(
        r"^(nanovllm:\w+?)(?:\{[^}]*\})? (\S+)$", httpx.get(f"{url}/metrics").text, re.MULTILINE
    ):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def offline_ids(offline, prompt, **params) -> list[list[int]]:
    out = offline.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    return [c.token_ids for c in sorted(out.outputs, key=lambda c: c.index)]


def test_greedy_n_choices_equal_offline_streamed_or_not_and_metrics_count_them(url, client, offline):
    """Two prompts x n=2, greedy: choice 2i+j is prompt i's offline greedy output (both j); the
    stream gives the same per index; usage counts each prompt once and every choice's tokens;
    /metrics counts 4 finished requests and all their tokens per response."""
    prompts = prompts_for(VOCAB, (7, 12), seed=11)
    want = [offline_ids(offline, p, temperature=0, max_tokens=6, ignore_eos=True)[0] for p in prompts]
    assert want[0] != want[1], "the two prompts give the same output: the indexing is not tested"
    for stream in (False, True):
        before = metrics(url)
        r = client.completions.create(
            model="zoo",
            prompt=prompts,
            n=2,
            max_tokens=6,
            temperature=0,
            stream=stream,
            stream_options={"include_usage": True} if stream else None,
            extra_body={"ignore_eos": True, **IDS},
        )
        if stream:
            chunks = list(r)
            got, use = streamed_ids(chunks, 4), chunks[-1].usage
            # at least a chunk per choice and the usage chunk: a client that falls behind gets what
            # queued up as one chunk (AsyncLLM.generate), so on a loaded machine each choice's six
            # tokens may come in one piece; the pieces per index are checked below
            assert chunks[-1].choices == [] and len(chunks) >= 5
        else:
            assert [c.index for c in r.choices] == [0, 1, 2, 3]
            got, use = [ids_of(c) for c in r.choices], r.usage
        assert got == [want[0], want[0], want[1], want[1]], stream
        assert use.prompt_tokens == 7 + 12 and use.completion_tokens == 4 * 6
        after = metrics(url)
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        assert delta["nanovllm:generation_tokens_total"] == 24, stream
        assert delta["nanovllm:request_success_total"] == 4, stream
        assert delta["nanovllm:e2e_request_latency_seconds_count"] == 4, stream
        assert delta["nanovllm:time_to_first_token_seconds_count"] == 4, stream
        assert delta["nanovllm:inter_token_latency_seconds_count"] == 4 * 5, stream
        assert delta["nanovllm:prompt_tokens_total"] == 2 * (7 + 12), stream  # per engine request, as vLLM


def test_seeded_n_equals_offline_seeded_n(client, offline):
    """Seeded n=3 sampling = offline n=3 with the seed (completion j draws with seed + j), on
    both routes, streamed and not; the choices differ from each other (one seed for all would
    give equal choices)."""
    prompt = prompts_for(VOCAB, (9,), seed=12)[0]
    want = offline_ids(offline, prompt, temperature=1.0, seed=77, n=3, max_tokens=8, ignore_eos=True)
    assert len({tuple(w) for w in want}) == 3
    for stream in (False, True):
        r = client.completions.create(
            model="zoo",
            prompt=prompt,
            n=3,
            max_tokens=8,
            temperature=1.0,
            seed=77,
            stream=stream,
            extra_body={"ignore_eos": True, **IDS},
        )
        got = streamed_ids(r, 3) if stream else [ids_of(c) for c in r.choices]
        assert got == want, stream

    conv = [{"role": "user", "content": "w10 w20 w30"}]
    want = [
        c.text
        for c in sorted(
            offline.chat(
                conv, SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=8, ignore_eos=True), use_tqdm=False
            )[0].outputs,
            key=lambda c: c.index,
        )
    ]
    r = client.chat.completions.create(
        model="zoo", messages=conv, n=2, max_tokens=8, temperature=1.0, seed=5, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 16
    chunks = list(
        client.chat.completions.create(
            model="zoo",
            messages=conv,
            n=2,
            max_tokens=8,
            temperature=1.0,
            seed=5,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = ["", ""]
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert sorted(roles) == [0, 1]
    assert [c.message.content for c in r.choices] == streamed == want and want[0] != want[1]


def _sse(url: str, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/{route}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]


def _choice_text(route: str, choice: dict) -> str:
    """A choice's text: whole (``text`` / ``message.content``) or a chunk's piece (``delta.content``)."""
    if route == "completions":
        return choice["text"]
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_stream_ends_each_choice_as_the_non_streamed_answer_does(url, route):
    """n=2 with include_usage, ending by length (ignore_eos, max_tokens=5) and on EOS (greedy with
    the EOS id biased by +100, so the first token is EOS and its text is empty): in the stream each
    choice index carries exactly one non-null finish_reason, the non-streamed answer's; its pieces
    join to the non-streamed text; the usage chunk equals the non-streamed usage (completion tokens
    summed over the choices). A stream that drops an empty-text final chunk (an EOS ending) or that
    counts one choice's tokens in the usage differs from the plain answer."""
    head = (
        {"prompt": prompts_for(VOCAB, (7,), seed=21)[0]}
        if route == "completions"
        else {"messages": [{"role": "user", "content": "w10 w20 w30"}]}
    )
    endings = {
        "length": {"max_tokens": 5, "ignore_eos": True},
        "stop": {"max_tokens": 5, "logit_bias": {str(EOS_ID): 100}},
    }
    for ending, fields in endings.items():
        body = {"model": "zoo", "n": 2, "temperature": 0, **head, **fields}
        whole = httpx.post(f"{url}/v1/{route}", json=body, timeout=60)
        assert whole.status_code == 200, whole.text
        whole = whole.json()
        want = sorted(whole["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in want] == [0, 1] and {c["finish_reason"] for c in want} == {ending}, want
        if ending == "stop":  # the EOS is the only token: the final chunk has no text
            assert [_choice_text(route, c) for c in want] == ["", ""] and whole["usage"]["completion_tokens"] == 2
        chunks = _sse(url, route, {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"], (ending, chunks[-1])
        for c in want:
            mine = [ch for chunk in chunks[:-1] for ch in chunk["choices"] if ch["index"] == c["index"]]
            finished = [ch["finish_reason"] for ch in mine if ch["finish_reason"] is not None]
            assert finished == [c["finish_reason"]], (ending, c["index"], [ch["finish_reason"] for ch in mine])
            assert "".join(_choice_text(route, ch) for ch in mine) == _choice_text(route, c), (ending, c["index"])


def test_logit_bias_forces_a_token_and_equals_offline(client, offline):
    prompt = prompts_for(VOCAB, (8,), seed=13)[0]
    plain = offline_ids(offline, prompt, temperature=0, max_tokens=5, ignore_eos=True)[0]
    forced = next(t for t in range(7, VOCAB) if t not in plain)
    r = client.completions.create(
        model="zoo",
        prompt=prompt,
        max_tokens=5,
        temperature=1.0,
        seed=3,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True, **IDS},
    )
    assert ids_of(r.choices[0]) == [forced] * 5
    # a bias past 100 is clamped to 100 (vLLM); a small one equals offline's
    r = client.completions.create(
        model="zoo",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logit_bias={str(forced): 250.0},
        extra_body={"ignore_eos": True, **IDS},
    )
    assert ids_of(r.choices[0]) == [forced] * 5
    bias = {plain[0]: -100.0, plain[1]: 3.0}
    want = offline_ids(offline, prompt, temperature=0, max_tokens=5, ignore_eos=True, logit_bias=bias)[0]
    assert want != plain
    r = client.completions.create(
        model="zoo",
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"ignore_eos": True, **IDS},
    )
    assert ids_of(r.choices[0]) == want


def test_penalties_bad_words_allowed_token_ids_equal_offline(client, offline):
    """Each option equals offline generate with the same SamplingParams, and changes the
    output (so a server that dropped it would fail)."""
    prompt = prompts_for(VOCAB, (10,), seed=14)[0]
    base = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    plain = offline_ids(offline, prompt, **base)[0]
    tok = offline.get_tokenizer()
    allowed = sorted(set(prompt[:4]))
    cases = [
        {"temperature": 0.8, "seed": 9, "presence_penalty": 1.5, "frequency_penalty": 0.7},
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.3},
        {"bad_words": [tok.decode([plain[0]]).strip()]},
        {"allowed_token_ids": allowed},
    ]
    for extra in cases:
        want = offline_ids(offline, prompt, **{**base, **extra})[0]
        ref = offline_ids(
            offline, prompt, **{**base, **{k: v for k, v in extra.items() if k in ("temperature", "seed")}}
        )[0]
        assert want != ref, f"{extra} changes nothing here: not tested"
        fields = {
            k: extra.pop(k) for k in ("temperature", "seed", "presence_penalty", "frequency_penalty") if k in extra
        }
        r = client.completions.create(
            model="zoo",
            prompt=prompt,
            max_tokens=12,
            **{"temperature": 0, **fields},
            extra_body={"ignore_eos": True, **IDS, **extra},
        )
        assert ids_of(r.choices[0]) == want, (fields, extra)
        if "allowed_token_ids" in extra:
            assert set(want) <= set(allowed)
        if "bad_words" in extra:
            assert plain[0] not in want


BAD = [
    # (route, extra fields, param)
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": 129}, "n"),
    ("completions", {"n": "2"}, "n"),
    ("completions", {"n": 2, "best_of": 1}, "best_of"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logit_bias": {"w5": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": "big"}}, "logit_bias"),
    ("completions", {"logit_bias": [5]}, "logit_bias"),
    ("completions", {"logit_bias": {str(VOCAB + 5): 1}}, "logit_bias"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ("completions", {"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ("completions", {"bad_words": "w5"}, "bad_words"),
    ("completions", {"bad_words": [" "]}, "bad_words"),
    ("completions", {"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
    ("chat/completions", {"n": 0}, "n"),
    ("chat/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("chat/completions", {"presence_penalty": 9}, "presence_penalty"),
]


def test_bad_values_get_400_naming_the_field_and_the_server_keeps_serving(url, client):
    for route, fields, param in BAD:
        body = (
            {"prompt": "w5 w6", "max_tokens": 2}
            if route == "completions"
            else {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
        )
        r = httpx.post(f"{url}/v1/{route}", json={**body, **fields}, timeout=30)
        assert r.status_code == 400, (fields, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], (fields, err)
        assert err["type"] == "invalid_request_error" and "Traceback" not in r.text
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=30,
        headers={"Content-Type": "application/json"},
        content=b'{"prompt": "w5", "max_tokens": 2, "logit_bias": {"5": Infinity}}',
    )  # Python's JSON
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="zoo", prompt="w5", max_tokens=2, n=2, best_of=4)
    ok = client.completions.create(model="zoo", prompt="w10 w11", max_tokens=2, temperature=0, n=2)
    assert len(ok.choices) == 2 and all(c.finish_reason in ("length", "stop") for c in ok.choices)
    r = client.completions.create(model="zoo", prompt="w10 w11", max_tokens=2, n=2, best_of=2, temperature=0)
    assert len(r.choices) == 2


@pytest.mark.parametrize(
    "flags, expected", [([], True), (["--no-engine-process"], False), (["--engine-process"], True)]
)
def test_serve_passes_the_engine_process_choice_to_the_engine(monkeypatch, flags, expected):
    """`nanovllm serve [--no-engine-process]` reaches AsyncLLM.from_engine_args as engine_process
    (the engine core in its own process by default), and is not taken for an engine argument."""
    import asyncio

    import nanovllm.entrypoints.openai.api_server as api_server
    from nanovllm.entrypoints.cli import build_parser, engine_kwargs

    seen = {}

    class Stop(Exception):
        pass

    def from_engine_args(model, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(api_server.AsyncLLM, "from_engine_args", from_engine_args)
    args = build_parser().parse_args(["serve", zoo_model(MODEL), "--max-model-len", "64", *flags])
    args.model = args.model_tag
    with pytest.raises(Stop):
        asyncio.run(api_server.serve(args, engine_kwargs(args)))
    assert seen["engine_process"] is expected and seen["max_model_len"] == 64
    assert "process" not in engine_kwargs(args) and "core_process" not in engine_kwargs(args)


def test_unused_request_fields_and_unknown_roles_are_named_in_a_warning(caplog):
    """A user trial found fields the server does not know (a typo: "max_token") and unknown chat
    roles accepted silently. They are still accepted (clients send fields a server may not know, as
    with vLLM) but each is named in the server's log; a request of known fields and roles logs
    nothing (the control)."""
    from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    caplog.set_level(logging.WARNING, logger="nanovllm.entrypoints.openai.protocol")
    CompletionRequest.model_validate({"prompt": "w5", "max_tokens": 2, "stream_options": {"include_usage": True}})
    ChatCompletionRequest.model_validate({"messages": [{"role": "developer", "content": "w5", "name": "x"}]})
    assert caplog.records == []
    r = CompletionRequest.model_validate({"prompt": "w5", "max_token": 2, "stream_options": {"usage": True}})
    assert r.max_tokens is None  # not taken for max_tokens
    said = [rec.getMessage() for rec in caplog.records]
    assert any("CompletionRequest" in m and "'max_token'" in m for m in said), said
    assert any("StreamOptions" in m and "'usage'" in m for m in said), said
    caplog.clear()
    ChatCompletionRequest.model_validate({"messages": [{"role": "robot", "content": "w5"}], "foo": 1})
    said = [rec.getMessage() for rec in caplog.records]
    assert any("'robot'" in m for m in said) and any("'foo'" in m for m in said), said


def test_server_sampling_defaults_reach_requests_that_leave_the_fields_out(offline):
    """`--override-generation-config` (vLLM's flag): a request without temperature gets the
    server's (greedy: offline's greedy tokens), and max_new_tokens limits every request (3 tokens,
    also for one asking 5); a request's own temperature wins (seeded sampling, not greedy)."""
    cmd = nanovllm_serve_command(
        zoo_model(MODEL),
        *zoo_serve_flags(MAX_MODEL_LEN),
        "--override-generation-config",
        '{"temperature": 0, "max_new_tokens": 3}',
        "--uvicorn-log-level",
        "warning",
    )
    with server(cmd, env={"OMP_NUM_THREADS": "1"}, ready_timeout=180) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "w10 w11 w12", **IDS}, timeout=60).json()
        assert [ids_of_json(r["choices"][0])] == offline_ids(offline, "w10 w11 w12", temperature=0.0, max_tokens=3)
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "w10 w11", "max_tokens": 5, **IDS}, timeout=60).json()
        assert r["usage"]["completion_tokens"] <= 3, r
        body = {"prompt": "w10 w11 w12", "temperature": 1.0, "seed": 7, **IDS}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert [ids_of_json(r["choices"][0])] == offline_ids(
            offline, "w10 w11 w12", temperature=1.0, seed=7, max_tokens=3
        )


def ids_of_json(choice: dict) -> list[int]:
    return [int(re.fullmatch(r"token_id:(\d+)", t).group(1)) for t in choice["logprobs"]["tokens"]]


def test_a_bad_server_default_stops_serve_before_the_model_loads(capsys):
    from nanovllm.entrypoints import cli

    argv = ["serve", "--model", zoo_model(MODEL), "--override-generation-config", '{"temprature": 0.5}']
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--override-generation-config: unknown key(s) 'temprature'" in err, err
