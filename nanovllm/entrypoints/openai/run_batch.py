"""`nanovllm run-batch -i requests.jsonl -o results.jsonl [engine flags]`: a file of OpenAI batch
requests run offline, each answered as the server would answer it (vLLM's ``run-batch``).

Input, one JSON object per line (OpenAI's Batch API format)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}

``url`` is ``/v1/chat/completions`` or ``/v1/completions``; ``body`` is that endpoint's request.
The whole file is checked before the model loads: a line that is not JSON, lacks a field, repeats
a ``custom_id`` or names another method or URL stops the run, naming the line. A request the
server would refuse (a bad value, ``stream: true``) is answered with the server's error object.

Output, one line per input line, in the input's order::

    {"id": "batch-...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "...",
     "body": {...the endpoint's response...}}, "error": null}

An error line has the status and the error object in ``response`` (OpenAI's form) and in
``error`` (vLLM's). Every request goes to the engine at once, so they are batched together; the
output file appears whole when the run ends (written beside it, then renamed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import uuid

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def add_run_batch_parser(subparsers) -> argparse.ArgumentParser:
    from nanovllm.entrypoints.args import add_engine_args

    p = subparsers.add_parser(
        "run-batch",
        help="run a file of OpenAI batch requests (JSONL) offline, as the server answers them",
        description="Run a file of OpenAI batch requests (JSON Lines: custom_id, method, url, body) offline; "
        "write one result line per request, in order.",
    )
    p.add_argument(
        "-i", "--input-file", required=True, metavar="FILE", help="requests, one JSON object per line ('-': stdin)"
    )
    p.add_argument(
        "-o", "--output-file", required=True, metavar="FILE", help="results, one JSON object per line ('-': stdout)"
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) a request's 'model' may give (default: MODEL as given, or SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="sampling defaults for fields a request leaves out, as `serve` takes them (default: auto)",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="sampling defaults over --generation-config's, e.g. '{\"temperature\": 0}' (default: none)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a chat template (jinja2) instead of the model's own, by its file's path or as its text (default: the model's)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar (on stderr) (default: shown)")
    add_engine_args(p)
    p.set_defaults(func=cmd_run_batch)
    return p


def read_batch(path: str) -> list[dict]:
    """The input file's requests ({"custom_id", "url", "body"}), checked line by line; a ValueError
    names the first bad line (1-based) and what is wrong with it."""
    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"--input-file {path!r}: cannot read it ({e.strerror})") from None
    requests: list[dict] = []
    seen: dict[str, int] = {}
    # lines end at "\n" only: JSON strings may hold U+2028, U+2029 and U+0085 as they are, which
    # str.splitlines() would take for line breaks
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        where = f"--input-file {path!r}, line {number}"
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: a request is a JSON object, got {type(item).__name__}")
        for key in ("custom_id", "method", "url", "body"):
            if key not in item:
                raise ValueError(f"{where}: no {key!r} (a request has custom_id, method, url and body)")
        custom_id = item["custom_id"]
        if not isinstance(custom_id, str) or not custom_id:
            raise ValueError(f"{where}: custom_id must be a non-empty string, got {custom_id!r}")
        if custom_id in seen:
            raise ValueError(f"{where}: custom_id {custom_id!r} repeats line {seen[custom_id]}'s (each must be unique)")
        seen[custom_id] = number
        if item["method"] != "POST":
            raise ValueError(f"{where}: method must be 'POST', got {item['method']!r}")
        if item["url"] not in ENDPOINTS:
            raise ValueError(f"{where}: url must be one of {', '.join(ENDPOINTS)}, got {item['url']!r}")
        if not isinstance(item["body"], dict):
            raise ValueError(f"{where}: body must be a JSON object, got {type(item['body']).__name__}")
        requests.append({"custom_id": custom_id, "url": item["url"], "body": item["body"]})
    if not requests:
        raise ValueError(f"--input-file {path!r}: no requests in it")
    return requests


def result_line(custom_id: str, status: int, body: dict, error: dict | None) -> str:
    """One output line (JSON, no newline). A value JSON cannot hold (a NaN or an infinite logprob)
    makes it a 500 error line instead, as the server's JSON response refuses one too."""
    line = {
        "id": f"batch-{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": f"batch-req-{uuid.uuid4().hex}", "body": body},
        "error": error,
    }
    try:
        return json.dumps(line, ensure_ascii=False, allow_nan=False)
    except ValueError as e:
        from nanovllm.entrypoints.openai.protocol import OpenAIError

        problem = OpenAIError(500, f"the response is not valid JSON: {e}").body()
        return result_line(custom_id, 500, problem, problem)


async def answer(engine, request: dict, served: list[str], max_model_len: int, defaults: dict, chat_template) -> str:
    """One request's result line (JSON): the endpoint's response, or its error object (a 4xx as the
    server gives it; never an exception)."""
    from pydantic import ValidationError

    from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
    from nanovllm.entrypoints.openai.request_errors import validation_error
    from nanovllm.entrypoints.openai.serving_chat import create_chat_completion
    from nanovllm.entrypoints.openai.serving_completion import create_completion

    chat = request["url"] == "/v1/chat/completions"
    try:
        req: ChatCompletionRequest | CompletionRequest
        try:
            req = (ChatCompletionRequest if chat else CompletionRequest).model_validate(request["body"])
        except ValidationError as e:
            raise validation_error([dict(err) for err in e.errors()]) from None
        if req.stream:
            raise OpenAIError(400, "stream must be false in a batch: each result is written whole", "stream")
        if engine.errored is not None:
            raise OpenAIError(503, f"the engine failed and serves no more requests: {engine.errored!r}")
        if isinstance(req, ChatCompletionRequest):
            body = await create_chat_completion(engine, req, served, max_model_len, defaults, chat_template)
        else:
            body = await create_completion(engine, req, served, max_model_len, defaults)
    except OpenAIError as e:
        return result_line(request["custom_id"], e.status, e.body(), e.body())
    except Exception as e:  # noqa: BLE001 - one request's fault is its own line (the server's 500), never the batch's
        logging.getLogger(__name__).exception("request %r failed", request["custom_id"])
        problem = OpenAIError(500, f"internal error: {type(e).__name__}: {e}").body()
        return result_line(request["custom_id"], 500, problem, problem)
    return result_line(request["custom_id"], 200, body, None)


async def run_batch(
    engine, requests: list[dict], served: list[str], defaults: dict, chat_template, progress: bool
) -> list[str]:
    """Every request at once (the engine batches them); the result lines in the requests' order."""
    import asyncio

    from tqdm.auto import tqdm

    with tqdm(total=len(requests), unit="req", desc="Running batch", disable=not progress, file=sys.stderr) as bar:

        async def one(request: dict) -> str:
            line = await answer(engine, request, served, engine.max_model_len, defaults, chat_template)
            bar.update()
            return line

        return await asyncio.gather(*(one(r) for r in requests))


class ResultFile:
    """The output file, made before the model loads (a path that cannot be written fails then, not
    after the run): the lines go to a temporary file beside it, renamed over it once whole. If the
    rename fails the temporary file is kept and named, so no result is lost. ``-``: stdout."""

    def __init__(self, path: str) -> None:
        self.path, self.tmp, self.file = path, None, sys.stdout
        if path == "-":
            return
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ValueError(f"--output-file {path!r} is a folder: name a file")
        if not os.path.isdir(folder):
            raise ValueError(f"--output-file {path!r}: its folder {folder!r} does not exist")
        try:
            fd, self.tmp = tempfile.mkstemp(prefix=".run-batch-", suffix=".jsonl", dir=folder)
        except OSError as e:
            raise ValueError(f"--output-file {path!r}: cannot write in {folder!r} ({e.strerror})") from None
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # a plain file's mode, not mkstemp's 0600
        self.file = os.fdopen(fd, "w", encoding="utf-8")

    def write(self, lines: list[str]) -> None:
        self.file.write("".join(line + "\n" for line in lines))
        self.file.flush()
        if self.tmp is None:
            return
        os.fsync(self.file.fileno())
        self.file.close()
        try:
            os.replace(self.tmp, self.path)
        except OSError as e:
            raise ValueError(
                f"--output-file {self.path!r}: cannot replace it ({e.strerror}); the results are in {self.tmp}"
            ) from None
        self.tmp = None

    def discard(self) -> None:
        """A run that ended without results: no temporary file left behind."""
        if self.tmp is not None:
            self.file.close()
            os.unlink(self.tmp)
            self.tmp = None


def cmd_run_batch(args: argparse.Namespace) -> int:
    """Check the input and the flags, load the model, answer every request, write the results;
    exit status 0 when the file was written (whatever each request's status), 1 when the engine
    failed during the run (its requests' lines say 503)."""
    import asyncio

    from nanovllm.entrypoints.args import engine_kwargs
    from nanovllm.entrypoints.chat_template import load_chat_template
    from nanovllm.entrypoints.openai.generation_defaults import sampling_defaults
    from nanovllm.loader.model_loader import resolve_model_dir

    requests = read_batch(args.input_file)
    chat_template = load_chat_template(args.chat_template)
    out = ResultFile(args.output_file)
    try:
        defaults = sampling_defaults(
            args.generation_config, args.override_generation_config, resolve_model_dir(args.model)
        )
        from nanovllm.engine.async_llm import AsyncLLM
        from nanovllm.entrypoints.openai.cli_args import served_names

        engine = AsyncLLM.from_engine_args(args.model, **engine_kwargs(args))
        try:
            lines = asyncio.run(
                run_batch(engine, requests, served_names(args), defaults, chat_template, not args.no_progress)
            )
            out.write(lines)  # before the shutdown: a failing one loses nothing
            engine_failed = engine.errored is not None
        finally:
            engine.shutdown()
    finally:
        out.discard()
    failed = sum(json.loads(line)["error"] is not None for line in lines)
    logging.getLogger(__name__).info("%d requests, %d answered, %d errors", len(lines), len(lines) - failed, failed)
    if failed:
        print(f"nanovllm run-batch: {failed} of {len(lines)} requests failed (see their 'error')", file=sys.stderr)
    if engine_failed:
        print("nanovllm run-batch: the engine failed during the run", file=sys.stderr)
        return 1
    return 0
