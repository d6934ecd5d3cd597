"""Screenshots of the trace viewer's four views (for docs/img), in headless Debian Chromium.

    PYTHONPATH=. python scripts/trace_screenshots.py nanovllm-experiments/04-scheduler-watch/trace.html docs/img

The timeline and KV views are shown at the first preemption, the block tables at the first
prefix-cache hit, the requests view with the last request selected.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.browser import browser_page, chromium_path


def main(html: str, out_dir: str) -> int:
    exe = chromium_path()
    if exe is None:
        print("no chromium: apt-get install chromium (or `make browser`)", file=sys.stderr)
        return 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with browser_page(exe, width=1100, height=640) as page:
        page.goto(Path(html).resolve().as_uri())
        for key, view, jump in (("1", "timeline", "p"), ("2", "kv", "p"), ("3", "requests", None), ("4", "step", "c")):
            page.keyboard.press("Home")
            if jump:
                page.keyboard.press(jump)
            page.keyboard.press(key)
            if view == "requests":
                page.keyboard.press("End")
                page.keyboard.press("ArrowDown")
                page.keyboard.press("ArrowDown")
            path = out / f"trace-{view}.png"
            page.screenshot(path=str(path), full_page=False)
            print(f"wrote {path}")
        if page.errors:
            print(f"page errors: {page.errors}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
