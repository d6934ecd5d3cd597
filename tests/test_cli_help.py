"""Every flag of every command and subcommand (``nanovllm X --help``, ``nanovllm bench serve
--help``, ...) says what it does; experiment's value flags say their defaults."""

from __future__ import annotations

import argparse

import pytest

from nanovllm.entrypoints import cli


def _commands(parser: argparse.ArgumentParser, path: str = "nanovllm"):
    """(command path, parser) for ``parser`` and every subcommand under it, nested ones too."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, child in action.choices.items():
                if id(child) not in seen:  # an alias names the same parser
                    seen.add(id(child))
                    yield from _commands(child, f"{path} {name}")


def _without_help(parser: argparse.ArgumentParser) -> list[str]:
    """The arguments --help lists with no text (a hidden one, help=SUPPRESS, is not listed)."""
    return [
        "/".join(a.option_strings) or a.dest
        for a in parser._actions
        if not isinstance(a, argparse._SubParsersAction) and not (a.help and a.help.strip())
    ]


def _all_commands() -> list:
    return [p for _, p in _commands(cli.build_parser())]


def _ids() -> list[str]:
    return [path for path, _ in _commands(cli.build_parser())]


def test_the_walk_reaches_nested_subcommands():
    paths = _ids()
    for path in ("nanovllm", "nanovllm generate", "nanovllm serve", "nanovllm bench serve", "nanovllm trace"):
        assert path in paths, paths


@pytest.mark.parametrize("parser", _all_commands(), ids=_ids())
def test_every_flag_has_help(parser):
    assert _without_help(parser) == []


def test_the_rule_sees_a_flag_without_help():
    """Negative control: the same check on a command with a silent flag (as serve's --port was)."""
    top = argparse.ArgumentParser(prog="x")
    sub = top.add_subparsers().add_parser("serve")
    sub.add_argument("--port", type=int, default=8000)
    sub.add_argument("--host", help="address to bind")
    sub.add_argument("--secret", help=argparse.SUPPRESS)
    found = {path: _without_help(p) for path, p in _commands(top, "x")}
    assert found == {"x": [], "x serve": ["--port"]}


def test_experiment_value_flags_show_their_defaults():
    parser = dict(_commands(cli.build_parser()))["nanovllm experiment"]
    for a in parser._actions:
        if a.option_strings and a.nargs != 0 and a.help != argparse.SUPPRESS:
            assert "(default: " in a.help, f"{a.option_strings}: {a.help!r}"
    out = next(a for a in parser._actions if "--out" in a.option_strings)
    assert out.help.endswith(f"(default: {out.default}/)"), out.help
