"""The trace viewer: a real run's StepEvents as one self-contained HTML page.

    doc = trace_document(llm.llm_engine.tracer.events, llm.llm_engine, outputs)
    write_html("run.html", doc)

``nanovllm trace --html run.html [prompts] [engine flags]`` does both (``cli.py``).
"""

from nanovllm.trace_html.document import FORMAT, trace_document
from nanovllm.trace_html.page import render_html, write_html

__all__ = ["FORMAT", "trace_document", "render_html", "write_html"]
