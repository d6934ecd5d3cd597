"""The fast rendering of a stream's text chunks (entrypoints/openai/stream_chunks.py) equals the
dict rendering (``sse(json.dumps(chunk))``) byte for byte, whatever the text, id and model."""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii

from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.entrypoints.openai.serving_common import sse
from nanovllm.entrypoints.openai.stream_chunks import StreamChunks

texts = st.text(alphabet=st.characters(codec=None), max_size=40)  # any code point: quotes, controls, surrogates
names = st.text(max_size=20)


def completion_dict(rid, created, model, index, text) -> dict:
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_dict(rid, created, model, index, text) -> dict:
    choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None, "stop_reason": None}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def mismatches(render_text, render_content, cases) -> list:
    out = []
    for rid, created, model, index, text in cases:
        chunks = StreamChunks(rid, "text_completion", created, model)
        if render_text(chunks, index, text) != sse(completion_dict(rid, created, model, index, text)):
            out.append(("text", text))
        chunks = StreamChunks(rid, "chat.completion.chunk", created, model)
        if render_content(chunks, index, text) != sse(chat_dict(rid, created, model, index, text)):
            out.append(("content", text))
    return out


@settings(max_examples=300, deadline=None)
@given(names, st.integers(0, 2**40), names, st.integers(0, 1000), texts)
def test_fast_chunks_equal_the_dict_rendering(rid, created, model, index, text):
    assert mismatches(StreamChunks.text, StreamChunks.content, [(rid, created, model, index, text)]) == []


def test_each_chunk_is_one_sse_event_of_valid_json():
    chunks = StreamChunks("cmpl-1", "text_completion", 5, "m")
    event = chunks.text(2, 'a "quoted"\nline \u2028 é')
    assert event.startswith("data: ") and event.endswith("\n\n") and event.count("\n\n") == 1
    assert json.loads(event[len("data: ") :])["choices"][0]["text"] == 'a "quoted"\nline \u2028 é'


def test_negative_control_a_renderer_that_escapes_differently_is_caught():
    """The comparison above sees a fast path that encodes the text as ASCII escapes (valid JSON,
    but not the bytes json.dumps(ensure_ascii=False) sends) or drops the stop_reason field."""

    def ascii_text(chunks, index, text):
        return chunks.text(index, "").replace('"text": ""', f'"text": {encode_basestring_ascii(text)}')

    def no_stop_reason(chunks, index, text):
        return chunks.content(index, text).replace(', "stop_reason": null', "")

    cases = [("id", 1, "m", 0, "plain"), ("id", 1, "m", 0, "é")]
    assert mismatches(ascii_text, StreamChunks.content, cases) == [("text", "é")]  # ASCII text is equal
    assert [kind for kind, _ in mismatches(StreamChunks.text, no_stop_reason, cases)] == ["content", "content"]
