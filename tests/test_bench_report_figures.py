"""`nanovllm bench`'s own rows against hand computations: the --repeat median of nanovllm's runs
(the peers' median was checked, nanovllm's own was not), the table's "nanovllm / engine" ratio and
roofline fraction as printed, and the steps noted for a timed run (its own steps only)."""

from __future__ import annotations

import json

import pytest

from conformance.zoo import zoo_model
from nanovllm.bench import datasets, peers, run
from nanovllm.bench.roofline import H100, Roofline
from nanovllm.entrypoints import cli

MODEL = "qwen3-gqa2-hd64-tied"  # vocabulary 1031


@pytest.mark.parametrize("seconds, median", [([4.0, 1.0, 2.0], 2.0), ([4.0, 1.0, 2.0, 3.0], 2.5)])
def test_repeat_reports_the_median_of_nanovllms_runs(monkeypatch, capsys, tmp_path, seconds, median):
    """--repeat N times nanovllm N times: its row's seconds are the median (the middle run, or
    the mean of the middle two), not the mean of all and not the first."""
    runs = iter(seconds)
    monkeypatch.setattr(peers, "run_nanovllm", lambda *a, **k: [peers.Measurement("nanovllm", 40, next(runs))])
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", zoo_model(MODEL), "--dataset", "random", "--num-prompts", "2", "--input-len", "6"]
    rc = cli.main(argv + ["--output-len", "4", "--repeat", str(len(seconds)), "--json-out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    row = json.loads(out.read_text())["results"][0]
    assert row["engine"] == "nanovllm" and row["seconds"] == median, row
    assert row["tokens_per_s"] == pytest.approx(40 / median) and row["note"] == f"median of {len(seconds)}"


def test_table_ratio_and_roofline_fraction_as_printed(capsys):
    """nanovllm at 100 tok/s, a peer at 25 tok/s: the peer's row says 4.00x (nanovllm / engine);
    a limit of 400 tok/s: nanovllm reaches 25.0% of it."""
    ours = peers.Measurement("nanovllm", 100, 1.0)
    peer = peers.Measurement("slow peer", 100, 4.0)
    limit = Roofline(1.0, 1.0, 1.0, 0.25, 400.0, H100)
    run.print_table([ours, peer], ours, limit)
    out = capsys.readouterr().out
    assert "| slow peer | 25.0 | 4.00 | 4.00x |" in out.splitlines(), out
    assert "| nanovllm | 100.0 | 1.00 | 1.00x |" in out.splitlines(), out
    assert "nanovllm reaches 25.0% of the physical limit" in out, out


def test_the_steps_noted_are_the_timed_runs_own():
    """2 prompts of 6 tokens, 4 tokens each: one step prefills both, three more decode the other
    tokens, so each timed run takes 4 steps. The note read the engine's running count, which also
    held the warm-up's steps (steps=12) and, for the warm row, the cold run's (steps=16)."""
    w = datasets.build_workload("random", 2, 6, 4, vocab_size=1031)
    cold, warm = peers.run_nanovllm(w, zoo_model(MODEL), {"dtype": "float32"}, warm_repeat=True)
    assert (cold.output_tokens, warm.output_tokens) == (8, 8)
    assert cold.note == "steps=4" and warm.note == "steps=4", (cold.note, warm.note)
