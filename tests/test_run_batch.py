"""`nanovllm run-batch`: a file of OpenAI batch requests answered offline as the server answers
them. Greedy answers equal offline ``LLM.chat`` / ``LLM.generate`` for the same requests, in the
input's order whatever order they finish in; a request the server would refuse gets the server's
error object (its status, the field named) while the others are answered; a bad input file stops
the run before the model loads, naming the line."""

from __future__ import annotations

import json
import os
import stat

import pytest

pytest.importorskip("pydantic", reason="the serve extra (pydantic) is not installed")

from conformance.zoo import zoo_model  # noqa: E402
from nanovllm import SamplingParams  # noqa: E402
from nanovllm.entrypoints.cli import main  # noqa: E402
from tests.chat_templates import TURN_ENDS  # noqa: E402
from tests.conftest import cached_llm  # noqa: E402

MODEL = "qwen3-gqa2-hd64-tied"
FLAGS = ["--block-size", "16", "--max-model-len", "256", "--no-progress"]


def line(custom_id: str, url: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def run(tmp_path, lines: list[str], *flags: str) -> tuple[int, list[dict]]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    status = main(["run-batch", "-i", str(src), "-o", str(out), "--model", zoo_model(MODEL), *FLAGS, *flags])
    text = out.read_text(encoding="utf-8") if out.exists() else ""
    return status, [json.loads(x) for x in text.split("\n") if x]  # not splitlines(): U+2028 is JSON text


def test_answers_equal_the_offline_engines_in_the_inputs_order(tmp_path):
    offline = cached_llm(zoo_model(MODEL), block_size=16, seed=0, max_model_len=256)
    convs = [[{"role": "user", "content": f"w{10 + i} w{20 + i}"}] for i in range(3)]
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
    # long requests first: they finish last, so the output's order is the input's, not the finish order
    lengths = [12, 3, 7]
    lines = [
        line(f"chat-{i}", "/v1/chat/completions", messages=c, max_tokens=lengths[i], temperature=0)
        for i, c in enumerate(convs)
    ]
    lines += [
        line(f"text-{i}", "/v1/completions", prompt=p, max_tokens=5, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    lines.insert(2, line("bad-temperature", "/v1/completions", prompt=[5], temperature=-1))
    lines.insert(4, line("bad-type", "/v1/chat/completions", messages=[{"role": "user", "content": 3}]))
    lines.append(line("streamed", "/v1/completions", prompt=[5], stream=True))
    status, results = run(tmp_path, ["", *lines, "  "])  # blank lines are skipped
    assert status == 0
    assert [r["custom_id"] for r in results] == [json.loads(x)["custom_id"] for x in lines]
    by_id = {r["custom_id"]: r for r in results}
    for i, conv in enumerate(convs):
        want = offline.chat(conv, SamplingParams(temperature=0, max_tokens=lengths[i]), use_tqdm=False)[0]
        r = by_id[f"chat-{i}"]
        assert r["error"] is None and r["response"]["status_code"] == 200
        choice = r["response"]["body"]["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": want.outputs[0].text}
        assert r["response"]["body"]["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    texts = offline.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    for i, want in enumerate(texts):
        assert by_id[f"text-{i}"]["response"]["body"]["choices"][0]["text"] == want.outputs[0].text
    for custom_id, param in (
        ("bad-temperature", "temperature"),
        ("bad-type", "messages[0].content"),
        ("streamed", "stream"),
    ):
        r = by_id[custom_id]
        assert r["response"]["status_code"] == 400 and r["error"]["error"]["param"] == param, r
        assert r["response"]["body"] == r["error"]  # OpenAI's place and vLLM's
    assert len({r["id"] for r in results}) == len(results)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out.jsonl").stat().st_mode) == 0o666 & ~umask  # a plain file's mode


def test_a_value_json_cannot_hold_makes_a_500_line():
    from nanovllm.entrypoints.openai.run_batch import result_line

    bad = json.loads(result_line("x", 200, {"logprob": float("-inf")}, None))
    assert bad["custom_id"] == "x" and bad["response"]["status_code"] == 500
    assert bad["error"]["error"]["type"] == "server_error" and "not valid JSON" in bad["error"]["error"]["message"]
    assert json.loads(result_line("y", 200, {"logprob": -1.5}, None))["response"]["status_code"] == 200  # the control


def test_the_chat_template_and_sampling_defaults_apply_as_in_serve(tmp_path):
    """--chat-template renders the chat prompts; --override-generation-config is the default for a
    field a request leaves out (greedy here: the two requests give the same text)."""
    conv = [{"role": "user", "content": "w10 w20"}]
    lines = [line(f"c{i}", "/v1/chat/completions", messages=conv, max_tokens=6, seed=i) for i in range(2)]
    status, results = run(
        tmp_path, lines, "--chat-template", TURN_ENDS, "--override-generation-config", '{"temperature": 0}'
    )
    assert status == 0
    offline = cached_llm(zoo_model(MODEL), block_size=16, seed=0, max_model_len=256)
    want_ids = offline.chat_prompts(conv, chat_template=TURN_ENDS)[0]["prompt_token_ids"]
    assert want_ids != offline.chat_prompts(conv)[0]["prompt_token_ids"]  # the control: the zoo's own differs
    assert [r["response"]["body"]["usage"]["prompt_tokens"] for r in results] == [len(want_ids)] * 2
    texts = [r["response"]["body"]["choices"][0]["message"]["content"] for r in results]
    assert texts[0] == texts[1]
    # the control: without the override the model's own default samples, and the two seeds differ
    status, results = run(tmp_path, lines)
    texts = [r["response"]["body"]["choices"][0]["message"]["content"] for r in results]
    assert status == 0 and texts[0] != texts[1]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "line 2: not JSON"),
        ('["a list"]', "line 2: a request is a JSON object, got list"),
        ('{"custom_id": "x", "method": "POST", "url": "/v1/completions"}', "line 2: no 'body'"),
        (line("a", "/v1/completions", prompt=[5]), "line 2: custom_id 'a' repeats line 1's"),
        (
            '{"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}',
            "line 2: method must be 'POST', got 'GET'",
        ),
        (line("b", "/v1/embeddings", input="x"), "line 2: url must be one of /v1/chat/completions, /v1/completions"),
        (
            '{"custom_id": "", "method": "POST", "url": "/v1/completions", "body": {}}',
            "line 2: custom_id must be a non-empty string",
        ),
    ],
)
def test_a_bad_input_file_stops_before_the_model_loads(bad, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOVLLM_NO_DEFAULT_MODEL", "1")  # a load would fail on the model instead
    src = tmp_path / "in.jsonl"
    src.write_text(line("a", "/v1/completions", prompt=[5]) + "\n" + bad + "\n", encoding="utf-8")
    assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert message in err and "in.jsonl" in err, err
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_files_and_folders_are_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOVLLM_NO_DEFAULT_MODEL", "1")
    assert main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "none.jsonl': cannot read it" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    assert main(["run-batch", "-i", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "no requests in it" in capsys.readouterr().err
    (tmp_path / "in.jsonl").write_text(line("a", "/v1/completions", prompt=[5]) + "\n", encoding="utf-8")
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "no" / "o.jsonl")]) == 2
    assert "its folder" in capsys.readouterr().err


def test_one_requests_fault_is_its_own_line_and_the_rest_are_answered(tmp_path, monkeypatch):
    """An error the handlers do not expect (not a request error) in one request: that line is a
    500 naming it, every other request is answered (it had ended the whole run, writing nothing)."""
    from nanovllm.entrypoints.openai import serving_completion

    real = serving_completion.create_completion

    async def flaky(engine, req, *args, **kwargs):
        if req.prompt == [99]:
            raise RuntimeError("a fault in the handler")
        return await real(engine, req, *args, **kwargs)

    monkeypatch.setattr(serving_completion, "create_completion", flaky)
    lines = [
        line(f"r{i}", "/v1/completions", prompt=p, max_tokens=3, temperature=0)
        for i, p in enumerate([[5, 6], [99], [7, 8]])
    ]
    # a line separator inside a string is JSON, not the end of a line; n=2 gives two choices
    body = {"messages": [{"role": "user", "content": "w10\u2028w20\u0085"}], "max_tokens": 2, "n": 2}
    raw = {"custom_id": "sep", "method": "POST", "url": "/v1/chat/completions", "body": body}
    lines.append(json.dumps(raw, ensure_ascii=False))  # the separators unescaped, as JSON allows
    assert "\u2028" in lines[-1]
    status, results = run(tmp_path, lines)
    assert status == 0 and [r["custom_id"] for r in results] == ["r0", "r1", "r2", "sep"]
    assert (
        results[1]["response"]["status_code"] == 500
        and "a fault in the handler" in results[1]["error"]["error"]["message"]
    )
    assert all(results[i]["response"]["status_code"] == 200 for i in (0, 2, 3))
    assert len(results[3]["response"]["body"]["choices"]) == 2


def test_an_output_path_that_cannot_be_written_stops_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NANOVLLM_NO_DEFAULT_MODEL", "1")  # a load would fail on the model instead
    (tmp_path / "in.jsonl").write_text(line("a", "/v1/completions", prompt=[5]) + "\n", encoding="utf-8")
    folder = tmp_path / "results"
    folder.mkdir()
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(folder)]) == 2
    assert "is a folder: name a file" in capsys.readouterr().err
    assert list(folder.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "results"]
