"""``python -m conformance --engine NAME --report FILE.md [--notes NOTES.md] [pytest args...]``

Runs the conformance checks against one engine (pytest, in a subprocess) and writes a Markdown
report: one row per check with its result and key figure (max logprob difference, divergences,
preemptions seen, cached tokens, p-values), then the messages of the failures and skips.
``--notes`` appends a hand-written judgement (defect of the engine or limit of the adapter).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def engine_version(name: str) -> str:
    from conformance.adapters import adapter_class

    cls = adapter_class(name)
    describe = getattr(cls, "describe", None)
    return describe() if describe else name


def parse_junit(path: Path) -> list[dict]:
    rows = []
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        row = {"check": f"{module}::{case.get('name')}", "seconds": float(case.get("time", 0)),
               "result": "pass", "message": "", "figures": {}}
        for prop in case.iter("property"):
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


def write_report(rows: list[dict], engine: str, out: Path, argv: list[str], wall: float, notes: str) -> None:
    counts = {k: sum(r["result"] == k for r in rows) for k in ("pass", "FAIL", "ERROR", "skip")}
    lines = [f"# Conformance report: `{engine}`", "",
             f"- engine: {engine_version(engine)}",
             f"- date: {datetime.date.today().isoformat()}; machine: {platform.machine()}, "
             f"{os.cpu_count()} CPUs, {platform.system()}; python {platform.python_version()}",
             f"- command: `python -m conformance {' '.join(argv)}`",
             f"- result: {counts['pass']} passed, {counts['FAIL'] + counts['ERROR']} failed, "
             f"{counts['skip']} skipped; wall time {wall:.0f} s", "",
             "| check | result | key figure | seconds |", "| --- | --- | --- | --- |"]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="nanovllm")
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--notes", type=Path, help="Markdown appended to the report (the judgement)")
    args, pytest_args = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="conformance-report-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", str(ROOT / "conformance"), "--engine", args.engine,
               f"--junitxml={xml}", "-o", "junit_family=xunit1", "-p", "no:cacheprovider", "-q",
               *pytest_args]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        wall = time.perf_counter() - start
        if not xml.is_file():
            print(f"pytest wrote no results (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode or 1
        rows = parse_junit(xml)
    notes = args.notes.read_text() if args.notes else ""
    write_report(rows, args.engine, args.report, sys.argv[1:] if argv is None else list(argv), wall, notes)
    print(f"wrote {args.report} ({len(rows)} checks)")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
