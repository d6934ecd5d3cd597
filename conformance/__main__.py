"""Check an LLM inference engine against the conformance suite, and write a Markdown report.

Runs the suite's checks (pytest, in a subprocess) against one engine and, with --report, writes
one row per check with its result and key figure (max logprob difference, divergences,
preemptions seen, cached tokens, p-values), what went unchecked by capability, the failures'
messages, and the command line that reproduces the run. --notes appends a hand-written
judgement (defect of the engine or limit of the adapter).

Exit status: 0 when every check that ran passed and the engine could take at least half of
them; 1 when a check failed, the engine is unavailable here, or more than half of the checks
were skipped for missing capabilities (--allow-skips accepts that); pytest's own codes otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from conformance.plugin import STATUS, add_options, list_engines, spec_error

PACKAGE_PARENT = Path(__file__).resolve().parent.parent

EPILOG = """\
examples:
  python -m conformance --list-engines
  python -m conformance --engine hf-cb --report hf-cb.md
  python -m conformance --engine openai --report server.md
      # $OPENAI_BASE_URL (ending in /v1), $CONFORMANCE_OPENAI_MODEL (the served name), and for checks
      # against golden files $CONFORMANCE_OPENAI_MODEL_PATH (the served model's directory or golden:NAME);
      # $CONFORMANCE_OPENAI_SERVER names the server (docs: conformance/adapters/openai_adapter.py)
  python -m conformance --adapter mypkg.engine:MyAdapter -k greedy
  python -m conformance --engine vllm --report vllm.md -- -x --durations=10

Arguments this command does not know go to pytest (-k EXPR, -m MARKEXPR, -x, -n 2, ...).
Engines: built-in names, names that installed packages register in the entry-point group
nanovllm.conformance.adapters, or any EngineAdapter subclass given as --adapter module:Class.
Writing an adapter: docs/conformance/WRITING_AN_ADAPTER.md in the nanovllm repository.
"""


def engine_version(spec: str) -> str:
    from conformance.adapters import adapter_class

    try:
        return adapter_class(spec).describe()
    except Exception as e:  # noqa: BLE001 - the report still gets written
        return f"{spec} ({e})"


def parse_junit(path: Path) -> list[dict]:
    rows = []
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        row: dict = {
            "check": f"{module}::{case.get('name')}",
            "seconds": float(case.get("time", 0)),
            "result": "pass",
            "message": "",
            "figures": {},
            "status": None,
        }
        for prop in case.iter("property"):
            if prop.get("name") == STATUS:
                row["status"] = prop.get("value")
            else:
                row["figures"][prop.get("name")] = prop.get("value")
        for tag, result in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "skip")):
            el = case.find(tag)
            if el is not None:
                row["result"] = result
                row["message"] = (el.get("message") or el.text or "").strip()
                break
        rows.append(row)
    return rows


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit] + " ..."


def tally(rows: list[dict]) -> dict:
    """checked / failed / unchecked by capability / skipped for reasons that are not the engine's,
    of the checks that run the engine; the suite's self-tests (no engine) apart."""
    engine_rows = [r for r in rows if not (r["status"] or "").startswith("self-test:")]
    unchecked = Counter(
        r["status"].split(":", 1)[1] for r in engine_rows if (r["status"] or "").startswith("unchecked:")
    )
    return {
        "passed": sum(r["result"] == "pass" for r in engine_rows),
        "failed": sum(r["result"] in ("FAIL", "ERROR") for r in engine_rows),
        "unchecked": unchecked,
        "other_skips": sum(
            r["result"] == "skip" and not (r["status"] or "").startswith("unchecked:") for r in engine_rows
        ),
        "self_tests": Counter(r["result"] for r in rows if (r["status"] or "").startswith("self-test:")),
    }


def command_line(argv: list[str]) -> str:
    """The command that reproduces this run ($CONFORMANCE_COMMAND when a wrapper started it)."""
    return os.environ.get("CONFORMANCE_COMMAND") or shlex.join(["python", "-m", "conformance", *argv])


def write_report(
    rows: list[dict], engine: str, out: Path, argv: list[str], wall: float, notes: str, exit_status: int
) -> None:
    t = tally(rows)
    n_un = sum(t["unchecked"].values())
    by_cap = ", ".join(f"`{cap}` x{n}" for cap, n in sorted(t["unchecked"].items(), key=lambda kv: -kv[1]))
    self_tests = ", ".join(f"{n} {result}" for result, n in sorted(t["self_tests"].items()))
    lines = [
        f"# Conformance report: `{engine}`",
        "",
        f"- engine: {engine_version(engine)}",
        f"- date: {datetime.date.today().isoformat()}; machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs, {platform.system()}; python {platform.python_version()}",
        f"- command: `{command_line(argv)}`",
        f"- result: {t['passed']} checked and passed, {t['failed']} failed, {n_un} unchecked "
        f"(skipped for a missing capability{': ' + by_cap if by_cap else ''}), "
        f"{t['other_skips']} skipped for reasons that are not the engine's (see the skipped rows); "
        f"rule self-tests (no engine): {self_tests or 'none ran'}; "
        f"exit status {exit_status}; wall time {wall:.0f} s",
        "",
        "| check | result | key figure | seconds |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        figs = "; ".join(f"{k}: {v}" for k, v in r["figures"].items())
        if r["result"] == "skip":
            figs = figs or _one_line(r["message"].removeprefix("Skipped: "), 120)
        lines.append(f"| {r['check']} | {r['result']} | {figs} | {r['seconds']:.1f} |")
    failed = [r for r in rows if r["result"] in ("FAIL", "ERROR")]
    if failed:
        lines += ["", "## Failures", ""]
        lines += [f"- **{r['check']}**: {_one_line(r['message'], 600)}" for r in failed]
    if notes:
        lines += ["", notes.strip()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m conformance",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--engine",
        default=os.environ.get("CONFORMANCE_ENGINE", "nanovllm"),
        help="engine to check (see --list-engines; default nanovllm, env CONFORMANCE_ENGINE)",
    )
    ap.add_argument(
        "--adapter", metavar="MODULE:CLASS", help="an EngineAdapter subclass to check instead of a named engine"
    )
    ap.add_argument("--report", type=Path, help="write the Markdown report here")
    ap.add_argument("--notes", type=Path, help="Markdown appended to the report (the judgement)")
    ap.add_argument(
        "--allow-skips",
        action="store_true",
        help="exit 0 even when the engine is unavailable or most checks were skipped for missing capabilities",
    )
    ap.add_argument("--list-engines", action="store_true", help="list the known engines and exit")
    add_options(ap.add_argument)
    return ap


def report_error(report: Path) -> str | None:
    """Why --report cannot be written (found before the run, not after it), or None."""
    existed = report.exists()
    try:
        report.parent.mkdir(parents=True, exist_ok=True)
        with open(report, "a"):
            pass
    except OSError as e:
        return f"--report {report}: cannot write there ({e.strerror or e}); give a writable path"
    if not existed:
        report.unlink()
    return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, pytest_args = build_parser().parse_known_args(argv)
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    if args.list_engines:
        print(list_engines())
        return 0
    spec = args.adapter or args.engine
    problem = spec_error(args.engine, args.adapter)
    if args.notes and not args.notes.is_file():
        problem = f"--notes {args.notes}: no such file"
    elif args.report and not problem:
        problem = report_error(args.report)
    if problem:
        print(f"python -m conformance: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="conformance-report-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "conformance",
            "-p",
            "conformance.plugin",
            "--adapter" if args.adapter else "--engine",
            spec,
            f"--junitxml={xml}",
            "-o",
            "junit_family=xunit1",
            "-p",
            "no:cacheprovider",
            "-q",
            *(["--allow-skips"] if args.allow_skips else []),
            *(["--block-size", str(args.block_size)] if args.block_size else []),
            f"--device={args.device}",
            f"--check-timeout={args.check_timeout:g}",
            *pytest_args,
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_PARENT), env.get("PYTHONPATH")) if p)
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env)
        wall = time.perf_counter() - start
        if not xml.is_file():
            print(f"pytest wrote no results (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode or 1
        rows = parse_junit(xml)
    if args.report:
        notes = args.notes.read_text() if args.notes else ""
        write_report(rows, spec, args.report, argv, wall, notes, proc.returncode)
        print(f"wrote {args.report} ({len(rows)} checks)")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
