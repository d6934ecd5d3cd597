"""One self-contained HTML file of a trace: the viewer's HTML, CSS and JS (package data) with
the trace document inlined as JSON. No network, no build step: open it from disk."""

from __future__ import annotations

import html
import json
import os
from importlib.resources import files


def _asset(name: str) -> str:
    return files("nanovllm.trace_html").joinpath(name).read_text(encoding="utf-8")


def render_html(doc: dict) -> str:
    """The page for a trace document (``trace_document``)."""
    # "<" never occurs in JSON outside strings, and "\u003c" is the same string inside them:
    # so no "</script>" in the data can end the script element early.
    data = json.dumps(doc, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    page = _asset("viewer.html")
    for key, value in (
        ("/*__CSS__*/", _asset("viewer.css")),
        ("/*__JS__*/", _asset("viewer.js")),
        ("__TITLE__", html.escape(doc.get("title") or "nanovllm trace")),
        ("__TRACE_JSON__", data),
    ):
        page = page.replace(key, value, 1)
    return page


def write_html(path: str | os.PathLike, doc: dict) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(doc))
    return os.fspath(path)
