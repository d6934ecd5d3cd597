"""The trace viewer in Chromium on a hand-built trace whose pictures are known: a preempted
request's waiting bar covers exactly the steps it did not run (it ends where its recompute
starts), and the block tables of every step mark as written exactly the blocks whose token
range meets the tokens the step computed, each showing the tokens it holds after the step.
The browser test compares block ids and markers; these parts of the picture it does not read."""

from __future__ import annotations

from pathlib import Path

from nanovllm.engine.trace import SeqStep, StepEvent, Tracer
from nanovllm.trace_html import trace_document, write_html
from tests.browser import browser_page, chromium_or_skip

BS = 4


def _doc() -> dict:
    """Request a (6-token prompt) prefilled, then decoded to 11 tokens; b (3-token prompt)
    prefilled, decoded once, preempted at step 2, waiting at step 3, recomputed at step 4 (5
    tokens), then decoded; a's decodes start mid-block (computed before 6, 7, ...)."""
    steps = [
        ("prefill", [SeqStep("a", "prefill", 6, 0, 6, [0, 1]), SeqStep("b", "prefill", 3, 0, 3, [2])], [], []),
        ("decode", [SeqStep("a", "decode", 1, 6, 7, [0, 1]), SeqStep("b", "decode", 1, 3, 4, [2])], [], []),
        ("decode", [SeqStep("a", "decode", 1, 7, 8, [0, 1])], ["b"], []),
        ("decode", [SeqStep("a", "decode", 1, 8, 9, [0, 1, 3])], [], []),
        ("mixed", [SeqStep("a", "decode", 1, 9, 10, [0, 1, 3]), SeqStep("b", "prefill", 5, 0, 5, [2, 4])], [], []),
        (
            "decode",
            [SeqStep("a", "decode", 1, 10, 11, [0, 1, 3]), SeqStep("b", "decode", 1, 5, 6, [2, 4])],
            [],
            [("a", "length"), ("b", "length")],
        ),
    ]
    tracer = Tracer(enabled=True)
    for i, (kind, seqs, preempted, finished) in enumerate(steps):
        tracer.record(
            StepEvent(i, kind, seqs, preempted, finished, num_free_blocks=3, num_blocks=8, t_start=i, t_end=i + 0.5)
        )
    doc = trace_document(tracer.events, title="hunt viewer")
    doc["block_size"] = BS
    return doc


def test_waiting_bars_and_written_blocks(tmp_path):
    """b's waiting bar spans steps 2-3 exactly (not its recompute at step 4); at every step each
    block is marked written iff its tokens [j*bs, (j+1)*bs) meet the step's [computed, end)."""
    exe = chromium_or_skip()
    doc = _doc()
    path = write_html(tmp_path / "t.html", doc)
    with browser_page(exe) as page:
        page.goto(Path(path).as_uri())
        rects = page.eval_on_selector_all(
            "#timeline rect.waiting, #timeline rect.cell",
            "rs => rs.map(r => ({cls: r.getAttribute('class'), rid: r.dataset.request || null, phase: r.dataset.phase || null,"
            " x: Number(r.getAttribute('x')), w: Number(r.getAttribute('width')), y: Number(r.getAttribute('y')),"
            " h: Number(r.getAttribute('height'))}))",
        )
        waits = [r for r in rects if r["cls"] == "waiting"]
        cells = [r for r in rects if r["cls"] != "waiting"]
        assert len(waits) == 1
        (wait,) = waits
        row = [c for c in cells if c["y"] <= wait["y"] < c["y"] + c["h"]]
        assert {c["rid"] for c in row} == {"b"}
        for c in row:  # waiting and running never at the same step
            assert wait["x"] + wait["w"] <= c["x"] + 1e-6 or c["x"] + c["w"] <= wait["x"] + 1e-6, (wait, c)
        b0, b1, b4 = sorted(row, key=lambda c: c["x"])[:3]  # b's cells: steps 0, 1 and 4 onwards
        assert (b0["phase"], b1["phase"], b4["phase"]) == ("prefill", "decode", "recompute")
        cw = b1["x"] - b0["x"]  # one step
        assert abs(wait["x"] - (b0["x"] + 2 * cw)) < 1e-6 and abs(wait["w"] - 2 * cw) < 1e-6, (wait, cw)
        assert abs(b4["x"] - (b0["x"] + 4 * cw)) < 1e-6
        page.keyboard.press("4")
        for i, st in enumerate(doc["steps"]):
            page.evaluate(f"window.traceViewer.go({i})")
            tables = page.eval_on_selector_all(
                "#step-detail table.block-table",
                "ts => ts.map(t => [t.dataset.request, [...t.querySelectorAll('td')].map(td =>"
                " [td.classList.contains('write'), td.querySelector('.fill').textContent])])",
            )
            got = dict(tables)
            for s in st["seqs"]:
                c, end = s["num_computed_before"], s["num_computed_before"] + s["num_new_tokens"]
                want = [
                    [max(c, j * BS) < min(end, (j + 1) * BS), f"{max(0, min(BS, end - j * BS))}/{BS}"]
                    for j in range(len(s["block_ids"]))
                ]
                assert got[s["request_id"]] == want, (st["step"], s["request_id"], got[s["request_id"]], want)
        assert page.errors == []
