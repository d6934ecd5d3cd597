"""`nanovllm serve` on the default model (SmolLM2's byte-level BPE): text with emoji and CJK
characters, which span several tokens, streams as whole characters and adds up to the
non-streamed text and to offline generate's."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai", reason="the serve extra (openai) is not installed")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.bench.server_process import nanovllm_serve_command, server  # noqa: E402

# greedy continuations of these are emoji / CJK; the second is cut inside a character at 24 tokens
PROMPTS = ["Emoji list: 😀 😃 😄 😁 😆 😅 😂 🤣 😊 😇", "世界和平。世界和平。世界和平。世界和平。"]


@pytest.fixture(scope="module")
def url(smollm_path):
    cmd = nanovllm_serve_command(
        None, "--max-model-len", "512", "--num-kvcache-blocks", "64", "--uvicorn-log-level", "warning"
    )
    with server(cmd, ready_timeout=300) as base:
        yield base


def test_multi_byte_text_streams_whole_characters(url, smollm):
    """Both prompts, streamed and not, as four concurrent requests (one batch: the test stays
    short); offline generate of both in one call."""
    want = [
        o.outputs[0] for o in smollm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    ]
    tok = smollm.get_tokenizer()
    for w in want:
        assert any("\ufffd" in tok.decode([t]) for t in w.token_ids) and any(ord(c) > 0x2E80 for c in w.text), (
            f"no multi-byte character split over tokens in {w.text!r}: nothing tested"
        )

    async def ask(client, prompt, stream):
        r = await client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24, temperature=0, stream=stream
        )
        if not stream:
            return r.choices[0].text
        return [c.choices[0].text async for c in r if c.choices]

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(ask(client, p, s) for p in PROMPTS for s in (False, True)))

    results = asyncio.run(main())
    for i, w in enumerate(want):
        full, pieces = results[2 * i], results[2 * i + 1]
        assert "".join(pieces) == full == w.text
        # only the last piece may end in a character the length limit cut (as the full text does)
        assert not any("\ufffd" in p for p in pieces[:-1]), pieces
        assert sum(1 for p in pieces if p) < len(w.token_ids), "no token was held back"
