"""The server-sent events of one stream, with the common chunk rendered without ``json.dumps``.

Every chunk of a stream repeats its id, object, created time and model; a chunk in the middle of
a stream that carries only text (no logprobs, no finish, no usage) differs from the next one in
its choice index and text alone. ``StreamChunks`` renders the shared head once per stream and
such a chunk as one string concatenation around the text's JSON (the C string encoder that
``json.dumps`` itself uses). Under load the server's process spends its time per chunk sent, and
``json.dumps`` of the chunk dict was about a tenth of it (a sampling profile of ``nanovllm serve``
under 256 streams). Any other chunk goes through ``sse`` as a dict. The two renderings are equal
byte for byte (tests/test_stream_chunks.py).
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring  # json.dumps(str, ensure_ascii=False)'s own encoder


class StreamChunks:
    __slots__ = ("head",)

    def __init__(self, request_id: str, object_: str, created: int, model: str):
        shared = json.dumps(
            {"id": request_id, "object": object_, "created": created, "model": model}, ensure_ascii=False
        )
        self.head = "data: " + shared[:-1] + ', "choices": [{"index": '  # the dict's "}" makes way for the choices

    def text(self, index: int, text: str) -> str:
        """A ``text_completion`` chunk of ``text`` for choice ``index``, not its last."""
        return (
            f'{self.head}{index:d}, "text": {encode_basestring(text)}, "logprobs": null, '
            '"finish_reason": null, "stop_reason": null}]}\n\n'
        )

    def content(self, index: int, text: str) -> str:
        """A ``chat.completion.chunk`` whose delta is ``text`` for choice ``index``, not its last."""
        return (
            f'{self.head}{index:d}, "delta": {{"content": {encode_basestring(text)}}}, "logprobs": null, '
            '"finish_reason": null, "stop_reason": null}]}\n\n'
        )
