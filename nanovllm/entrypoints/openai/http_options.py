"""The server's HTTP options beside the API: CORS for browser clients and TLS, with vLLM's flags.

``--allowed-origins '["https://app.example"]'`` answers cross-origin requests from those origins
(``--allowed-methods``, ``--allowed-headers`` and ``--allow-credentials`` as in vLLM and Starlette's
``CORSMiddleware``). vLLM allows every origin by default; this server allows none until asked (a
page in the user's browser could otherwise read what a server on 127.0.0.1 answers).
``--ssl-keyfile`` and ``--ssl-certfile`` serve HTTPS; ``--disable-uvicorn-access-log`` drops
uvicorn's line per request. Each flag is checked before the model loads, naming itself.

Imports nothing heavy: the CLI reads the flags before FastAPI is imported.
"""

from __future__ import annotations

import json
import os

ALL = ["*"]


def json_list(value: str, flag: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form: ``'["https://a.example", "http://b"]'``)."""
    try:
        items = json.loads(value)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) and item for item in items):
        raise ValueError(f"{flag} must be a JSON list of non-empty strings, e.g. '[\"*\"]', got {value!r}")
    return items


def http_options(args) -> dict:
    """The checked options of ``serve``'s flags: {"cors": None or CORSMiddleware's arguments,
    "ssl_keyfile", "ssl_certfile", "access_log"}; a ValueError names a bad flag."""
    origins = json_list(args.allowed_origins, "--allowed-origins")
    cors = None
    if origins:
        cors = {
            "allow_origins": origins,
            "allow_methods": json_list(args.allowed_methods, "--allowed-methods"),
            "allow_headers": json_list(args.allowed_headers, "--allowed-headers"),
            "allow_credentials": bool(args.allow_credentials),
        }
    elif (
        args.allow_credentials
        or json_list(args.allowed_methods, "--allowed-methods") != ALL
        or json_list(args.allowed_headers, "--allowed-headers") != ALL
    ):
        raise ValueError("--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins")
    key, cert = args.ssl_keyfile, args.ssl_certfile
    if (key is None) != (cert is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS, or neither")
    for flag, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r}: no such file")
    if cert is not None:
        check_tls_pair(key, cert)
    return {"cors": cors, "ssl_keyfile": key, "ssl_certfile": cert, "access_log": not args.disable_uvicorn_access_log}


def check_tls_pair(key: str, cert: str) -> None:
    """The key and certificate load together (a pair, PEM, the key not encrypted: the server starts
    unattended), checked before the model loads rather than by uvicorn after it."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # an encrypted key fails, never prompts
    except (ssl.SSLError, OSError) as e:
        raise ValueError(
            f"--ssl-keyfile {key!r} and --ssl-certfile {cert!r} do not load as a TLS key and certificate "
            f"(PEM, a matching pair, the key not encrypted): {e}"
        ) from None


def scheme(options: dict | None) -> str:
    return "https" if options and options.get("ssl_certfile") else "http"


def uvicorn_options(options: dict | None) -> dict:
    """uvicorn.Config's keyword arguments for the options (TLS, the access log)."""
    if not options:
        return {}
    return {
        "ssl_keyfile": options["ssl_keyfile"],
        "ssl_certfile": options["ssl_certfile"],
        "access_log": options["access_log"],
    }


def add_cors(app, options: dict | None) -> None:
    """CORS outside every other middleware: a browser's preflight (OPTIONS, no API key) is answered
    here, and an error (a 401 too) carries the headers the page needs to read it."""
    if options and options.get("cors"):
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, **options["cors"])
