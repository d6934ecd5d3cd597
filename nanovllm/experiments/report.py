"""What an experiment leaves behind: a header, a printed table, CSV files, PNG plots
(matplotlib, Agg backend: no display needed) and result lines computed from the data."""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from pathlib import Path


class Report:
    """Collects an experiment's outputs in ``out_dir``; ``echo`` prints (default: print)."""

    def __init__(self, out_dir: str | os.PathLike, echo: Callable[[str], None] = print):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self.files: list[Path] = []
        self.results: list[str] = []

    # ------------------------------------------------------------- text
    def header(self, number: str, title: str, look_for: list[str], setup: str) -> None:
        self.echo(f"== experiment {number}: {title}")
        for line in look_for:
            self.echo(f"   look for: {line}")
        self.echo(f"   setup: {setup}")

    def table(self, rows: list[dict], columns: list[str] | None = None) -> None:
        if not rows:
            self.echo("   (no rows)")
            return
        columns = columns or list(rows[0])
        cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
        self.echo("   " + "  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        for row in cells:
            self.echo("   " + "  ".join(v.rjust(w) for v, w in zip(row, widths)))

    def result(self, line: str) -> None:
        """A finding computed from this run's data."""
        self.results.append(line)
        self.echo(f"   result: {line}")

    # ------------------------------------------------------------- files
    def write_csv(self, name: str, rows: list[dict]) -> Path:
        path = self.out_dir / name
        columns = list(dict.fromkeys(k for r in rows for k in r))
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            for r in rows:
                w.writerow({k: _csv(v) for k, v in r.items()})
        self._wrote(path)
        return path

    def figure(self, ncols: int = 1, nrows: int = 1, size=(6.4, 3.6)):
        """A matplotlib (fig, axes) on the Agg backend."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)
        return fig, axes

    def save_figure(self, fig, name: str, title: str | None = None) -> Path:
        import matplotlib.pyplot as plt

        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        path = self.out_dir / name
        fig.savefig(path, dpi=80)
        plt.close(fig)
        self._wrote(path)
        return path

    def write_text(self, name: str, text: str) -> Path:
        path = self.out_dir / name
        path.write_text(text, encoding="utf-8")
        self._wrote(path)
        return path

    def _wrote(self, path: Path) -> None:
        self.files.append(path)
        self.echo(f"   wrote {path}")


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _csv(v):
    return f"{v:.6g}" if isinstance(v, float) else v


def ratio(a: float, b: float) -> str:
    """'3.1x' for b / a."""
    return f"{b / a:.1f}x" if a else "n/a"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def median(xs) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
