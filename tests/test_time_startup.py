"""scripts/time_startup.py: the engine's INFO lines stamped with the seconds since the script began
(the start-up measurement itself runs on a GPU host; BENCHMARKS session 23)."""

from __future__ import annotations

import logging

import pytest

from scripts import time_startup
from scripts.time_startup import FORMAT


def _record() -> logging.LogRecord:
    return logging.LogRecord("nanovllm.engine.engine", logging.INFO, __file__, 1, "engine ready", None, None)


def test_records_are_stamped_with_seconds_since_the_start(monkeypatch):
    clock = iter([12.5, 13.25])
    monkeypatch.setattr(time_startup.time, "perf_counter", lambda: next(clock))
    stamp = time_startup._Relative(start=10.0)
    first, second = _record(), _record()
    assert stamp.filter(first) and stamp.filter(second)  # stamps, never drops
    assert (first.relative, second.relative) == (2.5, 3.25)
    assert logging.Formatter(FORMAT).format(first) == "   2.50 s  nanovllm.engine.engine: engine ready"


def test_the_format_needs_the_stamp():
    # control: without the filter the script's format has no field to print
    with pytest.raises(ValueError):
        logging.Formatter(FORMAT).format(_record())
