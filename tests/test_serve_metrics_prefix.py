"""`serve --metrics-prefix vllm`: the /metrics series vLLM also exposes get vLLM's names, so
dashboards, autoscalers and routers written for vLLM read a nanovllm server as they are; the
series vLLM does not have keep ``nanovllm:``. The names are checked against vLLM's own source
where vLLM is installed (this environment or the bench's ``./.venv-vllm``)."""

from __future__ import annotations

import asyncio
import glob
import importlib.util
import re
import types
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="the server extra is not installed (pip install -e '.[serve]')")

from nanovllm.entrypoints.openai.metrics import VLLM_SERIES, ServerMetrics, series_name  # noqa: E402
from tests.test_serve_metrics_startup import STATS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def stub_engine():
    return types.SimpleNamespace(stats=dict(STATS), output_observers=[], max_model_len=64)


def families(page: str) -> set[str]:
    """The page's metric names (a counter's without the ``_total`` its TYPE line shows)."""
    return {
        name.removesuffix("_total") if kind == "counter" else name
        for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", page, re.M)
    }


def test_vllm_prefix_renames_exactly_the_series_vllm_has():
    default = families(ServerMetrics(stub_engine(), "m").render().decode())
    renamed = families(ServerMetrics(stub_engine(), "m", prefix="vllm").render().decode())
    ours = {f.split(":", 1)[1] for f in default if f.startswith("nanovllm:")}
    assert VLLM_SERIES <= ours, f"named as vLLM's but never exposed: {sorted(VLLM_SERIES - ours)}"
    assert ours - VLLM_SERIES, "every series renamed: the check below would not see one kept"
    want = {f"vllm:{s}" if s in VLLM_SERIES else f"nanovllm:{s}" for s in ours}
    assert renamed - {f for f in default if ":" not in f} == want
    assert {f for f in renamed if ":" not in f} == {f for f in default if ":" not in f}  # process_* as they were


def test_an_unknown_prefix_is_refused_by_name():
    with pytest.raises(ValueError, match="metrics prefix must be one of nanovllm, vllm, got 'prom'"):
        series_name("num_requests_running", "prom")
    from nanovllm.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-prefix", "prom"])


def test_the_app_serves_the_prefix_it_is_given():
    httpx = pytest.importorskip("httpx", reason="the serve extra (httpx) is not installed")
    pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
    from nanovllm.entrypoints.openai.api_server import build_app

    async def page(**kw) -> str:
        app = build_app(stub_engine(), ["m"], **kw)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return (await client.get("/metrics")).text

    vllm, default = asyncio.run(page(metrics_prefix="vllm")), asyncio.run(page())
    assert 'vllm:num_requests_waiting{model_name="m"} 0.0' in vllm and "nanovllm:num_requests_waiting" not in vllm
    assert 'nanovllm:engine_steps_total{model_name="m"} 0.0' in vllm  # not a vLLM series: kept
    assert "vllm:" not in default.replace("nanovllm:", "")


def vllm_metrics_source() -> str | None:
    """vLLM's v1 Prometheus logger's source, where vLLM is installed here or in ./.venv-vllm."""
    spec = importlib.util.find_spec("vllm")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    roots += [Path(p) for p in glob.glob(str(REPO / ".venv-vllm/lib/python*/site-packages/vllm"))]
    for root in roots:
        path = root / "v1" / "metrics" / "loggers.py"
        if path.exists():
            return path.read_text()
    return None


def test_the_renamed_series_are_vllms_own_names():
    source = vllm_metrics_source()
    if source is None:
        pytest.skip("vLLM is not installed here or in ./.venv-vllm (BENCHMARKS.md: the vLLM peer)")
    vllms = set(re.findall(r'name="vllm:([a-z0-9_]+)"', source))
    assert "engine_steps" not in vllms and "prefix_cache_hit_rate" not in vllms  # the control: ours alone
    assert VLLM_SERIES <= vllms, f"not vLLM's names: {sorted(VLLM_SERIES - vllms)}"
