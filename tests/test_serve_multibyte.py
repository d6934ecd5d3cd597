"""`nanovllm serve` on the default model (SmolLM2's byte-level BPE): text with emoji and CJK
characters, which span several tokens, streams as whole characters and adds up to the
non-streamed text and to offline generate's."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the serve extra (openai) is not installed")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.bench.server_process import nanovllm_serve_command, server  # noqa: E402

# greedy continuations of these are emoji / CJK; the second is cut inside a character at 24 tokens
PROMPTS = ["Emoji list: 😀 😃 😄 😁 😆 😅 😂 🤣 😊 😇", "世界和平。世界和平。世界和平。世界和平。"]


@pytest.fixture(scope="module")
def client(smollm_path):
    cmd = nanovllm_serve_command(None, "--max-model-len", "512", "--num-kvcache-blocks", "64",
                                 "--uvicorn-log-level", "warning")
    with server(cmd, ready_timeout=300) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_multi_byte_text_streams_whole_characters(client, smollm, prompt):
    want = smollm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    tok = smollm.get_tokenizer()
    split = [t for t in want.token_ids if "\ufffd" in tok.decode([t])]
    assert split and any(ord(c) > 0x2E80 for c in want.text), "no multi-byte character split over tokens"
    full = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24, temperature=0)
    pieces = [c.choices[0].text for c in client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == full.choices[0].text == want.text
    # only the last piece may end in a character the length limit cut (as the full text does)
    assert not any("\ufffd" in p for p in pieces[:-1]), pieces
    assert sum(1 for p in pieces if p) < len(want.token_ids), "no token was held back"
