"""Experiments 04 and 07 on a tiny zoo model: the columns and result lines that describe the
scheduler (KV blocks in use, finishing order, finish rank) agree with the trace they are read
from. The experiment tests check the token counts of these files, not these columns."""

from __future__ import annotations

import csv
import json
import re

import pytest

from tests.conftest import zoo_model

pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[experiments]')")

from nanovllm.experiments import load  # noqa: E402
from nanovllm.experiments.runner import run_experiment  # noqa: E402

MODEL = "llama-mha-hd64"


def _rows(path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _run(number, shape_of, tmp_path, **engine):
    mod = load(number)
    report = run_experiment(
        number,
        model=zoo_model(MODEL),
        shape=shape_of(mod),
        out_dir=tmp_path,
        engine_args={"device": "cpu", "dtype": "float32", **engine},
        echo=lambda line: None,
    )
    return report, tmp_path / f"{mod.NUMBER}-{mod.NAME}"


def test_experiment_04_block_usage_and_finishing_order(tmp_path):
    """steps.csv's used_blocks is the cache minus the free blocks the trace recorded after each
    step (the page embeds the same trace), and nothing is in use after the last request
    finished; the finishing order lists the requests by the step they finished at."""
    report, out = _run("04", lambda m: m.SHAPES["cpu"], tmp_path)
    steps = _rows(out / "steps.csv")
    html = (out / "trace.html").read_text(encoding="utf-8")
    doc = json.loads(re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', html, re.S)[1])
    assert len(steps) == len(doc["steps"])
    for row, st in zip(steps, doc["steps"]):
        assert int(row["used_blocks"]) == st["num_blocks"] - st["num_free_blocks"], (row, st)
        assert 0 <= int(row["used_blocks"]) <= int(row["num_blocks"])
    assert int(steps[-1]["used_blocks"]) == 0, "blocks still in use after every request finished"
    assert max(int(r["used_blocks"]) for r in steps) > 0
    finish_step = {r["request"]: int(r["finish_step"]) for r in _rows(out / "requests.csv")}
    line = next(r for r in report.results if r.startswith("finishing order: "))
    listed = re.findall(r"(\S+) \(step (\d+)\)", line.split(";")[0])
    assert [(rid, int(s)) for rid, s in listed] == sorted(finish_step.items(), key=lambda kv: kv[1]), line
    assert len(set(finish_step.values())) > 1 and list(finish_step) != [rid for rid, _ in listed], (
        "weak check: the requests finish in submission order"
    )


def test_experiment_07_finish_rank_follows_the_finishing_step(tmp_path):
    """A request that finishes at an earlier step has the smaller finish rank (the rank is the
    finishing order), and the result line lists the requests in rank order."""
    report, out = _run("07", lambda m: m.Shape((4, 40, 8, 20), (6, 2, 4, 3), 16, 2), tmp_path)
    rows = _rows(out / "mixed_batch_requests.csv")
    by_rank = sorted(rows, key=lambda r: int(r["finish_rank"]))
    assert [int(r["finish_step"]) for r in by_rank] == sorted(int(r["finish_step"]) for r in rows), [
        (r["request"], r["finish_rank"], r["finish_step"]) for r in rows
    ]
    assert [r["finish_rank"] for r in rows] != [r["submitted"] for r in rows], "weak check: finish in submission order"
    line = next(r for r in report.results if r.startswith("finishing order: "))
    listed = re.findall(r"(\S+) \(\d+ out", line.split(";")[0])
    assert listed == [r["request"] for r in by_rank], line
