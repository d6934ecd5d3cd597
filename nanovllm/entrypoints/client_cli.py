"""`nanovllm chat` and `nanovllm complete`: talk to a running OpenAI-compatible server (ours, vLLM's,
any) from the terminal, as vLLM's commands of the same names do.

    nanovllm serve &                                   # or any server with /v1/models
    nanovllm chat                                      # > lines in, streamed answers out (history kept)
    nanovllm chat -q "What is the capital of France?"  # one message, its answer, exit
    nanovllm complete -q "Once upon a time"            # a completion of a prompt

The model is the server's first (``/v1/models``) unless ``--model-name`` names one; the answers
stream as they are generated. EOF (Ctrl-D) or Ctrl-C ends a session. A server that cannot be
reached, or that refuses a request, is an error naming the URL or the server's message.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_URL = "http://localhost:8000/v1"


def add_client_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server's OpenAI API base URL (default: {DEFAULT_URL})")
    p.add_argument(
        "--model-name", default=None, help="the model to ask (default: the first the server's /v1/models lists)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the server's API key (default: $NANOVLLM_API_KEY, else $OPENAI_API_KEY, else none)",
    )
    p.add_argument(
        "-q",
        "--quick",
        metavar="TEXT",
        default=None,
        help=f"send one {what}, print the answer, exit (default: interactive)",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="the most tokens per answer (default: the server's)")


def add_client_parsers(subparsers) -> None:
    chat = subparsers.add_parser(
        "chat",
        help="chat with a running server (vLLM's `vllm chat`)",
        description="Chat with a running OpenAI-compatible server.",
    )
    add_client_args(chat, "message")
    chat.add_argument(
        "--system-prompt", default=None, help="a system message to start the conversation with (default: none)"
    )
    chat.set_defaults(func=cmd_chat)
    complete = subparsers.add_parser(
        "complete",
        help="complete prompts with a running server (vLLM's `vllm complete`)",
        description="Complete prompts with a running OpenAI-compatible server.",
    )
    add_client_args(complete, "prompt")
    complete.set_defaults(func=cmd_complete)


def connect(args: argparse.Namespace):
    """(client, model name): an OpenAI client for ``--url`` and the model to ask; a ValueError names
    the URL when the server cannot be reached or lists no model."""
    try:
        import openai
    except ImportError:
        raise ValueError("the openai package is not installed (pip install -e '.[serve]')") from None
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    key = args.api_key or os.environ.get("NANOVLLM_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
    client = openai.OpenAI(base_url=args.url, api_key=key, max_retries=0, timeout=600)
    if args.model_name is not None:
        return client, args.model_name
    try:
        models = client.models.list().data
    except openai.APIConnectionError:
        raise ValueError(f"cannot reach a server at --url {args.url} (start one with: nanovllm serve)") from None
    except openai.APIStatusError as e:
        raise ValueError(f"the server at {args.url} refused /models: {server_message(e)}") from None
    if not models:
        raise ValueError(f"the server at {args.url} lists no model")
    return client, models[0].id


def server_message(e) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return f"{e.status_code}: {body['message']}"
    return str(e)


def stream_out(chunks, text_of) -> str:
    """Print each chunk's text as it comes; the whole answer."""
    parts = []
    for chunk in chunks:
        text = text_of(chunk) if chunk.choices else None
        if text:
            print(text, end="", flush=True)
            parts.append(text)
    print(flush=True)
    return "".join(parts)


def ask(client, request) -> str:
    """Run one streamed request; the server's refusal or a lost connection as a ValueError."""
    import openai

    try:
        return request()
    except openai.APIConnectionError:
        raise ValueError(f"lost the server at {client.base_url}") from None
    except openai.APIStatusError as e:
        raise ValueError(f"the server refused the request: {server_message(e)}") from None
    except openai.APIError as e:  # an error event inside the stream (the engine failed, a shutdown)
        raise ValueError(f"the server ended the answer with an error: {e.message}") from None


def read_lines(prompt: str):
    """Input lines until EOF or Ctrl-C."""
    while True:
        try:
            yield input(prompt)
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return


def session(command: str, model: str, what: str, quick: str | None, send, refused) -> int:
    """``quick`` sent alone (a refusal ends the command with its error), else each line typed
    after ``> `` until EOF, a refused one reported (``refused()`` undoes its turn) and the session
    going on."""
    print(f"Using model: {model}", file=sys.stderr)
    if quick is not None:
        send(quick)
        return 0
    print(f"Please enter {what} (Ctrl-D to end):", file=sys.stderr)
    for line in read_lines("> "):
        try:
            send(line)
        except ValueError as e:
            refused()
            print(f"nanovllm {command}: {e}", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    client, model = connect(args)
    extra = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    conversation = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]

    def reply(message: str) -> str:
        conversation.append({"role": "user", "content": message})
        answer = ask(
            client,
            lambda: stream_out(
                client.chat.completions.create(model=model, messages=conversation, stream=True, **extra),
                lambda c: c.choices[0].delta.content,
            ),
        )
        conversation.append({"role": "assistant", "content": answer})
        return answer

    def refused() -> None:  # the session goes on without that turn (e.g. the history grew too long)
        del conversation[-1]

    return session("chat", model, "a message for the chat model", args.quick, reply, refused)


def cmd_complete(args: argparse.Namespace) -> int:
    client, model = connect(args)
    extra = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}

    def complete(prompt: str) -> str:
        return ask(
            client,
            lambda: stream_out(
                client.completions.create(model=model, prompt=prompt, stream=True, **extra), lambda c: c.choices[0].text
            ),
        )

    return session("complete", model, "a prompt", args.quick, complete, lambda: None)
