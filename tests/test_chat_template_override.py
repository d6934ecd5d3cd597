"""A chat template given instead of the model's own, as vLLM takes it: ``serve --chat-template``
and ``generate --chat --chat-template`` (a file's path or the template's text), and
``LLM.chat(chat_template=...)``. The zoo's template ends no turn with a token; the one here ends
each turn with ``<eos>``, so the two render the same conversation differently (each test's control),
and ``continue_final_message`` shows through the server (an open turn has no ``<eos>`` after it).
The flag is checked before the model loads; a request cannot set the template itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conformance.zoo import zoo_model
from nanovllm.entrypoints.chat_template import load_chat_template
from nanovllm.tokenizer import load_tokenizer
from tests.chat_templates import CONV, TURN_ENDS

MODEL = "qwen3-gqa2-hd64-tied"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(zoo_model(MODEL))


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "turn_ends.jinja"
    path.write_text(TURN_ENDS, encoding="utf-8")
    return path


def test_the_flag_takes_a_path_or_the_text_and_names_itself_when_bad(template_file, tmp_path):
    assert load_chat_template(str(template_file)) == TURN_ENDS
    assert load_chat_template(TURN_ENDS) == TURN_ENDS
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match=r"--chat-template 'no/such/file.jinja': no such file"):
        load_chat_template("no/such/file.jinja")
    with pytest.raises(ValueError, match=r"--chat-template .*not a valid chat template \(jinja2\)"):
        load_chat_template("{% for m in messages %}{{ m }}")  # no endfor
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ messages[0] ", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jinja'.*not a valid chat template"):
        load_chat_template(str(bad))
    with pytest.raises(ValueError, match="--chat-template must be a file path or a template's text"):
        load_chat_template("  ")
    # braces alone do not make a template: a mistyped path is named, not served as the prompt's text
    with pytest.raises(ValueError, match=r"--chat-template 'tpl/\{name\}.jinja': no such file"):
        load_chat_template("tpl/{name}.jinja")


def test_the_tokenizer_renders_the_given_template_as_transformers_does(tokenizer):
    """The fast path (jinja2 here) and transformers' own give the same ids for the template given
    per call, with and without a generation prompt and with the last turn left open."""
    for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False}):
        got = tokenizer.apply_chat_template(CONV, return_dict=False, chat_template=TURN_ENDS, **kwargs)
        assert got == tokenizer.hf.apply_chat_template(CONV, return_dict=False, chat_template=TURN_ENDS, **kwargs)
        assert got != tokenizer.apply_chat_template(CONV, return_dict=False, **kwargs)  # the model's own differs
    assert TURN_ENDS in tokenizer._templates  # rendered here (jinja2), not by transformers' fallback
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    closed = tokenizer.apply_chat_template(CONV, return_dict=False, chat_template=TURN_ENDS)
    left_open = tokenizer.apply_chat_template(
        CONV, return_dict=False, chat_template=TURN_ENDS, continue_final_message=True
    )
    assert closed[-1] == eos and left_open == closed[:-1]


def test_llm_chat_takes_the_template_text(tokenizer, monkeypatch):
    from nanovllm import LLM

    llm = LLM.__new__(LLM)  # the prompts need only the tokenizer
    monkeypatch.setattr(llm, "get_tokenizer", lambda: tokenizer, raising=False)
    own = llm.chat_prompts(CONV, add_generation_prompt=False)[0]
    given = llm.chat_prompts(CONV, add_generation_prompt=False, chat_template=TURN_ENDS)[0]
    assert given["prompt_token_ids"] == tokenizer.apply_chat_template(CONV, return_dict=False, chat_template=TURN_ENDS)
    assert given["prompt"] == tokenizer.decode(given["prompt_token_ids"]) and given != own
    assert given["prompt_token_ids"][-1] == tokenizer.convert_tokens_to_ids("<eos>")
    for bad in (["not", "text"], " "):
        with pytest.raises(ValueError, match="chat_template must be a template's text"):
            llm.chat_prompts(CONV, chat_template=bad)


def test_generate_chat_uses_the_template_and_checks_the_flag_first(template_file, tokenizer):
    """`generate --chat --chat-template FILE`: the prompt is rendered with it (--json prints the
    prompt); the flag without --chat, or naming no file, fails before the model loads."""

    def generate(*flags: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "nanovllm", "generate", "--model", zoo_model(MODEL), "--max-tokens", "2"]
        cmd += ["--temperature", "0", "--ignore-eos", "--no-progress", "--json", "--max-model-len", "64", *flags]
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )

    asked = [{"role": "user", "content": "w10 w20"}]
    want = tokenizer.decode(
        tokenizer.apply_chat_template(asked, add_generation_prompt=True, return_dict=False, chat_template=TURN_ENDS)
    )
    ran = generate("--chat", "--chat-template", str(template_file), "w10 w20")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert json.loads(ran.stdout.splitlines()[0])["prompt"] == want
    own = generate("--chat", "w10 w20")
    assert own.returncode == 0 and json.loads(own.stdout.splitlines()[0])["prompt"] != want
    no_chat = generate("--chat-template", str(template_file), "w10 w20")
    assert no_chat.returncode == 2 and "--chat-template applies to chat prompts: add --chat" in no_chat.stderr
    missing = generate("--chat", "--chat-template", "missing.jinja", "w10 w20")
    assert missing.returncode == 2 and "--chat-template 'missing.jinja': no such file" in missing.stderr


def test_serve_uses_the_template_for_chat_and_tokenize(template_file, tokenizer):
    """The server's template through HTTP: /tokenize and the chat endpoint render with it (the last
    turn open with ``continue_final_message``, closed without: the gap the zoo's own template
    cannot show); a request's own template, directly or in chat_template_kwargs, is a 400 by name."""
    httpx = pytest.importorskip("httpx", reason="the serve extra (httpx) is not installed")
    pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
    from nanovllm.bench.server_process import nanovllm_serve_command, server
    from tests.conftest import zoo_serve_flags

    cmd = nanovllm_serve_command(
        zoo_model(MODEL), *zoo_serve_flags(256), "--chat-template", str(template_file), "--uvicorn-log-level", "warning"
    )
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    want = tokenizer.apply_chat_template(CONV, return_dict=False, chat_template=TURN_ENDS, add_generation_prompt=False)
    with server(cmd, env={"OMP_NUM_THREADS": "1"}, ready_timeout=180) as url:

        def post(path: str, **body) -> httpx.Response:
            return httpx.post(f"{url}{path}", json={"model": "zoo", **body}, timeout=60)

        closed = post("/tokenize", messages=CONV, add_generation_prompt=False).json()["tokens"]
        left_open = post("/tokenize", messages=CONV, add_generation_prompt=False, continue_final_message=True)
        assert closed == want and closed[-1] == eos
        assert left_open.json()["tokens"] == want[:-1]
        chat = {"messages": CONV, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "add_generation_prompt": False}
        r = post("/v1/chat/completions", **chat, continue_final_message=True)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want) - 1, r.text
        for extra, param in (
            ({"chat_template": "{{ 'x' }}"}, "chat_template"),
            ({"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs"),
        ):
            r = post("/v1/chat/completions", **chat, **extra)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            r = post("/tokenize", messages=CONV, add_generation_prompt=False, **extra)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        # null sets nothing (as in vLLM): the server's template still renders
        for unset in ({"chat_template": None}, {"chat_template_kwargs": {"chat_template": None}}):
            r = post("/tokenize", messages=CONV, add_generation_prompt=False, **unset)
            assert r.status_code == 200 and r.json()["tokens"] == want, r.text
            assert post("/v1/chat/completions", **chat, **unset).status_code == 200
        # /tokenize takes chat_template_kwargs as the chat endpoint does (they win over its flags)
        r = post(
            "/tokenize",
            messages=CONV,
            add_generation_prompt=False,
            chat_template_kwargs={"continue_final_message": True},
        )
        assert r.status_code == 200 and r.json()["tokens"] == want[:-1], r.text


def test_serve_checks_the_flag_before_the_model_loads(capsys, monkeypatch):
    pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
    from nanovllm.bench.server_process import free_port
    from nanovllm.entrypoints.cli import main

    monkeypatch.setenv("NANOVLLM_NO_DEFAULT_MODEL", "1")  # a load would fail on the model instead
    assert main(["serve", "--port", str(free_port()), "--chat-template", "missing.jinja"]) == 2
    assert "--chat-template 'missing.jinja': no such file" in capsys.readouterr().err
