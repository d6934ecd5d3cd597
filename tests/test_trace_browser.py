"""The trace viewer in a real browser (headless Debian Chromium driven by Playwright): the page
loads offline without errors, its DOM matches the trace JSON (step count, preemption and
prefix-cache markers, KV usage, block tables), and keyboard and mouse navigation work.
Screenshots of the four views go to $NANOVLLM_TRACE_SCREENSHOTS (default: the test's tmp dir)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.browser import browser_page, chromium_or_skip
from tests.conftest import zoo_model

MODEL = "llama-mha-hd64"
VIEWS = ("timeline", "kv", "requests", "step")


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """Experiment 04's workload on a zoo model: chunked prefill, a preemption, a prefix-cache hit."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.experiments import e04_scheduler_watch as e04
    from nanovllm.trace_html import trace_document, write_html

    shape = e04.SHAPES["cpu"]
    llm = LLM(zoo_model(MODEL), device="cpu", trace=True, **e04.engine_args(shape))
    try:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in shape.max_tokens]
        outs = llm.generate(e04.prompts(shape, llm.llm_engine.vocab_size), params, use_tqdm=False)
        doc = trace_document(llm.llm_engine.tracer.events, llm.llm_engine, outs, title="browser test")
    finally:
        llm.close()
    path = write_html(tmp_path_factory.mktemp("trace") / "trace.html", doc)
    return Path(path), doc


def _index(page) -> int:
    return int(page.get_attribute("#step-label", "data-index"))


def dom_block_tables(page) -> dict:
    return dict(
        page.eval_on_selector_all(
            "#step-detail table.block-table",
            "ts => ts.map(t => [t.dataset.request, [...t.querySelectorAll('td')].map(td => Number(td.dataset.blockId))])",
        )
    )


def doc_block_tables(doc, i: int) -> dict:
    return {s["request_id"]: s["block_ids"] for s in doc["steps"][i]["seqs"]}


def _markers(page, svg: str, cls: str) -> set:
    return {
        tuple(x)
        for x in page.eval_on_selector_all(
            f"#{svg} .marker.{cls}", "ms => ms.map(m => [Number(m.dataset.step), m.dataset.request || null])"
        )
    }


def test_viewer_in_chromium(trace, tmp_path):
    exe = chromium_or_skip()
    path, doc = trace
    steps, n = doc["steps"], len(doc["steps"])
    preempt = {(i, rid) for i, s in enumerate(steps) for rid in s["preempted"]}
    hits = {(i, q["request_id"]) for i, s in enumerate(steps) for q in s["seqs"] if q["num_cached_tokens"]}
    assert preempt and hits, "the workload must show a preemption and a prefix-cache hit"
    shots = Path(os.environ.get("NANOVLLM_TRACE_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with browser_page(exe) as page:
        page.goto(path.as_uri())
        # --- the DOM against the trace JSON
        assert page.get_attribute("#step-count", "data-count") == str(n)
        assert page.get_attribute("#step-slider", "max") == str(n - 1)
        assert _markers(page, "timeline", "preempt") == preempt
        assert _markers(page, "timeline", "cache-hit") == hits
        # --- keyboard
        page.keyboard.press("End")
        assert _index(page) == n - 1
        page.keyboard.press("Home")
        page.keyboard.press("ArrowRight")
        page.keyboard.press("ArrowRight")
        page.keyboard.press("ArrowLeft")
        assert _index(page) == 1
        page.keyboard.press("p")
        first_preempt = min(i for i, _ in preempt)
        assert _index(page) == first_preempt
        page.screenshot(path=str(shots / "trace-timeline.png"), full_page=True)
        page.keyboard.press("Home")
        page.keyboard.press("c")
        hit_step, hit_rid = min(hits)
        assert _index(page) == hit_step
        page.keyboard.press("4")
        assert page.is_visible("#view-step") and not page.is_visible("#view-timeline")
        assert dom_block_tables(page) == doc_block_tables(doc, hit_step)
        hit_seq = next(q for q in steps[hit_step]["seqs"] if q["request_id"] == hit_rid)
        num_hit = page.eval_on_selector_all(
            f'#step-detail table.block-table[data-request="{hit_rid}"] td.hit', "tds => tds.length"
        )
        assert num_hit == hit_seq["num_cached_tokens"] // doc["block_size"] > 0
        page.screenshot(path=str(shots / "trace-step.png"), full_page=True)
        for i in (0, first_preempt, n - 1):  # slider + block tables at other steps
            page.eval_on_selector("#step-slider", f"(s) => {{ s.value = '{i}'; s.dispatchEvent(new Event('input')); }}")
            assert _index(page) == i and dom_block_tables(page) == doc_block_tables(doc, i)
        # --- mouse: a tab, a timeline cell, the KV chart, a request row
        page.click("#tabs button[data-view=timeline]")
        cell = page.query_selector("#timeline rect.cell[data-phase=decode]")
        a, b = int(cell.get_attribute("data-first-step")), int(cell.get_attribute("data-last-step"))
        assert b > a
        box = cell.bounding_box()
        cell.click(position={"x": box["width"] * 1.5 / (b - a + 1), "y": box["height"] / 2})
        assert _index(page) == a + 1
        page.click("#tabs button[data-view=kv]")
        used = page.eval_on_selector_all("#kv-chart .kv-point", "ps => ps.map(p => Number(p.dataset.used))")
        assert used == [s["num_blocks"] - s["num_free_blocks"] for s in steps]
        assert _markers(page, "kv-chart", "preempt") == {(i, None) for i, _ in preempt}
        point = page.query_selector(f'#kv-chart .kv-point[data-step="{n - 2}"]').bounding_box()
        page.mouse.click(point["x"] + point["width"] / 2, point["y"] + 20)
        assert _index(page) == n - 2
        page.screenshot(path=str(shots / "trace-kv.png"), full_page=True)
        page.click("#tabs button[data-view=requests]")
        last = doc["requests"][-1]
        page.click(f'#requests tbody tr[data-request="{last["request_id"]}"]')
        assert page.get_attribute("#requests tr.selected", "data-request") == last["request_id"]
        assert steps[_index(page)]["step"] == last["first_step"]
        rows = page.eval_on_selector_all("#requests tbody tr", "rs => rs.map(r => r.dataset.request)")
        assert rows == [r["request_id"] for r in doc["requests"]]
        page.screenshot(path=str(shots / "trace-requests.png"), full_page=True)
        assert page.errors == []
    for view in VIEWS:
        assert (shots / f"trace-{view}.png").read_bytes()[:4] == b"\x89PNG"


def test_block_table_check_catches_a_viewer_bug(trace, tmp_path, monkeypatch):
    """Negative control: a viewer that drops each table's first block fails the DOM check."""
    exe = chromium_or_skip()
    from nanovllm.trace_html import page as page_mod

    real = page_mod._asset
    monkeypatch.setattr(
        page_mod,
        "_asset",
        lambda name: (
            real(name).replace("s.block_ids.forEach(", "s.block_ids.slice(1).forEach(")
            if name == "viewer.js"
            else real(name)
        ),
    )
    _, doc = trace
    path = tmp_path / "buggy.html"
    page_mod.write_html(path, doc)
    with browser_page(exe) as page:
        page.goto(path.as_uri())
        page.keyboard.press("4")
        assert dom_block_tables(page) != doc_block_tables(doc, 0)
