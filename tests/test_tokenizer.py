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


# ---------------------------------------------------------------- template environment features
UNICODE_CONVERSATION = [
    {"role": "system", "content": "Réponds en français."},
    {"role": "user", "content": 'é 🌍 中文 "quoted" <tag> & \\ back'},
    {"role": "assistant", "content": "ñ ü ß"},
]
# one tiny template per feature of transformers' chat-template environment
FEATURES = {
    "tojson-string": "{% for m in messages %}{{ m['content'] | tojson }}\n{% endfor %}",
    "tojson-dict": "{{ messages | tojson }}",
    "tojson-indent": "{{ messages[1] | tojson(indent=2) }}",
    "tojson-sort-keys": "{{ {'z': messages[1].content, 'a': 1} | tojson(sort_keys=True) }}",
    "tojson-separators": "{{ messages[0] | tojson(separators=(',', ':')) }}",
    "loop-controls": (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{{ m.content }}{% if m.role == 'user' %}{% break %}{% endif %}{% endfor %}"
    ),
    "trim-and-lstrip-blocks": "{% for m in messages %}\n    {% if m.role %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}",
    "special-token-variables": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
    "strftime-now": "{{ strftime_now('%Y') }} {{ messages[0].content }}",
    "generation": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "generation-left-trim": "{% for m in messages %}{%- generation %}{{ m.content }}{%- endgeneration %}{% endfor %}",
    "generation-right-trim": "{% for m in messages %}{% generation -%} {{ m.content }} {% endgeneration -%}{% endfor %}",
    "generation-both-trim": "{% for m in messages %}{%- generation -%} {{ m.content }} {%- endgeneration -%}{% endfor %}",
}


@pytest.fixture(scope="module")
def zoo_dir():
    return zoo_model("qwen3-gqa2-hd64-tied")


@pytest.fixture(scope="module")
def hf_tokenizer(zoo_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(zoo_dir)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("gen", [False, True])
def test_template_environment_features_match_transformers(feature, gen, zoo_dir, hf_tokenizer):
    """Each feature of transformers' chat-template environment (tojson and its arguments, loop
    controls, trim/lstrip blocks, the special-token variables, strftime_now, transformers' own
    generation tag in each whitespace-control spelling), one template each, rendered on non-ASCII
    content: ours gives transformers' text and ids. Guards against the class "the environment's
    custom pieces are compared only through templates that do not use them" (a tojson escaping
    non-ASCII, a generation tag spelling not routed to transformers). The templates without a
    generation tag are rendered by ours (transformers' tokenizer is never loaded)."""
    ours = load_tokenizer(zoo_dir)
    assert isinstance(ours, FastTokenizer)
    template = FEATURES[feature]
    args = dict(chat_template=template, add_generation_prompt=gen)
    want = hf_tokenizer.apply_chat_template(UNICODE_CONVERSATION, tokenize=False, **args)
    assert ours.apply_chat_template(UNICODE_CONVERSATION, tokenize=False, **args) == want
    ids = ours.apply_chat_template(UNICODE_CONVERSATION, tokenize=True, return_dict=False, **args)
    assert ids == list(hf_tokenizer.apply_chat_template(UNICODE_CONVERSATION, tokenize=True, return_dict=False, **args))
    if "generation" not in feature:
        assert "hf" not in vars(ours), "rendered by transformers, not by our environment"
        if feature.startswith("tojson") or feature == "loop-controls":
            assert "é" in want or "ñ" in want or "🌍" in want, "the template did not write the non-ASCII text"


def test_raise_exception_matches_transformers(zoo_dir, hf_tokenizer):
    """raise_exception() in a template is a jinja2 TemplateError with the message, as in
    transformers; a template that does not reach it renders."""
    import jinja2

    template = "{% if messages[0].role != 'user' %}{{ raise_exception('é: first must be user') }}{% endif %}ok"
    ours = load_tokenizer(zoo_dir)
    for conv, raises in ((UNICODE_CONVERSATION, True), (UNICODE_CONVERSATION[1:], False)):
        if raises:
            with pytest.raises(jinja2.TemplateError, match="é: first must be user"):
                hf_tokenizer.apply_chat_template(conv, chat_template=template, tokenize=False)
            with pytest.raises(jinja2.TemplateError, match="é: first must be user"):
                ours.apply_chat_template(conv, chat_template=template, tokenize=False)
        else:
            assert ours.apply_chat_template(conv, chat_template=template, tokenize=False) == "ok"
            assert hf_tokenizer.apply_chat_template(conv, chat_template=template, tokenize=False) == "ok"


def test_the_feature_comparison_sees_an_ascii_tojson(zoo_dir, hf_tokenizer, monkeypatch):
    """Negative control: a tojson that escapes non-ASCII (json.dumps' default) renders the
    tojson-string template differently from transformers, so the comparison above would fail."""
    real = json.dumps
    monkeypatch.setattr(
        fast_module,
        "json",
        type(
            "J",
            (),
            {"dumps": staticmethod(lambda x, **kw: real(x, **{**kw, "ensure_ascii": True})), "loads": json.loads},
        ),
    )
    template = FEATURES["tojson-string"]
    got = fast_module.compile_chat_template(template).render(messages=UNICODE_CONVERSATION)
    assert got != hf_tokenizer.apply_chat_template(UNICODE_CONVERSATION, chat_template=template, tokenize=False)
    assert "\\u00e9" in got


def test_generation_tag_predicate_takes_each_spelling_only():
    """transformers' {% generation %} tag, in every whitespace-control spelling, routes a template
    to transformers (ours cannot compile it); a template that merely prints the word stays ours."""
    for spelling in (
        "{% generation %}",
        "{%- generation %}",
        "{% generation -%}",
        "{%- generation -%}",
        "{%generation%}",
    ):
        assert fast_module._GENERATION_TAG.search(f"x{spelling}y{{% endgeneration %}}"), spelling
    for text in ("{{ 'generation' }}", "generation", "{% if generation %}{% endif %}"):
        assert not fast_module._GENERATION_TAG.search(text), text


# ---------------------------------------------------------------- tokenizer_config.json variants
def _added_token(content: str) -> dict:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def _dir_with_added_token_dicts(src, dest, tokens: dict[str, str]):
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg.update({name: _added_token(text) for name, text in tokens.items()})
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def test_added_token_dicts_match_transformers(tmp_path, zoo_dir):
    """tokenizer_config.json files written by transformers 4.x store special tokens as AddedToken
    dicts: ours reads their content as transformers does (the tokens, their ids, the special-tokens
    map, a template printing bos_token/eos_token). Guards against the class "a config-file format
    variant missing from the comparison corpus" (the corpus is saved by the installed transformers
    as plain strings). Negative control: a dict naming another token moves the id."""
    from transformers import AutoTokenizer

    d = _dir_with_added_token_dicts(
        zoo_dir, tmp_path / "tok", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    )
    ours, hf = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    assert isinstance(ours, FastTokenizer)
    for name in ("bos_token", "eos_token", "pad_token"):
        assert getattr(ours, name) == getattr(hf, name) and getattr(ours, name) is not None, name
        assert getattr(ours, f"{name}_id") == getattr(hf, f"{name}_id") is not None, name
        assert ours.special_tokens_map[name] == str(hf.special_tokens_map[name]), name
    template = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
    conv = UNICODE_CONVERSATION[1:2]
    want = hf.apply_chat_template(conv, chat_template=template, tokenize=False)
    assert ours.apply_chat_template(conv, chat_template=template, tokenize=False) == want
    assert want.startswith("<bos>") and want.endswith("<eos>")

    other = load_tokenizer(_dir_with_added_token_dicts(zoo_dir, tmp_path / "other", {"bos_token": "<pad>"}))
    assert other.bos_token == "<pad>" and other.bos_token_id != ours.bos_token_id
