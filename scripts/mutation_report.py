"""Summarise a mutmut run over the torch-free core (``make mutation``) and check its kill rate.

    python scripts/mutation_report.py [--mutants mutants] [--equivalent FILE] [--markdown] [--check]

mutmut 3 leaves one ``<module>.py.meta`` (JSON) per mutated file under ``mutants/``: the exit
status of the tests for each mutant. This script counts per module: killed (the tests failed),
timeout (the tests ran past mutmut's limit: the mutant was noticed), survived, no tests (no
test reaches the function), other (suspicious, skipped, segfault), and not checked (the run did
not get to it). Survivors listed in the committed triage file (``--equivalent``, one
``<mutant name>  <reason>`` per line) are *equivalent*: no test can tell them from the original,
for the reason given. They leave the denominator:

    kill rate = (killed + timeout) / (mutants - equivalent - not checked)

``--check`` exits 1 when the kill rate is below ``--min-kill-rate`` (0.90), when a mutant was not
checked (a partial run), or when the triage file is stale (it names a mutant that does not exist
or that the tests now kill: the list must say only what is true of this run).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

# mutmut 3's exit statuses (mutmut/stats.py: status_by_exit_code)
KILLED = {1, 3}
SURVIVED = {0}
NO_TESTS = {5, 33}
TIMEOUT = {36, 24, -24, 152, 255}
NOT_CHECKED = {None}

DEFAULT_EQUIVALENT = "docs/conformance/mutation_equivalent.txt"


@dataclass
class ModuleCounts:
    module: str
    total: int = 0
    killed: int = 0
    timeout: int = 0
    survived: int = 0
    equivalent: int = 0
    no_tests: int = 0
    other: int = 0
    not_checked: int = 0
    survivors: list[str] = field(default_factory=list)  # survived and not triaged as equivalent

    @property
    def considered(self) -> int:
        return self.total - self.equivalent - self.not_checked

    @property
    def kill_rate(self) -> float | None:
        return (self.killed + self.timeout) / self.considered if self.considered else None


def read_equivalent(path: Path) -> dict[str, str]:
    """mutant name -> reason, from lines ``<name> <reason>`` ('#' starts a comment line)."""
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition(" ")
        if not reason.strip():
            raise ValueError(f"{path}:{lineno}: an equivalent mutant needs a reason, got {line!r}")
        if name in out:
            raise ValueError(f"{path}:{lineno}: {name} is listed twice")
        out[name] = reason.strip()
    return out


def read_results(mutants: Path) -> dict[str, dict[str, int | None]]:
    """module -> {mutant name: exit status}, from mutmut's .meta files."""
    results: dict[str, dict[str, int | None]] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        module = ".".join(meta.relative_to(mutants).with_suffix("").with_suffix("").parts)
        exit_codes = json.loads(meta.read_text(encoding="utf-8"))["exit_code_by_key"]
        if exit_codes:
            results[module] = exit_codes
    return results


def summarise(
    results: dict[str, dict[str, int | None]], equivalent: dict[str, str]
) -> tuple[list[ModuleCounts], list[str]]:
    """Per-module counts, and the stale triage entries (unknown mutants, or ones that do not survive)."""
    counts = []
    seen = {}
    for module, exit_codes in sorted(results.items()):
        c = ModuleCounts(module)
        for name, code in sorted(exit_codes.items()):
            seen[name] = code
            c.total += 1
            if code in KILLED:
                c.killed += 1
            elif code in TIMEOUT:
                c.timeout += 1
            elif code in SURVIVED:
                if name in equivalent:
                    c.equivalent += 1
                else:
                    c.survived += 1
                    c.survivors.append(name)
            elif code in NO_TESTS:
                c.no_tests += 1
            elif code in NOT_CHECKED:
                c.not_checked += 1
            else:
                c.other += 1
        counts.append(c)
    stale = []
    for name in equivalent:
        if name not in seen:
            stale.append(f"{name}: no such mutant in this run")
        elif seen[name] not in SURVIVED and seen[name] not in NOT_CHECKED:
            stale.append(f"{name}: listed as equivalent but exit status {seen[name]} (not a survivor)")
    return counts, stale


def total_of(counts: list[ModuleCounts]) -> ModuleCounts:
    t = ModuleCounts("total")
    for c in counts:
        for f in ("total", "killed", "timeout", "survived", "equivalent", "no_tests", "other", "not_checked"):
            setattr(t, f, getattr(t, f) + getattr(c, f))
        t.survivors += c.survivors
    return t


def table(counts: list[ModuleCounts], markdown: bool) -> str:
    head = [
        "module",
        "mutants",
        "killed",
        "timeout",
        "survived",
        "equivalent",
        "no tests",
        "other",
        "not checked",
        "kill rate",
    ]
    rows = []
    for c in counts + [total_of(counts)]:
        rate = "n/a" if c.kill_rate is None else f"{100 * c.kill_rate:.1f} %"
        rows.append(
            [c.module, c.total, c.killed, c.timeout, c.survived, c.equivalent, c.no_tests, c.other, c.not_checked, rate]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
        lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(r, widths)) for r in [head] + rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", default="mutants", help="mutmut's working copy (default: mutants)")
    ap.add_argument("--equivalent", default=DEFAULT_EQUIVALENT, help="the triage file of equivalent mutants")
    ap.add_argument("--min-kill-rate", type=float, default=0.90)
    ap.add_argument(
        "--max-survivors",
        type=int,
        default=0,
        help="survivors not triaged as equivalent that --check lets pass (default 0: each new survivor is "
        "killed by a test or triaged, so none goes unseen under a kill rate that still clears the minimum)",
    )
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument(
        "--check",
        action="store_true",
        help="exit 1 below --min-kill-rate, above --max-survivors, on unchecked mutants, or on a stale triage file",
    )
    args = ap.parse_args(argv)

    mutants = Path(args.mutants)
    results = read_results(mutants)
    if not results:
        print(f"no mutmut results under {mutants}/ (run `make mutation` first)", file=sys.stderr)
        return 1
    counts, stale = summarise(results, read_equivalent(Path(args.equivalent)))
    total = total_of(counts)
    print(table(counts, args.markdown))
    if total.survivors:
        print(
            f"\n{len(total.survivors)} survivors not triaged (add a test that kills each, or list it "
            f"in {args.equivalent} with the reason it is equivalent):"
        )
        for name in total.survivors:
            print(f"  {name}")
    for line in stale:
        print(f"stale triage entry: {line}")
    rate = total.kill_rate
    print(
        f"\nkill rate of non-equivalent mutants: "
        f"{'n/a' if rate is None else f'{100 * rate:.1f} %'} (minimum {100 * args.min_kill_rate:.0f} %)"
    )
    if not args.check:
        return 0
    failures = []
    if rate is None or rate < args.min_kill_rate:
        failures.append("kill rate below the minimum")
    if len(total.survivors) > args.max_survivors:
        failures.append(f"{len(total.survivors)} survivors not triaged (at most {args.max_survivors})")
    if total.not_checked:
        failures.append(f"{total.not_checked} mutants not checked (a partial run)")
    if stale:
        failures.append(f"{len(stale)} stale triage entries")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
