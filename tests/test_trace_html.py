"""The trace document and page: step timestamps, per-request summaries that agree with the
outputs, block tables equal to the events', a page with no external resource whose embedded
JSON survives any text, and the `nanovllm trace` command."""

from __future__ import annotations

import json
import re

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.engine.trace import summarize_requests
from nanovllm.trace_html import render_html, trace_document
from tests.conftest import ZOO, prompts_for, zoo_model

MODEL = "llama-mha-hd64"


@pytest.fixture(scope="module")
def run():
    """A starved KV cache and a small token budget: preemptions and chunked prefill."""
    llm = LLM(
        zoo_model(MODEL), device="cpu", block_size=16, num_kvcache_blocks=9, max_num_batched_tokens=24, trace=True
    )
    prompts = prompts_for(ZOO[MODEL].vocab_size, (40, 23, 17, 33, 5, 60), seed=1)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    events = list(llm.llm_engine.tracer.events)
    doc = trace_document(events, llm.llm_engine, outs, title="unit </script><script>alert(1)</script>")
    yield llm, events, outs, doc
    llm.close()


def check_summaries(events, outs) -> None:
    """Each request sampled once per output token, its first token before its finish."""
    summary = summarize_requests(events)
    for o in outs:
        s = summary[o.request_id]
        assert s.num_sampled == len(o.outputs[0].token_ids), (o.request_id, s)
        assert s.finish_reason == o.outputs[0].finish_reason
        assert s.first_step <= s.first_token_step <= s.finish_step
        assert s.t_first_scheduled <= s.t_first_token <= s.t_finish


def test_events_are_timed_and_summaries_match_outputs(run):
    llm, events, outs, _ = run
    assert llm.stats()["preemptions"] > 0
    assert all(e.t_end is not None and e.duration >= 0 for e in events)
    assert all(a.t_end <= b.t_start for a, b in zip(events, events[1:]))  # synchronous steps do not overlap
    check_summaries(events, outs)
    assert sum(s.num_preemptions for s in summarize_requests(events).values()) == llm.stats()["preemptions"]
    # negative control: a trace missing one decode step no longer agrees with the outputs
    gap = [e for e in events if e is not next(e for e in events if e.kind == "decode")]
    with pytest.raises(AssertionError):
        check_summaries(gap, outs)


def test_recomputes_are_the_prefills_after_a_preemption(run):
    """On a real run: a prefill is marked a recompute exactly when its request was preempted at an
    earlier step (the viewer's rule), and the summaries split the prefill steps the same way."""
    _, events, _, _ = run
    preempted: set[str] = set()
    marks = []
    for e in events:
        for s in e.seqs:
            assert s.recompute == (s.phase == "prefill" and s.request_id in preempted), (e.step, s)
            marks.append(s.recompute)
            label = "recompute" if s.recompute else s.phase
            assert any(line.split()[:2] == [s.request_id, label] for line in e.format().splitlines()), e.format()
        preempted.update(e.preempted)
    assert any(marks), "the run recomputes nothing (weak check)"
    summary = summarize_requests(events)
    for rid, r in summary.items():
        prefills = [s for e in events for s in e.seqs if s.request_id == rid and s.phase == "prefill"]
        assert r.num_prefill_chunks + r.num_recompute_steps == len(prefills)
        assert (r.num_recompute_steps > 0) == (r.num_preemptions > 0), r


def test_text_format_unchanged_by_timestamps(run):
    _, events, _, _ = run
    head = events[0].format().splitlines()[0]
    assert re.fullmatch(r"step +\d+ \w+ +tokens=\d+ +seqs=\d+ +free_blocks=\d+/\d+", head.strip()), head


def test_document_matches_events(run):
    llm, events, outs, doc = run
    assert doc["format"] == "nanovllm-trace/1"
    assert len(doc["steps"]) == len(events)
    assert doc["block_size"] == 16 and doc["config"]["num_kvcache_blocks"] == 9
    for d, e in zip(doc["steps"], events):
        assert d["step"] == e.step and d["kind"] == e.kind and d["num_tokens"] == e.num_tokens
        assert [q["block_ids"] for q in d["seqs"]] == [s.block_ids for s in e.seqs]
        assert d["preempted"] == e.preempted and [tuple(f) for f in d["finished"]] == e.finished
    assert doc["steps"][0]["t_start"] == 0.0
    by_id = {r["request_id"]: r for r in doc["requests"]}
    for o in outs:
        r = by_id[o.request_id]
        assert r["num_output_tokens"] == len(o.outputs[0].token_ids) == 40
        assert r["num_prompt_tokens"] == len(o.prompt_token_ids)
    json.dumps(doc, allow_nan=False)  # plain JSON


def test_page_is_self_contained_and_embeds_the_document(run):
    *_, doc = run
    page = render_html(doc)
    assert not re.search(r"<(link|img|iframe)\b|\b(src|href)\s*=|@import|url\(", page, re.I), "external resource"
    assert "</script><script>alert" not in page  # the title cannot end the data script early
    data = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', page, re.S).group(1)
    assert json.loads(data) == json.loads(json.dumps(doc))
    # negative control: the same extraction fails on a page built without the escaping
    naive = page.replace(data, json.dumps(doc))
    cut = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', naive, re.S).group(1)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)


def test_document_refuses_an_empty_trace():
    with pytest.raises(ValueError, match="at least one StepEvent"):
        trace_document([])


def _cli(capsys, *args):
    """The CLI in this process (``main``): (exit code, stdout, stderr)."""
    from nanovllm.entrypoints.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_trace_writes_html_and_json(tmp_path, capsys):
    html, js = tmp_path / "run.html", tmp_path / "run.json"
    code, out, err = _cli(
        capsys,
        "trace",
        "--model",
        zoo_model(MODEL),
        "w10 w20 w30 w40",
        "w5 w6",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--ignore-eos",
        "--max-num-batched-tokens",
        "3",
        "--html",
        str(html),
        "--json",
        str(js),
    )
    assert code == 0, err
    doc = json.loads(js.read_text())
    assert len(doc["requests"]) == 2 and all(q["num_output_tokens"] == 5 for q in doc["requests"])
    assert all(s["num_tokens"] <= 3 for s in doc["steps"])
    assert f"{len(doc['steps'])} steps" in out and html.stat().st_size > 10_000
    code, out, err = _cli(capsys, "trace", "--model", zoo_model(MODEL), "w1")
    assert code == 2 and "--html FILE and/or --json FILE" in err


def test_cli_trace_demo_workload(tmp_path, capsys):
    js = tmp_path / "demo.json"
    code, out, err = _cli(capsys, "trace", "--model", zoo_model(MODEL), "--json", str(js))
    assert code == 0, err
    doc = json.loads(js.read_text())
    assert any(s["preempted"] for s in doc["steps"]) and any(
        q["num_cached_tokens"] for s in doc["steps"] for q in s["seqs"]
    )
    assert doc["config"]["num_kvcache_blocks"] == 8 and doc["config"]["max_num_batched_tokens"] == 32


def test_cli_trace_checks_its_output_paths_before_the_run(tmp_path, capsys, monkeypatch):
    """A path that cannot be written fails at once, naming its flag and the path (the model is not
    loaded: the run would be lost)."""
    import nanovllm.llm

    def no_load(*args, **kwargs):
        raise RuntimeError("the model was loaded")

    monkeypatch.setattr(nanovllm.llm, "LLM", no_load)
    missing = tmp_path / "no-such-folder" / "x.html"
    code, _, err = _cli(capsys, "trace", "w1", "--html", str(missing))
    assert code == 2
    assert err == f"nanovllm: error: --html {str(missing)!r}: the folder {str(missing.parent)!r} does not exist\n"
    code, _, err = _cli(capsys, "trace", "w1", "--html", str(tmp_path / "ok.html"), "--json", str(tmp_path))
    assert code == 2 and err == f"nanovllm: error: --json {str(tmp_path)!r} is a folder; give a file name\n"
    # negative control: with paths that can be written the command goes on to load the model
    with pytest.raises(RuntimeError, match="the model was loaded"):
        _cli(capsys, "trace", "w1", "--html", str(tmp_path / "ok.html"))
