"""``--chat-template``: a chat template given by its file's path or as the template's own text, as
vLLM's flag takes it. The template replaces the model's own for every chat prompt (``serve``'s chat
endpoint and ``/tokenize``, ``generate --chat``); ``LLM.chat(chat_template=...)`` takes the text.

Imports nothing heavy: the CLI checks the flag before the model loads.
"""

from __future__ import annotations

from pathlib import Path

# a value with one of these is a template, not a path: jinja2's tags, or a line break. vLLM takes any
# brace; a mistyped path such as "tpl/{name}.jinja" would then be served as the template's text
TEMPLATE_MARKS = ("{{", "{%", "{#", "\n")


def load_chat_template(value: str | None, flag: str = "--chat-template") -> str | None:
    """The template's text: the file's content where ``value`` names a file, ``value`` itself where
    it reads as a template, else a ValueError naming ``flag`` and the value. The text must compile
    in the chat-template environment (a syntax error is named here, not at the first request)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{flag} must be a file path or a template's text, got {value!r}")
    try:
        is_file = Path(value).expanduser().is_file()
    except (OSError, ValueError):  # a template's text can be too long or odd for a path
        is_file = False
    if is_file:
        try:
            source = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{flag} {value!r}: the file cannot be read as UTF-8 text: {e}") from None
    elif any(mark in value for mark in TEMPLATE_MARKS):
        source = value
    else:
        raise ValueError(
            f"{flag} {value!r}: no such file, and not a template's text (a template has '{{{{', '{{%' or "
            "'{{#' in it, or a line break)"
        )
    from jinja2 import TemplateError

    from nanovllm.tokenizer import compile_chat_template

    try:
        compile_chat_template(source)
    except TemplateError as e:
        raise ValueError(f"{flag} {value!r}: not a valid chat template (jinja2): {e}") from None
    return source
