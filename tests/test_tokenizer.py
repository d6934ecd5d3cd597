"""nanovllm/tokenizer.py gives transformers' results without importing it: the same ids, text and
chat-template output as AutoTokenizer on the default model and zoo models; directories it cannot
match take AutoTokenizer (negative controls: a changed template environment, a changed id)."""

from __future__ import annotations

import json
import shutil

import pytest

from conformance.zoo import zoo_model
from nanovllm import tokenizer as fast_module
from nanovllm.tokenizer import FastTokenizer, load_tokenizer

TEXTS = [
    "hi",
    "The capital of France is Paris.",
    "  two  spaces\nand a newline\t",
    "émojis 🌍 and 中文",
    "<|im_start|>user\nraw special tokens<|im_end|>",
    "w5 w17 <eos> w999 <|user|>",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 🌍"},
    ],
    [{"role": "user", "content": "w5 w17 w33"}, {"role": "assistant", "content": "w9", "tool_calls": None}],
]


@pytest.fixture(scope="module", params=["default", "qwen3-gqa2-hd64-tied", "qwen3-eps-rope-linear"])
def model_dir(request, smollm_path):
    from nanovllm.loader.model_loader import resolve_model_dir

    return resolve_model_dir(smollm_path if request.param == "default" else zoo_model(request.param))


@pytest.fixture(scope="module")
def pair(model_dir):
    from transformers import AutoTokenizer

    ours = load_tokenizer(model_dir)
    assert isinstance(ours, FastTokenizer)  # these directories take the fast path
    return ours, AutoTokenizer.from_pretrained(model_dir)


def test_encode_decode_match_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.eos_token_id == hf.eos_token_id and ours.bos_token_id == hf.bos_token_id
    assert ours.decode(ours.eos_token_id) == hf.decode(hf.eos_token_id)


def test_chat_template_matches_transformers(pair):
    ours, hf = pair
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert text == hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            ids = ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True, return_dict=False)
            assert ids == list(
                hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True, return_dict=False)
            )
    assert "<|" in text or "<" in text  # the template wrote its control tokens (not vacuous)


def test_the_comparison_catches_a_changed_environment(pair, monkeypatch):
    """Negative control: without trim_blocks / lstrip_blocks (transformers' settings) the rendered
    text of a template with block tags differs, and the comparison above would fail."""
    ours, hf = pair
    import jinja2.sandbox

    template = "{% for m in messages %}\n  {{ m['content'] }}\n{% endfor %}"
    conv = CONVERSATIONS[1]
    right = fast_module.compile_chat_template(template).render(messages=conv)
    monkeypatch.setattr(
        jinja2.sandbox,
        "ImmutableSandboxedEnvironment",
        lambda **kw: jinja2.sandbox.SandboxedEnvironment(extensions=kw["extensions"]),
    )
    wrong = fast_module.compile_chat_template(template).render(messages=conv)
    assert right == hf.apply_chat_template(conv, chat_template=template, tokenize=False)
    assert wrong != right


def test_what_it_does_not_implement_goes_to_transformers(pair):
    ours, hf = pair
    assert ours.convert_ids_to_tokens([5, 6]) == hf.convert_ids_to_tokens([5, 6])  # via __getattr__
    conv = CONVERSATIONS[0]
    assert (
        ours.apply_chat_template(conv, tokenize=True)["input_ids"]
        == hf.apply_chat_template(conv, tokenize=True)["input_ids"]
    )  # return_dict=True: transformers' path


def test_other_directories_take_autotokenizer(tmp_path, smollm_path):
    from nanovllm.loader.model_loader import resolve_model_dir

    d = tmp_path / "tok"
    shutil.copytree(resolve_model_dir(smollm_path), d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": True}))
    assert not isinstance(load_tokenizer(d), FastTokenizer)
