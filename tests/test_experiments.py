"""The experiments (nanovllm/experiments) on a tiny zoo model and tiny shapes: each writes its
CSV and PNG files, and the numbers in them agree with the workload (token counts, sweep points,
scheduler facts that follow from the settings). Timings are not checked."""

from __future__ import annotations

import csv
import json

import pytest

from tests.conftest import engine_args, zoo_model

pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e '.[experiments]')")

from nanovllm.experiments import load  # noqa: E402
from nanovllm.experiments.runner import run_experiment  # noqa: E402

MODEL = "llama-mha-hd64"

TINY = {
    "01": lambda m: m.Shape((8, 24), 3),
    "02": lambda m: m.Shape(8, (3, 6)),
    "03": lambda m: m.Shape((1, 2, 4), 8, 4),
    "04": lambda m: m.SHAPES["cpu"],
    "05": lambda m: m.Shape(3, 8, 8, (2, 3, 6), block_size=8),
    "06": lambda m: m.Shape(4, 8, 3, (1, 4), (8, 32)),
    "07": lambda m: m.Shape((4, 40, 8, 20), (6, 2, 4, 3), 16, 2),
}


def _rows(path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _assert_png(path) -> None:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    h, w = mpimg.imread(path).shape[:2]
    assert h >= 100 and w >= 200, f"{path}: {w}x{h} is too small to be a plot"


def check_rows(number: str, shape, rows: list[dict]) -> None:
    """The token counts of each row equal the workload's (raises AssertionError otherwise)."""
    if number == "01":
        assert [int(r["input_len"]) for r in rows] == list(shape.input_lens)
        assert all(int(r["output_tokens"]) == shape.max_tokens for r in rows)
    elif number == "02":
        assert [int(r["output_tokens"]) for r in rows] == list(shape.output_lens)
        assert [int(r["steps"]) for r in rows] == list(shape.output_lens)  # one sample per step, batch 1
    elif number == "03":
        assert [int(r["batch"]) for r in rows] == list(shape.batch_sizes)
        assert [int(r["output_tokens"]) for r in rows] == [b * shape.max_tokens for b in shape.batch_sizes]
        assert [int(r["max_seqs_in_step"]) for r in rows] == list(shape.batch_sizes)
    elif number == "05":
        assert [int(r["num_blocks"]) for r in rows] == sorted(shape.cache_blocks)
        assert all(int(r["output_tokens"]) == shape.num_requests * shape.max_tokens for r in rows)
        assert all(int(r["peak_used_blocks"]) <= int(r["num_blocks"]) for r in rows)
        assert all((int(r["preemptions"]) > 0) == (int(r["recomputed_tokens"]) > 0) for r in rows)
    elif number == "06":
        assert [(int(r["max_num_seqs"]), int(r["max_num_batched_tokens"])) for r in rows] == [
            (s, b) for s in shape.max_num_seqs for b in shape.max_num_batched_tokens
        ]
        assert all(int(r["output_tokens"]) == shape.num_requests * shape.max_tokens for r in rows)
    elif number == "07":
        assert [int(r["prompt_tokens"]) for r in rows] == list(shape.input_lens)
        assert [int(r["output_tokens"]) for r in rows] == list(shape.max_tokens)
        assert sorted(int(r["finish_rank"]) for r in rows) == list(range(1, len(rows) + 1))
    elif number == "04":
        assert [int(r["output_tokens"]) for r in rows] == list(shape.max_tokens)
        assert [int(r["prompt_tokens"]) for r in rows] == [
            n + (shape.shared_prefix if i in (0, 2) else 0) for i, n in enumerate(shape.own_lens)
        ]


CSV = {
    "01": "input_length.csv",
    "02": "output_length.csv",
    "03": "batch_scaling.csv",
    "04": "requests.csv",
    "05": "kv_pressure.csv",
    "06": "config_sweep.csv",
    "07": "mixed_batch_requests.csv",
}
PNG = {
    "01": "input_length.png",
    "02": "output_length.png",
    "03": "batch_scaling.png",
    "04": "scheduler_watch.png",
    "05": "kv_pressure.png",
    "06": "config_sweep.png",
    "07": "mixed_batch.png",
}


@pytest.mark.parametrize("number", list(TINY))
def test_experiment_writes_consistent_csv_and_png(number, tmp_path, device):
    mod = load(number)
    shape = TINY[number](mod)
    lines: list[str] = []
    args = {k: v for k, v in engine_args(device).items() if k not in mod.SWEPT}
    report = run_experiment(
        number, model=zoo_model(MODEL), shape=shape, out_dir=tmp_path, engine_args=args, echo=lines.append
    )
    out = tmp_path / f"{mod.NUMBER}-{mod.NAME}"
    rows = _rows(out / CSV[number])
    check_rows(number, shape, rows)
    _assert_png(out / PNG[number])
    results = json.loads((out / "results.json").read_text())
    assert results["results"] == report.results and len(report.results) >= 2
    assert any(line.startswith("   look for:") for line in lines)
    assert sum(line.startswith("   result:") for line in lines) == len(report.results)
    # negative control: the same check rejects a row whose token count is off by one
    bad = [dict(r) for r in rows]
    col = "output_tokens" if "output_tokens" in bad[0] else "prompt_tokens"
    bad[-1][col] = str(int(bad[-1][col]) + 1)
    with pytest.raises(AssertionError):
        check_rows(number, shape, bad)
    if number == "05":
        by_blocks = {int(r["num_blocks"]): int(r["preemptions"]) for r in rows}
        # 3 requests of 2 blocks each: 2 blocks cannot hold two growing sequences; 6 hold all three
        assert by_blocks[2] > 0 and by_blocks[6] == 0, by_blocks
    if number in ("04", "07"):  # 07 warms its engine up first: its steps still count from 0
        steps = _rows(out / ("steps.csv" if number == "04" else "mixed_batch_steps.csv"))
        assert [int(r["step"]) for r in steps] == list(range(len(steps)))
        assert min(int(r["first_step"]) for r in rows) == 0
    if number == "04":
        assert all((int(r["preemptions"]) > 0) == (int(r["recompute_steps"]) > 0) for r in rows)
        assert any(r.startswith("prefill: ") and "recompute step" in r for r in report.results), report.results
        steps = _rows(out / "steps.csv")
        assert any(r["preempted"] for r in steps), "the scheduler watch shows no preemption"
        assert any(int(r["cache_hit_tokens"]) == shape.shared_prefix for r in rows), "no prefix-cache hit"
        html = (out / "trace.html").read_text()
        assert '"format":"nanovllm-trace/1"' in html


def test_run_steps_count_from_zero_after_a_warm_up():
    from nanovllm import LLM
    from nanovllm.experiments.workload import random_prompts, run_workload, warm_up

    llm = LLM(zoo_model(MODEL), device="cpu", trace=True)
    try:
        warm_up(llm)
        run = run_workload(llm, random_prompts(llm.llm_engine.vocab_size, [5, 9]), 3)
        assert [e.step for e in run.events] == list(range(len(run.events)))
        assert min(r.summary.first_step for r in run.requests) == 0
        # negative control: the engine's own numbers (what the run reported before) start after the warm-up
        assert llm.llm_engine.tracer.events[0].step > 0
    finally:
        llm.close()


def test_engine_variant_refuses_larger_buffers():
    from nanovllm import LLM
    from nanovllm.experiments.workload import engine_variant

    llm = LLM(zoo_model(MODEL), device="cpu", max_num_seqs=4, max_num_batched_tokens=64, trace=True)
    try:
        engine_variant(llm, max_num_seqs=2, max_num_batched_tokens=16)
        assert llm.llm_engine.config.max_num_seqs == 2
        with pytest.raises(ValueError, match="max_num_seqs=8 exceeds the loaded engine's 4"):
            engine_variant(llm, max_num_seqs=8)  # checked against the loaded engine, not the variant
        engine_variant(llm, max_num_seqs=4)
        with pytest.raises(ValueError, match="changes only"):
            engine_variant(llm, block_size=8)
    finally:
        llm.close()


def test_cli_experiment_list_and_errors(tmp_path, capsys):
    from nanovllm.entrypoints.cli import main

    assert main(["experiment", "list"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == ["01", "02", "03", "04", "05", "06", "07"]
    assert main(["experiment", "99"]) == 2
    assert "experiment '99' is not known" in capsys.readouterr().err
    assert main(["experiment", "kv-pressure", "--num-kvcache-blocks", "4", "--out", str(tmp_path)]) == 2
    assert "sweeps num_kvcache_blocks itself" in capsys.readouterr().err
    assert main(["experiment", "01", "--threads", "0", "--out", str(tmp_path)]) == 2
    assert "threads must be >= 1, got 0" in capsys.readouterr().err  # EngineConfig.threads
