"""The engine's tokenizer without importing transformers (about a second of start-up).

``load_tokenizer(path)`` reads a ``tokenizers``-backed HF tokenizer directory itself --
tokenizer.json with the ``tokenizers`` library, tokenizer_config.json, and the chat template
(chat_template.jinja or the config's ``chat_template``) rendered with jinja2 in the environment
transformers uses -- when transformers would use that tokenizer.json as it is
(``tokenizer_class`` TokenizersBackend or PreTrainedTokenizerFast, no
``clean_up_tokenization_spaces``). Any other directory gets ``AutoTokenizer``.

``FastTokenizer`` implements what the engine calls (encode, decode, apply_chat_template for a
message list, the special tokens); everything else -- and apply_chat_template with tools,
documents, batches, ``return_dict=True`` and the like -- goes to transformers' tokenizer for the
same directory, loaded on first use. tests/test_tokenizer.py checks ids, text and chat-template
output against AutoTokenizer.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path

FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# apply_chat_template arguments transformers gives a meaning (not template variables): any of them
# set to a non-default value takes transformers' path
_HF_CHAT_ARGS = {
    "tools": None,
    "documents": None,
    "chat_template": None,
    "continue_final_message": False,
    "sanitize_control_tokens": False,
    "padding": False,
    "truncation": False,
    "max_length": None,
    "return_tensors": None,
    "tokenizer_kwargs": None,
    "return_assistant_tokens_mask": False,
}
MAX_COMPILED_TEMPLATES = 8  # per tokenizer: the model's own and the last few given per call
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers aliases these
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own jinja extension


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # an AddedToken as serialized ({"content": ..., ...})
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(path: Path, config: dict):
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    return config.get("chat_template")


def load_tokenizer(path: str | os.PathLike):
    """A FastTokenizer for ``path`` where it is byte-identical to transformers', else AutoTokenizer's."""
    p = Path(path)
    try:
        config = json.loads((p / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    if (
        isinstance(config, dict)
        and (p / "tokenizer.json").is_file()
        and config.get("tokenizer_class") in FAST_CLASSES
        and not config.get("clean_up_tokenization_spaces")
        and isinstance(_chat_template(p, config), (str, type(None)))
        and not any(config.get(k) is not None for k in ("add_bos_token", "add_eos_token"))
    ):
        return FastTokenizer(p, config)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


class FastTokenizer:
    """tokenizer.json through ``tokenizers``, with transformers' results (see the module docstring)."""

    def __init__(self, path: Path, config: dict):
        from tokenizers import Tokenizer

        self.name_or_path = str(path)
        self._config = config
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._tok.no_truncation()  # transformers turns both off unless a call asks for them
        self._tok.no_padding()
        self.chat_template = _chat_template(path, config)
        self.special_tokens_map = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None
        }
        for name in SPECIAL_TOKEN_NAMES:
            setattr(self, name, self.special_tokens_map.get(name))
            token = self.special_tokens_map.get(name)
            setattr(self, f"{name}_id", None if token is None else self._tok.token_to_id(token))
        self._templates: dict[str, object] = {}  # template source -> compiled

    @cached_property
    def hf(self):
        """transformers' tokenizer for the same directory (loaded on first use)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.name_or_path)

    def __getattr__(self, name: str):  # anything not implemented here: transformers' tokenizer
        if name.startswith("_") or name == "hf":
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab {len(self)})"

    # ------------------------------------------------------------ text <-> ids
    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if kwargs:
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return self.hf.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    # -------------------------------------------------------------- chat
    def _compiled_template(self, source: str):
        compiled = self._templates.pop(source, None) or compile_chat_template(source)
        self._templates[source] = compiled  # the most recent last: the first is the least recent
        if len(self._templates) > MAX_COMPILED_TEMPLATES:
            del self._templates[next(iter(self._templates))]
        return compiled

    def apply_chat_template(
        self,
        conversation,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs,
    ):
        hf_args = {k: kwargs.pop(k) for k in list(kwargs) if k in _HF_CHAT_ARGS}
        # a template's text given for this call replaces the model's own (transformers' meaning)
        override = hf_args.pop("chat_template", None)
        source = self.chat_template if override is None else override
        if override is not None:
            hf_args["chat_template"] = override  # for transformers' path, if the call takes it
        simple = (
            isinstance(source, str)
            and not _GENERATION_TAG.search(source)
            and isinstance(conversation, (list, tuple))
            and conversation
            and all(isinstance(m, dict) for m in conversation)
            and not any(m.get(f) is not None for m in conversation for f in _REASONING_FIELDS)
            and all(v == _HF_CHAT_ARGS[k] for k, v in hf_args.items() if k != "chat_template")
            and (not tokenize or return_dict is False)
        )
        if not simple:
            return self.hf.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                return_dict=return_dict,
                **hf_args,
                **kwargs,
            )
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        text = self._compiled_template(source).render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def compile_chat_template(source: str):
    """A jinja2 template in transformers' chat-template environment: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, a ``tojson`` that keeps non-ASCII text, ``raise_exception`` and
    ``strftime_now``."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
