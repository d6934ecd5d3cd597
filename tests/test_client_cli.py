"""`nanovllm chat` and `nanovllm complete` against a real server (the zoo model, greedy by the
server's default): a quick message's streamed answer is the offline engine's; an interactive chat
keeps the conversation (the second answer is the offline answer to the whole history, which
differs from the answer to the last message alone); a prompt completes as ``LLM.generate`` does;
no server, a bad key or a bad flag is an error naming it."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("openai", reason="the serve extra (openai) is not installed")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")

from conformance.zoo import zoo_model  # noqa: E402
from nanovllm import SamplingParams  # noqa: E402
from nanovllm.bench.server_process import free_port, nanovllm_serve_command, server  # noqa: E402
from nanovllm.entrypoints.cli import main  # noqa: E402
from tests.conftest import cached_llm, zoo_serve_flags  # noqa: E402

MODEL = "qwen3-gqa2-hd64-tied"
KEY = "client-key"
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def url():
    cmd = nanovllm_serve_command(
        zoo_model(MODEL),
        *zoo_serve_flags(256),
        "--api-key",
        KEY,
        "--override-generation-config",
        '{"temperature": 0}',
        "--uvicorn-log-level",
        "warning",
    )
    with server(cmd, env={"OMP_NUM_THREADS": "1"}, ready_timeout=180) as base:
        yield f"{base}/v1"


@pytest.fixture(scope="module")
def offline():
    return cached_llm(zoo_model(MODEL), block_size=16, seed=0, max_model_len=256)


def run(argv: list[str], capsys, monkeypatch, stdin: str = "") -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    status = main(argv)
    out = capsys.readouterr()
    return status, out.out, out.err


def test_a_quick_chat_message_gets_the_offline_answer(url, offline, capsys, monkeypatch):
    status, out, err = run(
        ["chat", "--url", url, "--api-key", KEY, "--max-tokens", "6", "-q", "w10 w20"], capsys, monkeypatch
    )
    want = offline.chat([{"role": "user", "content": "w10 w20"}], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert status == 0 and out == want + "\n" and "Using model: zoo" in err, (out, err)


def test_an_interactive_chat_keeps_the_conversation(url, offline, capsys, monkeypatch):
    monkeypatch.setenv("NANOVLLM_API_KEY", KEY)  # the key from the environment
    argv = ["chat", "--url", url, "--max-tokens", "6", "--system-prompt", "w5"]
    status, out, _ = run(argv, capsys, monkeypatch, stdin="w10 w20\nw30 w40\n")
    conv = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w10 w20"}]
    first = offline.chat(conv, GREEDY, use_tqdm=False)[0].outputs[0].text
    conv += [{"role": "assistant", "content": first}, {"role": "user", "content": "w30 w40"}]
    second = offline.chat(conv, GREEDY, use_tqdm=False)[0].outputs[0].text
    alone = offline.chat(conv[:1] + conv[-1:], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert second != alone  # the control: the history changes the answer
    assert status == 0 and out == f"> {first}\n> {second}\n> ", out


def test_complete_gets_the_offline_completion(url, offline, capsys, monkeypatch):
    status, out, _ = run(
        ["complete", "--url", url, "--api-key", KEY, "--max-tokens", "6"], capsys, monkeypatch, stdin="w10 w20\n"
    )
    want = offline.generate(["w10 w20"], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert status == 0 and out == f"> {want}\n> ", out


def test_errors_name_the_url_the_refusal_or_the_flag(url, capsys, monkeypatch):
    monkeypatch.delenv("NANOVLLM_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    nowhere = f"http://127.0.0.1:{free_port()}/v1"
    status, _, err = run(["chat", "--url", nowhere, "-q", "hi"], capsys, monkeypatch)
    assert status == 2 and f"cannot reach a server at --url {nowhere}" in err
    status, _, err = run(["complete", "--url", url, "-q", "hi"], capsys, monkeypatch)  # no key
    assert status == 2 and "refused /models: 401" in err, err
    status, _, err = run(
        ["chat", "--url", url, "--api-key", KEY, "--model-name", "other", "-q", "hi"], capsys, monkeypatch
    )
    assert status == 2 and "the server refused the request: 404" in err, err
    status, _, err = run(["chat", "--url", url, "--max-tokens", "0", "-q", "hi"], capsys, monkeypatch)
    assert status == 2 and "--max-tokens must be >= 1, got 0" in err


def test_a_refused_turn_leaves_the_conversation_going(url, offline, capsys, monkeypatch):
    """A message the server refuses (too long for the model) is reported and left out of the
    history; the next one is answered as if it had never been sent."""
    long = " ".join(["w7"] * 300)  # over max_model_len 256
    status, out, err = run(
        ["chat", "--url", url, "--api-key", KEY, "--max-tokens", "6"], capsys, monkeypatch, stdin=f"{long}\nw10 w20\n"
    )
    want = offline.chat([{"role": "user", "content": "w10 w20"}], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert status == 0 and "nanovllm chat: the server refused the request: 400" in err, err
    assert out.endswith(f"> {want}\n> "), out
