"""`nanovllm generate | bench | serve | experiment | trace`: the command line.

Engine and sampling flags are derived from EngineConfig's and SamplingParams' fields
(``entrypoints/args.py``): types from the annotations, help from the field docstrings,
defaults from the field defaults (the CLI's sampling defaults are the API's). Global flags
(``--log-level``) are accepted before or after the subcommand. A subcommand is one entry of
``SUBCOMMANDS``: a name, a one-line help, a function adding its flags, and the function that
runs it (``args -> exit status``). Heavy modules (torch, the engine) are imported only when a
command runs, so ``--help`` is instant.

Exit status: 0 done, 2 bad input (the message on stderr names the field or file), 130 when
interrupted (Ctrl-C: the finished results are printed, the other requests are aborted).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NamedTuple, NoReturn

import nanovllm
from nanovllm.engine.interrupts import deferred_interrupts
from nanovllm.entrypoints.args import add_engine_args, add_sampling_args, engine_kwargs, sampling_params

__all__ = [
    "main",
    "build_parser",
    "SUBCOMMANDS",
    "Subcommand",
    "add_engine_args",
    "add_sampling_args",
    "engine_kwargs",
    "sampling_params",
]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
STDIN = "-"


class CommandParser(argparse.ArgumentParser):
    """argparse whose errors are one line, as the engine's own value errors are: what was wrong and
    where to look, not the whole usage block (~25 lines for ``generate``) above it. Subcommands'
    parsers are of this class too (argparse makes them of their parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if not hasattr(ns, "_deepest_parser"):  # the innermost subcommand's parser sets it first
            ns._deepest_parser = self
        return ns, extras

    def parse_args(self, args=None, namespace=None):
        """argparse's, except that unknown flags are reported by the subcommand they were given
        to (``nanovllm generate --bogus`` points to ``nanovllm generate --help``), not the top."""
        ns, extras = self.parse_known_args(args, namespace)
        parser = vars(ns).pop("_deepest_parser", self)
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns


class Subcommand(NamedTuple):
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ------------------------------------------------------------------ generate
def _read_lines(stream) -> list[str]:
    return [line.rstrip("\n") for line in stream if line.strip()]


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt arguments, in order; ``-`` (an argument, or --prompts-file -) reads stdin,
    one prompt per line."""
    prompts: list[str] = []
    for p in args.prompts:
        prompts += _read_lines(sys.stdin) if p == STDIN else [p]
    if args.prompts_file == STDIN:
        prompts += _read_lines(sys.stdin)
    elif args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += _read_lines(f)
        except OSError as e:
            raise FileNotFoundError(f"--prompts-file {args.prompts_file!r}: {e.strerror}") from None
    if not prompts:
        raise ValueError("give at least one prompt (as an argument, with --prompts-file, or '-' for stdin)")
    return prompts


def _format_logprobs(completion, k: int) -> list[str]:
    """One line per output token: the token, its logprob and rank, then the top k."""
    lines = []
    for pos, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs or [])):
        chosen = entry[token]
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:k]
        alts = ", ".join(f"{lp.decoded_token!r} {lp.logprob:.4f}" for lp in top)
        lines.append(
            f"  [{pos}] {chosen.decoded_token!r} {chosen.logprob:.4f} (rank {chosen.rank})"
            + (f" | top: {alts}" if alts else "")
        )
    return lines


class ResultPrinter:
    """Prints results in input order, each as soon as every earlier one is printed; ``flush``
    prints the finished rest (after Ctrl-C). ``--json``: one JSON object per request and line
    (JSON Lines), every RequestOutput field (``dataclasses.asdict``); the CLI's request ids are
    the input indices."""

    def __init__(self, prompts: list[str], args: argparse.Namespace):
        self.prompts = prompts
        self.args = args
        self.next = 0
        self.pending: dict = {}
        self.printed = 0

    def add(self, index: int, out) -> None:
        self.pending[index] = out
        while self.next in self.pending:
            with deferred_interrupts():  # a result is printed whole, and counted, or not at all
                self._print(self.next, self.pending.pop(self.next))
                self.next += 1

    def flush(self) -> None:
        for index in sorted(self.pending):
            self._print(index, self.pending.pop(index))

    def _print(self, index: int, out) -> None:
        self.printed += 1
        if self.args.json:
            self._emit(json.dumps(dataclasses.asdict(out), ensure_ascii=False))
            return
        lines = []
        several = len(out.outputs) > 1
        if len(self.prompts) > 1 or self.args.verbose or several:
            lines.append(f"=== [{index}] {self.prompts[index]}")
        for c in out.outputs:
            if len(self.prompts) > 1 or self.args.verbose or several:
                label = f"completion {c.index}, " if several else ""
                lines.append(f"--- ({label}{c.finish_reason}, {len(c.token_ids)} tokens)")
            lines.append(c.text)
            if c.logprobs is not None:
                lines.append("logprobs:")
                lines.extend(_format_logprobs(c, self.args.sampling_logprobs))
        self._emit("\n".join(lines))

    def _emit(self, text: str) -> None:
        """A result on stdout; with the progress bar (stderr) shown, above it (tqdm.write clears
        the bar, writes, redraws it), so a result never runs on from the bar's line."""
        if getattr(self.args, "no_progress", True):
            print(text, flush=True)
        else:
            from tqdm.auto import tqdm

            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()


def add_generate_args(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt strings ('-': one prompt per line of stdin)")
    gen.add_argument(
        "--prompts-file", metavar="FILE", help="a file with one prompt per line ('-': stdin) (default: none)"
    )
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="with --chat: a chat template (jinja2), by its file's path or as its text, instead of the model's "
        "own (default: the model's)",
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print each result as one JSON line with every RequestOutput field (JSON Lines)",
    )
    gen.add_argument(
        "--trace",
        action="store_true",
        help="print the scheduler's per-step trace, and the engine stats at the end, to stderr",
    )
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar (on stderr)")
    gen.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print prompt headers even for one prompt, and the engine stats (stderr) at the end",
    )
    add_sampling_args(gen)
    add_engine_args(gen)


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    params = sampling_params(args)  # bad sampling flags fail before the model loads
    if args.chat_template is not None and not args.chat:
        raise ValueError("--chat-template applies to chat prompts: add --chat")
    from nanovllm.entrypoints.chat_template import load_chat_template

    chat_template = load_chat_template(args.chat_template)
    watch_other_load()
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    from nanovllm.llm import LLM

    def trace(event) -> None:  # trace lines go above the progress bar, never glued to it
        tqdm.write(event.format(), file=sys.stderr)

    llm = LLM(args.model, trace=trace if args.trace else False, **engine_kwargs(args))
    printer = ResultPrinter(prompts, args)
    interrupted = False
    try:
        with logging_redirect_tqdm():
            requests = (
                llm.chat_prompts([[{"role": "user", "content": p}] for p in prompts], chat_template=chat_template)
                if args.chat
                else prompts
            )
            with contextlib.closing(llm.generate_iter(requests, params, use_tqdm=not args.no_progress)) as outputs:
                for index, out in outputs:
                    printer.add(index, out)
    except KeyboardInterrupt:  # the iterator has aborted the unfinished requests
        interrupted = True
    finally:
        with _sigint_ignored():  # a second Ctrl-C must not break the clean-up
            printer.flush()
            if args.trace or args.verbose:
                print(f"stats: {llm.stats()}", file=sys.stderr)
            llm.close()
    if interrupted:
        print(
            f"nanovllm: interrupted: {printer.printed} of {len(prompts)} requests finished and printed, "
            f"the other {len(prompts) - printer.printed} aborted",
            file=sys.stderr,
        )
        return 130
    return 0


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored for the block (main thread only), the previous handler restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# --------------------------------------------------------------------- bench
def add_bench_args(bench: argparse.ArgumentParser) -> None:
    from nanovllm.bench.args import add_bench_args as add

    add(bench)
    add_engine_args(bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from nanovllm.bench.run import run_bench

    return run_bench(args)


# ------------------------------------------------------- experiment, trace
def add_experiment_args(exp: argparse.ArgumentParser) -> None:
    from nanovllm.experiments.runner import add_experiment_args as add

    add(exp)
    add_engine_args(exp)


def watch_other_load() -> None:
    """Over torch's import, before a command's first engine: its default thread count then leaves
    out the cores other processes keep busy (``cpu_threads``; on a busy 2-core machine an
    experiment took 46-50 s on 2 threads, 2.7 s on 1)."""
    from nanovllm.cpu_threads import watch_other_load as watch

    watch()


def cmd_experiment(args: argparse.Namespace) -> int:
    if args.experiment != "list":
        watch_other_load()
    from nanovllm.experiments.runner import cmd_experiment as run

    return run(args, engine_kwargs(args))


def add_trace_args(trace: argparse.ArgumentParser) -> None:
    from nanovllm.trace_html.cli import add_trace_args as add

    add(trace)
    add_sampling_args(trace)
    add_engine_args(trace)


def cmd_trace(args: argparse.Namespace) -> int:
    watch_other_load()
    from nanovllm.trace_html.cli import cmd_trace as run

    return run(args, engine_kwargs(args), sampling_params(args))


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("generate", "generate text for prompts (offline batch)", add_generate_args, cmd_generate),
    Subcommand(
        "bench",
        "throughput benchmark, side by side with peers (also: bench serve, bench latency)",
        add_bench_args,
        cmd_bench,
    ),
    Subcommand(
        "experiment", "the study course's experiments 01-07: tables, CSV, plots", add_experiment_args, cmd_experiment
    ),
    Subcommand("trace", "run prompts and write the step trace as an HTML page", add_trace_args, cmd_trace),
]


# -------------------------------------------------------------------- parser
def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid log level {text!r} (choose from {', '.join(LOG_LEVELS)})")
    return level


def add_global_args(parser: argparse.ArgumentParser, top: bool) -> None:
    """Flags every subcommand accepts too (the subcommand's value wins)."""
    parser.add_argument(
        "--log-level",
        type=_log_level,
        metavar="LEVEL",
        default="WARNING" if top else argparse.SUPPRESS,
        help=f"logging level: {', '.join(LOG_LEVELS)} (default: WARNING)",
    )


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``only="generate"``: that subcommand alone (what ``main`` builds
    when the first argument names it: the other subcommands' flags import their modules, ~0.04 s)."""
    parser = CommandParser(prog="nanovllm", description="nanovllm: a compact LLM inference engine")
    parser.add_argument("--version", action="version", version=f"nanovllm {nanovllm.__version__}")
    add_global_args(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {}
    for cmd in SUBCOMMANDS:
        if only is not None and cmd.name != only:
            continue
        p = parsers[cmd.name] = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_args(p)
        p.set_defaults(func=cmd.run)
    if "bench" in parsers:
        add_serve_commands(sub, parsers["bench"])
    _add_global_args_everywhere(parser)
    return parser


def add_serve_commands(sub, bench) -> None:
    """`nanovllm serve` (entrypoints/openai/cli_args.py), `nanovllm run-batch` (run_batch.py),
    `nanovllm chat` and `complete` (client_cli.py),
    `nanovllm bench serve` and `nanovllm bench latency` (bench/args.py; the bench package never
    imports this module)."""
    from nanovllm.bench.args import add_bench_subcommands
    from nanovllm.entrypoints.client_cli import add_client_parsers
    from nanovllm.entrypoints.openai.cli_args import add_serve_parser
    from nanovllm.entrypoints.openai.run_batch import add_run_batch_parser

    add_serve_parser(sub)
    add_run_batch_parser(sub)
    add_client_parsers(sub)
    add_bench_subcommands(bench)


def _add_global_args_everywhere(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's parser (nested ones too, however registered) accepts the global flags."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                if "--log-level" not in child._option_string_actions:
                    add_global_args(child, top=False)
                _add_global_args_everywhere(child)


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. Without ``argv`` (the ``nanovllm`` command, ``python -m
    nanovllm.entrypoints.cli``) a ``generate`` ends the process when it is done (``exit_now``)."""
    args = None
    try:
        first = (sys.argv[1:] if argv is None else argv)[:1]
        args = build_parser(only="generate" if first == ["generate"] else None).parse_args(argv)
        logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s")
        status = args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"nanovllm: error: {e}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt:
        print("nanovllm: interrupted", file=sys.stderr)
        status = 130
    if argv is None and args is not None and args.func is cmd_generate:
        exit_now(status)
    return status


def exit_now(status: int) -> None:
    """End the process without the interpreter's finalisation, which tears down every module and
    object one by one: after torch and a model were loaded that takes about 0.4 s of a 3 s
    ``generate`` (BENCHMARKS.md, start-up). The atexit functions still run (logging's flush, a
    coverage collector's save), then stdout and stderr are flushed. Only for a command whose
    results are all written and closed; returns (a normal exit follows) while another
    non-daemon thread runs, since the interpreter's exit would wait for it."""
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe, a closed stream
            stream.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
