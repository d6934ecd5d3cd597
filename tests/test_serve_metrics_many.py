"""``observe_many`` (entrypoints/openai/metrics.py): n observations of a value in one update give
the exposition that n calls of prometheus_client's ``observe`` give."""

from __future__ import annotations

import bisect
import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from nanovllm.entrypoints.openai.metrics import LATENCY_BUCKETS, observe_many

CASES = [(0.0, 1), (0.001, 3), (0.0105, 2), (0.04, 5), (0.5, 1), (160.0, 2), (1e6, 4), (0.02, 0), (math.nan, 1)]


def exposition(observe) -> str:
    registry = CollectorRegistry()
    child = Histogram("itl", "itl", ["m"], buckets=LATENCY_BUCKETS, registry=registry).labels("x")
    for amount, count in CASES:
        observe(child, amount, count)
    lines = generate_latest(registry).decode().splitlines()
    return "\n".join(line for line in lines if "_created" not in line)  # a creation timestamp differs


def one_by_one(child, amount, count):
    for _ in range(count):
        child.observe(amount)


def test_observe_many_equals_repeated_observes():
    assert exposition(observe_many) == exposition(one_by_one)
    assert 'itl_count{m="x"} 18.0' in exposition(
        observe_many
    )  # NaN counts in no bucket  # not vacuous: the counts are there


def test_negative_control_a_bucket_off_at_its_bound_is_caught():
    """A version that files a value equal to a bound in the next bucket (bisect_right) differs:
    the cases hold values on bounds (0.001, 0.04, 0.5, 160.0)."""

    def off_by_one(child, amount, count):
        i = bisect.bisect_right(child._upper_bounds, amount)
        if i < len(child._buckets):
            child._buckets[i].inc(count)
        child._sum.inc(amount * count)

    assert exposition(off_by_one) != exposition(one_by_one)


def test_another_layout_falls_back_to_observe():
    class Plain:
        def __init__(self):
            self.seen = []

        def observe(self, amount):
            self.seen.append(amount)

    h = Plain()
    observe_many(h, 0.25, 3)
    assert h.seen == [0.25, 0.25, 0.25]


@pytest.mark.parametrize("count", [0, -1])
def test_no_observation_for_no_tokens(count):
    registry = CollectorRegistry()
    child = Histogram("h", "h", buckets=LATENCY_BUCKETS, registry=registry)
    observe_many(child, 0.5, count)
    assert "h_count 0.0" in generate_latest(registry).decode()
